"""A small KV budget: a tier-0 burst over running tier-3 requests preempts tier 3.

The tier-3 requests are swapped out or recomputed (as the policy prices it), resume, and
finish with the same tokens as an uninterrupted greedy run; afterwards every pool has
its full free count again. Requests go through the router's cluster backend directly.

The same run is observed as an operator would: ``/metrics`` (the router's FastAPI app
on uvicorn, over the same backend) parsed with prometheus-client's text parser shows the
preemption counters, KV usage and prefix lookups move; the trace JSONL file holds the
victim's preemption span naming its blocker; ``tierserve why`` prints its chain; and
``cluster.serve_app:app_builder`` reuses the running actors to build the Serve app."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import socket
import threading
import time
import urllib.request
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
def small_cluster(tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[tuple[object, Path, object, Path]]:
    import ray
    import torch

    from cluster.app import init_ray, start_workers
    from cluster.config import load_config
    from engine.testing import make_tiny_checkpoint

    torch.set_num_threads(1)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama")
    traces = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    cfg = load_config(overrides=[
        "pools.mode=disaggregated",  # these tests are about prefill -> decode transfers
        f"model.path={path}", "model.dtype=float32", "pools.num_prefill=1",
        "pools.num_decode=1", "pools.num_cpus_per_worker=0.25", "pools.num_kv_blocks=40",
        "pools.prefill_chunk_size=64", f"tiers.tiers={TIERS}", "tracing.enabled=true",
        f"tracing.jsonl_path={traces}"], environ={})
    init_ray(None, num_cpus=4)
    handles = start_workers(cfg)
    yield handles, path, cfg, traces
    ray.shutdown()


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    return [(s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name]


def _kv_used(text: str) -> float:
    return sum(v for labels, v in _samples(text, "tierserve:kv_cache_used_blocks")
               if "decode" in labels["worker_id"])


@contextlib.contextmanager
def _router(handles: object, path: Path, cfg: object) -> Iterator[str]:
    """The router's FastAPI app on uvicorn (127.0.0.1, a free port), in a thread."""
    import uvicorn

    from cluster.backend import ClusterBackend, HFTokenizer
    from router.app import build_app
    from router.tenants import TenantDirectory

    backend = ClusterBackend(handles.scheduler, handles.decode, HFTokenizer.from_path(str(path)),
                             "tiny", handles.max_model_len, 10.0, 300.0)
    app = build_app(backend, tenants=TenantDirectory([], cfg.tier_config.num_tiers))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        from cluster.testing import wait_until

        assert wait_until(lambda: server.started, 30), "uvicorn did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        return r.read().decode()


async def _burst(handles: object, path: Path) -> tuple[dict[str, list[int]], float]:
    """Runs the burst; also returns the decode KV blocks in use (from the scheduler's
    metrics) once the tier-3 requests are decoding."""
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
    kv_used = 0.0
    for _ in range(100):  # the decode worker's next report carries its KV use
        kv_used = _kv_used((await backend.metrics())[0].decode())
        if kv_used > 0:
            break
        await asyncio.sleep(0.1)
    high = [asyncio.create_task(run(f"high-{i}", p, 0, 4, None))
            for i, p in enumerate(HIGH_PROMPTS)]
    await asyncio.wait_for(asyncio.gather(*low, *high), 240)
    return out, kv_used


def test_tier0_burst_preempts_tier3_which_then_finish_identically(small_cluster) -> None:
    from cluster.cli import main as tierserve
    from cluster.testing import greedy_reference, wait_until

    handles, path, cfg, traces = small_cluster
    with _router(handles, path, cfg) as url:
        before = _scrape(url)
        out, kv_used_mid_burst = asyncio.run(_burst(handles, path))
        stats = handles.stats()
        assert any(k.startswith("3:") for k in stats["preemptions"]), stats["preemptions"]
        for i, prompt in enumerate(LOW_PROMPTS):
            assert out[f"low-{i}"] == greedy_reference(path, prompt, LOW_MAX_TOKENS)
        for i in range(len(HIGH_PROMPTS)):
            assert 1 <= len(out[f"high-{i}"]) <= 4

        def pools_full() -> bool:
            s = handles.stats()
            return s["num_live"] == 0 and all(w["free"] == w["total"]
                                              for w in s["workers"].values())

        assert wait_until(pools_full, 30), handles.stats()["workers"]

        # /metrics: preemptions of tier 3 counted, KV use seen mid-burst and back to 0.
        after = _scrape(url)
        preempted = [(labels, v) for labels, v in _samples(after, "tierserve:num_preemptions_total")
                     if labels["tier"] == "3"]
        assert not [v for labels, v in _samples(before, "tierserve:num_preemptions_total")
                    if labels["tier"] == "3" and v > 0]
        assert sum(v for _, v in preempted) >= 1
        assert {labels["mode"] for labels, _ in preempted} <= {"swap", "recompute"}
        assert _kv_used(before) == 0 and kv_used_mid_burst > 0 and _kv_used(after) == 0
        queried = _samples(after, "tierserve:prefix_cache_queries_total")
        assert queried and queried[0][1] > 0
        shares = _samples(after, "tierserve:tier_share")
        assert len(shares) == 4 and abs(sum(v for _, v in shares) - 1.0) < 1e-6
        assert all(v == 0 for _, v in _samples(after, "tierserve:num_requests_preempted"))

        # The trace file: a tier-3 victim's preemption span names its tier-0 blocker.
        spans = [json.loads(line) for line in traces.read_text().splitlines()]
        preemptions = [sp for sp in spans if sp["name"] == "preemption"
                       and sp["attributes"]["tierserve.preempt.blocking_req_id"]]
        assert preemptions, sorted({sp["name"] for sp in spans})
        attrs = preemptions[0]["attributes"]
        victim, blocker = attrs["tierserve.req_id"], attrs["tierserve.preempt.blocking_req_id"]
        assert victim.startswith("low-") and blocker.startswith("high-")
        assert attrs["tierserve.preempt.mode"] in ("swap", "recompute")
        assert any(e["attributes"]["blocking_req_id"] == blocker
                   for e in preemptions[0]["events"])
        roots = [sp for sp in spans
                 if sp["name"] == "request" and sp["attributes"]["tierserve.req_id"] == victim]
        assert roots and roots[0]["attributes"]["tierserve.num_preemptions"] >= 1

        # `tierserve why` tells the same chain over HTTP.
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert tierserve(["why", victim, "--url", url]) == 0
        assert victim in printed.getvalue() and blocker in printed.getvalue()
        assert "preempted" in printed.getvalue()


def test_serve_app_builder_reuses_the_running_actors(small_cluster, tmp_path: Path) -> None:
    import yaml
    from ray import serve

    from cluster.serve_app import app_builder

    handles, _, cfg, _ = small_cluster
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.to_dict()))
    app = app_builder({"config_path": str(config), "namespace": handles.namespace})
    assert isinstance(app, serve.Application)
    # Nothing new was started: the same named scheduler still answers, same workers.
    assert set(handles.stats()["workers"]) == {*handles.prefill, *handles.decode}
