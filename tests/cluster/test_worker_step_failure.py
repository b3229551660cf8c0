"""A request that breaks a step ends alone on a real DecodeWorker (issue 13 item 7): its
router hears ``step_failed`` on its token stream, the other request of the same steps
finishes with the tokens it would have had alone, and every block comes back. Also the
prefill side's word for such a request (a ``Prefilled`` with an error) ends it here. A real
engine over a tiny random Llama whose runner raises on a poisoned prompt; no Ray."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.worker_runtime import build_engine
from cluster.worker_setup import limits, worker_policy
from decode_pool.worker import DecodeWorker
from engine.testing import make_tiny_checkpoint
from kvtransfer import KVConsumer, KVLocation, MockBackend, MockHub, TransferConfig
from scheduler.messages import (
    Dispatch,
    GenerationSpec,
    Prefilled,
    PrefilledBatch,
    SamplingSpec,
    StartPrefill,
    TokenBatch,
    WorkerEvent,
    decode,
)
from scheduler.step_costs import CPU_PRIOR, StepCosts
from scheduler.topology import WorkerInfo, WorkerRole

from ..engine.test_step_isolation import POISON, PoisonRunner

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny"))


def _spec(req_id: str, prompt: list[int]) -> GenerationSpec:
    return GenerationSpec(req_id, tuple(prompt), SamplingSpec(max_tokens=6, temperature=0.0),
                          tier=1, tenant="t", arrival_time=time.time(), router_id="router-1")


def test_a_poisoned_request_ends_alone_with_its_error(tiny_path: Path) -> None:
    cfg = ClusterConfig.from_dict({"model": {"path": str(tiny_path), "dtype": "float32"},
                                   "pools": {"num_kv_blocks": 64, "block_size": 4,
                                             "mode": "aggregated", "num_prefill": 0}})
    engine = build_engine(cfg, role="decode")
    engine.runner = PoisonRunner(engine.runner)
    consumer = KVConsumer(engine.pool, location=KVLocation("n0"), config=TransferConfig(),
                          backend=MockBackend(MockHub()))
    reports: list[object] = []
    started: list[str] = []

    async def report(rep: object) -> None:
        reports.append(rep)

    async def start_prefill(prefill_worker_id: str, msg: StartPrefill) -> str | None:
        started.append(msg.spec.req_id)
        return None

    async def scenario() -> dict[str, list[object]]:
        costs = StepCosts(CPU_PRIOR)
        info = WorkerInfo("decode-0", WorkerRole.DECODE, "n0", "cpu", "d0",
                          engine.num_total_blocks)
        worker = DecodeWorker(info, engine, consumer, worker_policy(cfg, engine, costs), costs,
                              limits(cfg), report, start_prefill, control_interval_s=0.05)
        worker.start()
        got: dict[str, list[object]] = {}
        ended: set[str] = set()
        try:
            total = engine.num_free_blocks
            stream = worker.subscribe("router-1")
            for rid, prompt in (("normal", [5, 6, 8, 9, 10]), ("poisoned", [5, POISON, 8])):
                answer = await worker.dispatch(Dispatch(_spec(rid, prompt), None, 2))
                assert answer.ok, answer
            # A reservation whose prefill worker reports the request failed on it alone.
            answer = await worker.dispatch(Dispatch(_spec("remote", [1, 2, 3]), "prefill-0", 1))
            assert answer.ok and started == ["remote"]
            await worker.prefilled(PrefilledBatch((Prefilled(
                "remote", 0, None, time.time(), "step_failed: RuntimeError: x"),)))
            deadline = time.monotonic() + 60
            while len(ended) < 3 and time.monotonic() < deadline:
                batch = decode(await asyncio.wait_for(anext(stream), 60), TokenBatch)
                for d in batch.deltas:
                    got.setdefault(d.req_id, []).append(d)
                    if d.finish or d.error:
                        ended.add(d.req_id)
            deadline = time.monotonic() + 10
            while engine.num_free_blocks < total and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert engine.num_free_blocks == total
            await stream.aclose()
        finally:
            await worker.stop()
        return got

    got = asyncio.run(scenario())
    consumer.close()
    errors = {rid: [d.error for d in ds if d.error] for rid, ds in got.items()}
    assert errors == {"normal": [], "poisoned": ["step_failed: RuntimeError: poisoned batch"],
                      "remote": ["step_failed: RuntimeError: x"]}
    normal = [t for d in got["normal"] for t in d.token_ids]
    # The normal request's tokens are those it gets alone (greedy), to its end.
    want = build_engine(cfg, role="decode").generate([[5, 6, 8, 9, 10]], _params())[0]
    assert normal == want and got["normal"][-1].finish
    aborted = [e for rep in reports for e in rep.events if e.event is WorkerEvent.ABORTED]
    assert sorted((e.req_id, e.reason) for e in aborted) == [("poisoned", "step_failed"),
                                                             ("remote", "step_failed")]


def _params():  # the sampling the worker runs for _spec's SamplingSpec
    from engine.service import sampling_params

    return sampling_params(_spec("x", [1]))
