"""Cluster-side pieces of building a worker: the model path, its device, its engine with
this cluster's settings, and where it runs (node, device, NVLink domain).

The runtime the workers themselves share (the engine thread, sampling from the wire)
lives a floor below both pools, in ``engine/service.py``.
"""

from __future__ import annotations

import os
from typing import Any

from cluster.config import ClusterConfig, ConfigError
from cluster.topology import (
    LABEL_DOMAIN,
    LABEL_K8S_NODE,
    WorkerLocation,
    detect_location,
    label_value,
)

# ``model.path: stub``: engines without a model (engine/stub.py), for measuring the
# control plane alone (``tierserve bench-control``).
STUB_MODEL = "stub"


def resolve_model_path(path: str) -> str:
    if path == "default":
        from engine import default_model_path

        return str(default_model_path())
    return path


def resolve_device(cfg: ClusterConfig) -> str:
    if cfg.model.device != "auto":
        return cfg.model.device
    import torch

    return "cuda" if cfg.pools.num_gpus_per_worker > 0 and torch.cuda.is_available() else "cpu"


# The engine's setting names (EngineSettingError.setting) in this config tree.
_ENGINE_SETTINGS = {
    "model": "model.path", "dtype": "model.dtype", "device": "model.device",
    "num_kv_blocks": "pools.num_kv_blocks", "kv_cache_bytes": "pools.kv_cache_bytes",
    "kv_cache_fraction": "pools.kv_cache_memory_fraction",
    "attention": "model.attention", "block_size": "pools.block_size",
    "cuda_graph_max_batch": "pools.cuda_graph_max_batch",
    "num_swap_blocks": "pools.num_swap_blocks", "swap_bytes": "pools.swap_bytes",
}


def build_engine(cfg: ClusterConfig, *, role: str) -> Any:
    """An LLMEngine with this worker's KV budget; torch threads capped as configured.

    A setting the engine cannot honour on this device (an architecture it does not run, a
    dtype the device cannot run, a KV budget that does not fit) raises ConfigError naming
    the field of this tree and the limit."""
    import torch

    from engine import EngineConfig, EngineSettingError, LLMEngine

    torch.set_num_threads(cfg.pools.torch_threads)
    _quiet_loading()
    p = cfg.pools
    if cfg.model.path == STUB_MODEL:
        from engine.stub import make_stub_engine

        return make_stub_engine(p.num_kv_blocks or 16384, p.block_size,
                                max_num_seqs=p.max_num_seqs,
                                max_num_batched_tokens=p.max_num_batched_tokens,
                                step_s=cfg.model.stub_step_s, token_s=cfg.model.stub_token_s)
    budget: dict[str, Any] = {}
    if p.kv_cache_memory_fraction is not None:
        budget["kv_cache_fraction"] = p.kv_cache_memory_fraction
    try:
        ec = EngineConfig(
            model=resolve_model_path(cfg.model.path),
            dtype=cfg.model.dtype,
            device=resolve_device(cfg),
            block_size=p.block_size,
            num_kv_blocks=p.num_kv_blocks,
            kv_cache_bytes=p.kv_cache_bytes,
            prefill_chunk_size=p.prefill_chunk_size,
            max_num_batched_tokens=max(p.max_num_batched_tokens, p.max_num_seqs),
            max_num_seqs=p.max_num_seqs,
            attention=cfg.model.attention,
            cuda_graph_max_batch=p.cuda_graph_max_batch,
            # Only decode workers swap (prefill workers hand their blocks on).
            num_swap_blocks=p.num_swap_blocks if role == "decode" else 0,
            swap_bytes=p.swap_bytes if role == "decode" else None,
            enable_prefix_caching=p.prefix_caching,
            **budget,
        )
        return LLMEngine(ec)
    except EngineSettingError as e:
        name = _ENGINE_SETTINGS.get(e.setting, e.setting)
        raise ConfigError(f"{name}: {e.detail}") from None


def _quiet_loading() -> None:
    """No weight-loading progress bar: a worker loads again after every restart, and the
    bars would fill the console of ``tierserve serve`` (the load takes about a second)."""
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # an older transformers: its bar stays
        pass


def node_labels() -> dict[str, str]:
    """This process's Ray node labels ({} outside Ray)."""
    try:
        import ray

        if not ray.is_initialized():
            return {}
        return dict(ray.get_runtime_context().get_node_labels() or {})
    except Exception:  # outside a Ray worker (unit tests)
        return {}


def locate(cfg: ClusterConfig, role: str, index: int, device: str,
           labels: dict[str, str] | None = None) -> WorkerLocation:
    """This worker's node, device and NVLink domain.

    Node: the node label ``tierserve.io/k8s-node``, else the declared node, else the Ray
    node id. Domain: NVML / nvidia-smi on CUDA devices (GPU-local facts win), else the
    node label ``tierserve.io/nvlink-domain``, else the declared domain, else one
    domain per node. ``labels`` defaults to this Ray node's labels.
    """
    labels = node_labels() if labels is None else labels
    declared = cfg.topology.prefill if role == "prefill" else cfg.topology.decode
    entry = declared[index] if index < len(declared) else None
    node = label_value(labels, LABEL_K8S_NODE)
    if node is None and entry is not None:
        node = entry.node
    if node is None:
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()[:12]
        except Exception:  # outside Ray (unit tests): the host name
            node = os.uname().nodename
    domain = label_value(labels, LABEL_DOMAIN) or (entry.nvlink_domain if entry else None)
    return detect_location(node, device, domain)
