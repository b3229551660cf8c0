"""Conditional disaggregation on a real local cluster (tiny random llama): in
``aggregated`` mode the decode workers prefill themselves (no prefill worker at all), in
``auto`` the kernel sends short prompts to the decode worker and long ones to the prefill
worker; greedy output is token for token transformers' either way, and every block comes
back. One Ray start for the module, the two deployments one after the other."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

MODEL = "tiny"
SHORT = list(range(10, 30))
LONG = list(range(40, 250))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from engine.testing import make_tiny_checkpoint

    torch.set_num_threads(1)
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def ray_up() -> Iterator[None]:
    import ray

    from cluster.app import init_ray

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    init_ray(None, num_cpus=4)
    yield
    from ray import serve

    serve.shutdown()
    ray.shutdown()


_PORT: list[int] = []


def _deploy(tiny_path: Path, mode: str, num_prefill: int, suffix: str,
            *extra: str) -> object:
    from cluster.app import deploy
    from cluster.config import load_config
    from cluster.testing import free_port

    if not _PORT:  # Serve keeps its first HTTP port for the life of the Ray instance
        _PORT.append(free_port())
    cfg = load_config(overrides=[
        f"model.path={tiny_path}", f"model.served_name={MODEL}", f"router.port={_PORT[0]}",
        "model.dtype=float32", f"pools.mode={mode}", f"pools.num_prefill={num_prefill}",
        "pools.num_decode=1", "pools.num_cpus_per_worker=0.25", "pools.num_kv_blocks=96",
        "pools.prefill_chunk_size=32", "router.rpc_timeout_s=5", *extra], environ={})
    return deploy(cfg, suffix=suffix)


def _all_blocks_free(cluster: object) -> bool:
    stats = cluster.handles.stats()
    return stats["num_live"] == 0 and all(
        w["free"] == w["total"] for w in stats["workers"].values() if w["alive"])


def _greedy_matches(cluster: object, tiny_path: Path) -> None:
    import openai
    from transformers import AutoTokenizer

    from cluster.testing import greedy_reference

    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0,
                           timeout=120)
    tok = AutoTokenizer.from_pretrained(str(tiny_path))
    for prompt in (SHORT, LONG):
        ref = greedy_reference(tiny_path, prompt, 12)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                        temperature=0)
        assert got.choices[0].text == tok.decode(ref, skip_special_tokens=True)


def test_aggregated_mode_serves_without_prefill_workers(ray_up, tiny_path) -> None:
    from cluster.testing import wait_until

    cluster = _deploy(tiny_path, "aggregated", 0, "-agg")
    try:
        assert not cluster.handles.prefill
        _greedy_matches(cluster, tiny_path)
        stats = cluster.handles.stats()
        assert stats["mode"] == "aggregated"
        assert sum(stats["transfers_by_class"].values()) == 2
        assert stats["transfers_by_class"]["same_device"] == 2  # prefilled in place
        assert wait_until(lambda: _all_blocks_free(cluster), 30)
    finally:
        cluster.shutdown()


def test_auto_mode_prefills_short_prompts_on_the_decode_worker(ray_up, tiny_path) -> None:
    from cluster.testing import wait_until

    cluster = _deploy(tiny_path, "auto", 1, "-auto", "pools.auto_local_prefill_max_tokens=64")
    try:
        _greedy_matches(cluster, tiny_path)
        by_class = cluster.handles.stats()["transfers_by_class"]
        # The 20-token prompt stays on the decode worker, the 210-token one (over the
        # 64-token local limit) is prefilled on the prefill worker and streamed over.
        assert by_class["same_device"] == 1 and sum(by_class.values()) == 2
        assert wait_until(lambda: _all_blocks_free(cluster), 30)
    finally:
        cluster.shutdown()
