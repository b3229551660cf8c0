"""A small KV budget: a tier-0 burst over running tier-3 requests preempts tier 3.

The tier-3 requests are swapped out or recomputed (as the policy prices it), resume, and
finish with the same tokens as an uninterrupted greedy run; afterwards every pool has
its full free count again. Requests go through the router's cluster backend directly."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LOW_PROMPTS = [list(range(10 + 3 * i, 110 + 3 * i)) for i in range(3)]  # 100 tokens each
LOW_MAX_TOKENS = 120
HIGH_PROMPTS = [[(37 * i + 11 * k) % 250 for k in range(150)] for i in range(4)]
TIERS = ("[{name: rt, ttft_s: 10, tpot_s: 1, share: 0.4, weight: 8}, "
         "{name: ia, ttft_s: 20, tpot_s: 2, share: 0.3, weight: 4}, "
         "{name: batch, e2e_s: 120, share: 0.2, weight: 2}, "
         "{name: be, e2e_s: 600, share: 0.1, weight: 1}]")


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path]]:
    import ray
    import torch

    from cluster.app import init_ray, start_workers
    from cluster.config import load_config
    from engine.testing import make_tiny_checkpoint

    torch.set_num_threads(1)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")
    cfg = load_config(overrides=[
        f"model.path={path}", "model.dtype=float32", "pools.num_prefill=1",
        "pools.num_decode=1", "pools.num_cpus_per_worker=0.25", "pools.num_kv_blocks=40",
        "pools.prefill_chunk_size=64", f"tiers.tiers={TIERS}"], environ={})
    init_ray(None, num_cpus=4)
    handles = start_workers(cfg)
    yield handles, path
    ray.shutdown()


async def _burst(handles: object, path: Path) -> dict[str, list[int]]:
    from cluster.backend import ClusterBackend, HFTokenizer
    from router.backend import GenerationSpec, SamplingSpec

    backend = ClusterBackend(handles.scheduler, handles.decode, HFTokenizer.from_path(str(path)),
                             "tiny", handles.max_model_len, 10.0, 300.0)
    out: dict[str, list[int]] = {}
    started = [asyncio.Event() for _ in LOW_PROMPTS]

    async def run(rid: str, prompt: list[int], tier: int, max_tokens: int,
                  progress: asyncio.Event | None) -> None:
        spec = GenerationSpec(rid, tuple(prompt), SamplingSpec(max_tokens, 0.0), tier=tier,
                              tenant="t", arrival_time=time.time())
        ids: list[int] = []
        async for delta in backend.generate(spec):
            ids.extend(delta.token_ids)
            if progress is not None and len(ids) >= 12:
                progress.set()
        out[rid] = ids
        if progress is not None:
            progress.set()

    low = [asyncio.create_task(run(f"low-{i}", p, 3, LOW_MAX_TOKENS, started[i]))
           for i, p in enumerate(LOW_PROMPTS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
    high = [asyncio.create_task(run(f"high-{i}", p, 0, 4, None))
            for i, p in enumerate(HIGH_PROMPTS)]
    await asyncio.wait_for(asyncio.gather(*low, *high), 240)
    return out


def test_tier0_burst_preempts_tier3_which_then_finish_identically(small_cluster) -> None:
    from cluster.testing import greedy_reference, wait_until

    handles, path = small_cluster
    out = asyncio.run(_burst(handles, path))
    stats = handles.stats()
    assert any(k.startswith("3:") for k in stats["preemptions"]), stats["preemptions"]
    for i, prompt in enumerate(LOW_PROMPTS):
        assert out[f"low-{i}"] == greedy_reference(path, prompt, LOW_MAX_TOKENS)
    for i in range(len(HIGH_PROMPTS)):
        assert 1 <= len(out[f"high-{i}"]) <= 4

    def pools_full() -> bool:
        s = handles.stats()
        return s["num_live"] == 0 and all(w["free"] == w["total"] for w in s["workers"].values())

    assert wait_until(pools_full, 30), handles.stats()["workers"]
