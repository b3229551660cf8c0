"""What prefill and decode workers share: one engine thread, engine settings, reports.

The engine is not thread-safe, and its ``step()`` takes milliseconds to seconds, so a
worker (an async Ray actor) runs every engine call on one dedicated thread
(:class:`EngineThread`): the event loop stays free for control calls and token
streaming, and engine calls never overlap. Block events and lifecycle events are
collected between reports and shipped to the global scheduler as one msgpack dict
(:class:`ReportBuffer`, format in ``cluster/messages.py``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.config import ClusterConfig
from cluster.messages import WorkerEvent, event
from cluster.topology import (
    LABEL_DOMAIN,
    LABEL_K8S_NODE,
    WorkerLocation,
    detect_location,
    label_value,
)
from router.backend import GenerationSpec

T = TypeVar("T")


class EngineThread:
    """Runs callables on one thread, in submission order."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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


def build_engine(cfg: ClusterConfig, *, role: str) -> Any:
    """An LLMEngine with this worker's KV budget; torch threads capped as configured."""
    import torch

    from engine import EngineConfig, LLMEngine

    torch.set_num_threads(cfg.pools.torch_threads)
    p = cfg.pools
    dtype = cfg.model.dtype if cfg.model.dtype != "float16" else "auto"
    ec = EngineConfig(
        model=resolve_model_path(cfg.model.path),
        dtype=dtype,
        device=resolve_device(cfg),
        block_size=p.block_size,
        num_kv_blocks=p.num_kv_blocks,
        prefill_chunk_size=p.prefill_chunk_size,
        max_num_batched_tokens=max(p.max_num_batched_tokens, p.max_num_seqs),
        max_num_seqs=p.max_num_seqs,
    )
    return LLMEngine(ec)


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


def bytes_per_block(engine: Any) -> int:
    lay = engine.pool.kv_layout()
    elem = lay.dtype.itemsize if hasattr(lay.dtype, "itemsize") else 4
    return int(lay.num_layers * 2 * lay.block_size * lay.num_kv_heads * lay.head_dim * elem)


def sampling_params(spec: GenerationSpec) -> Any:
    from engine import SamplingParams

    s = spec.sampling
    return SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                          seed=s.seed, stop_token_ids=spec.stop_token_ids, logprobs=False)


class ReportBuffer:
    """Events gathered between two reports to the global scheduler."""

    def __init__(self, worker_id: str, role: str, location: WorkerLocation) -> None:
        self.worker_id = worker_id
        self.role = role
        self.location = location
        self.events: list[dict[str, Any]] = []
        self.block_events: list[dict[str, Any]] = []
        self.transfers: list[dict[str, Any]] = []

    def add(self, req_id: str, kind: WorkerEvent, **extra: Any) -> None:
        ev = event(req_id, kind, time.time())
        ev.update(extra)
        self.events.append(ev)

    def add_block_events(self, events: list[Any]) -> None:
        for e in events:
            d = e.to_dict()
            kind = "stored" if d.get("type") == "stored" else "removed"
            self.block_events.append({"kind": kind, "block_hashes": list(d["block_hashes"]),
                                      "parent_hash": d.get("parent_hash")})

    def take(self, **state: Any) -> dict[str, Any]:
        rep = {"worker_id": self.worker_id, "role": self.role,
               "location": self.location.to_dict(), "events": self.events,
               "block_events": self.block_events, "transfers": self.transfers, **state}
        self.events, self.block_events, self.transfers = [], [], []
        return rep
