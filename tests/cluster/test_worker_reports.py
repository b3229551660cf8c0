"""A worker's report that does not reach the global scheduler keeps its events for the next
one (issue 22 item 4: the scheduler's books of a worker follow its reports): the scheduler
link says whether the report got there, and a real DecodeWorker over a stub engine
(engine/stub.py, prefilling locally) keeps what did not; no Ray. The prefill worker's
counterpart is in test_prefill_worker.py."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from cluster.config import ClusterConfig
from cluster.scheduler_link import SchedulerLink
from cluster.worker_setup import limits, worker_policy
from decode_pool.worker import DecodeWorker
from engine.stub import make_stub_engine
from kvtransfer import KVConsumer, KVLocation, MockBackend, MockHub, TransferConfig
from scheduler.messages import (
    Dispatch,
    GenerationSpec,
    SamplingSpec,
    StartPrefill,
    WorkerEvent,
    WorkerReport,
)
from scheduler.step_costs import CPU_PRIOR, StepCosts
from scheduler.topology import WorkerInfo, WorkerRole

torch.set_num_threads(1)

FINISHED = (WorkerEvent.FINISHED_LENGTH, WorkerEvent.FINISHED_STOP)
WAIT_S = 30.0  # a bound on waiting for a state, never a measurement


@pytest.mark.parametrize("failure", ["raises", "not delivered"])
def test_a_report_that_fails_keeps_its_events_for_the_next(failure: str) -> None:
    cfg = ClusterConfig.from_dict({
        "model": {"path": "stub"},
        "pools": {"mode": "aggregated", "num_prefill": 0, "block_size": 4,
                  "num_kv_blocks": 64, "prefill_chunk_size": 16,
                  "max_num_batched_tokens": 16, "max_num_seqs": 8}})
    engine = make_stub_engine(64, 4, max_num_seqs=8, max_num_batched_tokens=16)
    consumer = KVConsumer(engine.pool, location=KVLocation("n0"), config=TransferConfig(),
                          backend=MockBackend(MockHub()))
    failed: list[WorkerReport] = []
    delivered: list[WorkerReport] = []

    async def report(rep: WorkerReport) -> bool:
        if not failed and any(e.event in FINISHED for e in rep.events):
            failed.append(rep)
            if failure == "raises":
                raise TimeoutError("the scheduler did not answer")
            return False
        delivered.append(rep)
        return True

    async def start_prefill(prefill_worker_id: str, msg: StartPrefill) -> str | None:
        raise AssertionError("every prompt is prefilled here")

    async def until(cond, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"never: {what}")
            await asyncio.sleep(0.005)

    async def scenario() -> None:
        costs = StepCosts(CPU_PRIOR)
        info = WorkerInfo("decode-0", WorkerRole.DECODE, "n0", "cpu", "d0",
                          engine.num_total_blocks)
        worker = DecodeWorker(info, engine, consumer, worker_policy(cfg, engine, costs), costs,
                              limits(cfg), report, start_prefill, control_interval_s=0.05)
        worker.start()
        try:
            spec = GenerationSpec("r1", tuple(range(3, 19)),
                                  SamplingSpec(max_tokens=4, temperature=0.0), tier=1,
                                  tenant="t", arrival_time=time.time(), router_id="router-1")
            assert (await worker.dispatch(Dispatch(spec, None, 4))).ok
            await until(lambda: bool(failed), "the report with the finish fails")
            n = len(delivered)
            await until(lambda: len(delivered) > n, "a later report is delivered")
        finally:
            await worker.stop()

    try:
        asyncio.run(scenario())
    finally:
        consumer.close()
    ended = [e for rep in delivered for e in rep.events if e.event in FINISHED]
    assert [e.req_id for e in ended] == ["r1"]
    assert ended[0] == next(e for e in failed[0].events if e.event in FINISHED)


class _Scheduler:
    """A stand-in for the scheduler actor's handle: ``report.remote`` answers ``known`` or
    raises ``error``."""

    def __init__(self, known: bool = True, error: Exception | None = None) -> None:
        self.known, self.error = known, error
        self.report = self

    def remote(self, raw: bytes):
        async def answer() -> bool:
            if self.error is not None:
                raise self.error
            return self.known
        return answer()


@pytest.mark.parametrize("scheduler, taken", [
    (_Scheduler(known=True), True),
    (_Scheduler(known=False), False),  # it does not know this worker (yet): not applied
    (_Scheduler(error=RuntimeError("actor restarting")), False),
])
def test_the_link_says_whether_the_scheduler_took_the_report(scheduler, taken) -> None:
    link = SchedulerLink("sched", "ns", "decode-0", "inc-1")
    link._handle = scheduler
    link.register_soon = lambda: None  # an unknown answer would start a registration
    link.is_registered = True
    assert asyncio.run(link.report(WorkerReport("decode-0", 1, 1))) is taken


def test_a_worker_whose_kv_listener_is_down_says_so_in_its_report() -> None:
    """The KV accept thread kept failing (here: its store is gone) and its supervisor gave
    up: no new pair can open, so the worker reports itself unhealthy and the scheduler's
    watch replaces it (issue 24 item 2). Before, the worker kept stepping and nobody knew."""
    cfg = ClusterConfig.from_dict({
        "model": {"path": "stub"},
        "pools": {"mode": "aggregated", "num_prefill": 0, "block_size": 4,
                  "num_kv_blocks": 64, "prefill_chunk_size": 16,
                  "max_num_batched_tokens": 16, "max_num_seqs": 8}})
    engine = make_stub_engine(64, 4, max_num_seqs=8, max_num_batched_tokens=16)
    backend = MockBackend(MockHub())
    consumer = KVConsumer(engine.pool, location=KVLocation("n0"), config=TransferConfig(),
                          backend=backend)
    delivered: list[WorkerReport] = []

    async def report(rep: WorkerReport) -> bool:
        delivered.append(rep)
        return True

    async def start_prefill(prefill_worker_id: str, msg: StartPrefill) -> str | None:
        raise AssertionError("no prompt here")

    async def scenario() -> None:
        costs = StepCosts(CPU_PRIOR)
        info = WorkerInfo("decode-0", WorkerRole.DECODE, "n0", "cpu", "d0",
                          engine.num_total_blocks)
        worker = DecodeWorker(info, engine, consumer, worker_policy(cfg, engine, costs), costs,
                              limits(cfg), report, start_prefill, control_interval_s=0.05)
        worker.start()
        try:
            deadline = time.monotonic() + WAIT_S
            while not delivered and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert delivered and delivered[-1].is_healthy
            backend.shutdown()  # the consumer's own store goes away
            while ((not delivered or delivered[-1].is_healthy)
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.01)
            assert not delivered[-1].is_healthy
            status = worker.status()
            assert status["kv_healthy"] is False and status["kv_thread_restarts"] == 5
        finally:
            await worker.stop()

    try:
        asyncio.run(scenario())
    finally:
        consumer.close()
