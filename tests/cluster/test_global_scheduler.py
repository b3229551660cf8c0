"""The global scheduler actor's body over fake workers (no Ray): it applies the kernel's
plans as concurrent RPCs, feeds the answers back, turns aborts with an error into router
notices, removes workers that fail, and records metrics, logs and traces. The decisions
themselves are tested on the kernel (tests/scheduler/test_cluster_scheduler.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.global_scheduler import GlobalScheduler, WorkerGone
from scheduler.block_hashes import compute_block_hashes
from scheduler.messages import (
    Dispatch,
    DispatchAnswer,
    FinishBatch,
    FinishTiming,
    GenerationSpec,
    NoticeBatch,
    PreemptCall,
    ReqEvent,
    RunningReq,
    SamplingSpec,
    SubmitBatch,
    SubmitOutcome,
    WorkerEvent,
    WorkerReport,
    decode,
)
from scheduler.request import Decision, RequestState
from scheduler.testing import make_costs
from scheduler.tiers import cpu_tiers
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16


class FakeWorkers:
    """Decode workers with a block count; records every call in order."""

    def __init__(self, free: dict[str, int]) -> None:
        self.free = dict(free)
        self.calls: list[tuple[str, str, Any]] = []
        self.dead: set[str] = set()
        self.hashes: dict[str, tuple[int, ...]] = {}

    def _check(self, wid: str) -> None:
        if wid in self.dead:
            raise WorkerGone(wid)

    async def dispatch(self, worker_id: str, msg: Dispatch) -> DispatchAnswer:
        self._check(worker_id)
        self.calls.append(("dispatch", worker_id, (msg.spec.req_id, msg.prefill_worker_id)))
        self.hashes[msg.spec.req_id] = msg.block_hashes
        if self.free[worker_id] < msg.num_blocks:
            return DispatchAnswer(msg.spec.req_id, False, self.free[worker_id])
        self.free[worker_id] -= msg.num_blocks
        return DispatchAnswer(msg.spec.req_id, True, self.free[worker_id])

    async def preempt(self, worker_id: str, msg: PreemptCall) -> bool:
        self._check(worker_id)
        self.calls.append(("preempt", worker_id, (msg.req_id, msg.mode.value, msg.for_req_id)))
        return True

    async def abort(self, worker_id: str, req_id: str) -> None:
        self._check(worker_id)
        self.calls.append(("abort", worker_id, req_id))


def make_scheduler(free: dict[str, int], tracer: Any = None) -> tuple[GlobalScheduler, FakeWorkers]:
    workers = FakeWorkers(free)
    gs = GlobalScheduler(cpu_tiers(), "tierserve", BS, workers, make_costs(),
                         control_interval_s=0.01, tracer=tracer)
    for wid, dom in (("p-a", "A"), ("p-b", "B")):
        gs.register_worker(WorkerInfo(wid, WorkerRole.PREFILL, "n", "cpu", dom, 64), 64,
                           can_prefill=True, can_decode=False)
    for wid in free:
        dom = "A" if wid.endswith("a") else "B"
        gs.register_worker(WorkerInfo(wid, WorkerRole.DECODE, "n", "cpu", dom, free[wid]),
                           free[wid],
                           can_prefill=False, can_decode=True)
    return gs, workers


def spec(rid: str, n: int, tier: int = 1, router: str = "router-1") -> GenerationSpec:
    return GenerationSpec(rid, tuple(range(n)), SamplingSpec(8, 0.0), tier, "t", time.time(),
                          router_id=router)


async def settle(gs: GlobalScheduler) -> None:
    """Run the plan loop until no RPC is in flight."""
    for _ in range(50):
        await asyncio.sleep(0.005)
        if not gs._tasks and not gs._wake.is_set():
            return


def test_accepted_requests_are_dispatched_in_domain_and_answers_move_them() -> None:
    async def go() -> None:
        gs, w = make_scheduler({"d-a": 64, "d-b": 64})
        answers = gs.submit_batch(SubmitBatch(tuple(spec(f"r{i}", 40) for i in range(4))))
        assert [a.outcome for a in answers.answers] == [SubmitOutcome.ACCEPTED] * 4
        await settle(gs)
        sent = [c for c in w.calls if c[0] == "dispatch"]
        assert {c[2][0] for c in sent} == {f"r{i}" for i in range(4)}
        for _, dwid, (_, pwid) in sent:
            assert dwid[-1] == pwid[-1]  # the decode worker is in its prefill worker's domain
        assert all(gs.core.get(f"r{i}").state is RequestState.PREFILLING for i in range(4))
        assert gs.transfers_by_class["same_domain"] == 4
        # The prompt is hashed once, here, and its hashes go with the dispatch.
        assert w.hashes["r0"] == tuple(compute_block_hashes(list(range(40)), BS))
        assert len(w.hashes["r0"]) == 40 // BS
        await gs.close()

    asyncio.run(go())


def test_reports_move_the_state_machine_and_router_finish_feeds_metrics() -> None:
    async def go() -> None:
        gs, w = make_scheduler({"d-a": 64})
        gs.submit_batch(SubmitBatch((spec("x", 20, tier=0),)))
        await settle(gs)
        now = time.time()
        gs.report(WorkerReport("p-a", 64, 64, (ReqEvent("x", WorkerEvent.PREFILL_DONE, now),)))
        gs.report(WorkerReport("d-a", 60, 64, (ReqEvent("x", WorkerEvent.DECODE_START, now),),
                               running=(RunningReq("x", 2, 3),)))
        assert gs.core.get("x").state is RequestState.DECODING
        gs.finish_batch(FinishBatch((FinishTiming("x", now - 0.5, now, now + 0.1, 5, "length"),)))
        assert gs.core.get("x") is None
        states = [r.to_state for r in gs.logs["x"].records]
        assert states[-1] is RequestState.FINISHED_LENGTH
        assert gs.why("x")["req_id"] == "x"
        text = gs.render_metrics()[0].decode()
        assert 'tierserve:request_success_total{finished_reason="length",tier="0"} 1.0' in text
        await gs.close()

    asyncio.run(go())


def test_a_first_prefill_is_split_into_its_hops_once() -> None:
    """Issue 22 item 6: the wait a tier-0 prompt still has, hop by hop. The kernel's
    arrival and dispatch and the prefill worker's receipt and step start split its time to
    first token into the global queue, the hand-off, the wait for a step and the prefill
    (``tierserve:ttft_part_seconds``, and in stats for the benches)."""
    async def go() -> None:
        gs, _ = make_scheduler({"d-a": 64})
        s = spec("x", 20, tier=0)
        gs.submit_batch(SubmitBatch((s,)))
        await settle(gs)
        # The dispatch order's time: the kernel moves the request to PREFILLING only on the
        # decode worker's answer, which may come after the prefill worker has it.
        sent = gs.core.live["x"].dispatched_at
        assert 0 < sent <= time.time()
        got, began, first = sent + 0.01, sent + 0.03, sent + 0.08
        gs.report(WorkerReport("p-a", 64, 64, (ReqEvent(
            "x", WorkerEvent.PREFILL_DONE, first, received=got, started=began),)))
        # A second PREFILL_DONE (a report sent twice) is not a second first token.
        gs.report(WorkerReport("p-a", 64, 64, (ReqEvent(
            "x", WorkerEvent.PREFILL_DONE, first, received=got, started=began),)))
        hops = gs.stats()["ttft_parts"]["0"]
        assert {p: h["count"] for p, h in hops.items()} == {
            "queued": 1, "handoff": 1, "step_wait": 1, "prefill": 1}
        assert hops["queued"]["sum"] == pytest.approx(sent - s.arrival_time)
        assert hops["handoff"]["sum"] == pytest.approx(0.01)
        assert hops["step_wait"]["sum"] == pytest.approx(0.02)
        assert hops["prefill"]["sum"] == pytest.approx(0.05)
        assert "tierserve:ttft_part_seconds_bucket" in gs.render_metrics()[0].decode()
        # Clocks that disagree (a step that began before the prompt arrived) say nothing.
        gs.submit_batch(SubmitBatch((spec("y", 20, tier=0),)))
        await settle(gs)
        now = time.time()
        gs.report(WorkerReport("p-a", 64, 64, (ReqEvent(
            "y", WorkerEvent.PREFILL_DONE, now, received=now, started=now - 1.0),)))
        assert gs.stats()["ttft_parts"]["0"]["prefill"]["count"] == 1
        await gs.close()

    asyncio.run(go())


def test_a_worker_abort_ends_the_request_on_every_worker_and_tells_its_router() -> None:
    async def go() -> None:
        gs, w = make_scheduler({"d-a": 64})
        notices = gs.notices("router-1")
        first = decode(await anext(notices), NoticeBatch)  # the shed state on subscribing
        assert first.notices == ()
        gs.submit_batch(SubmitBatch((spec("bad", 40),)))
        await settle(gs)
        gs.report(WorkerReport("d-a", 61, 64, (ReqEvent("bad", WorkerEvent.ABORTED,
                                                         time.time(), reason="engine_error"),)))
        await settle(gs)
        assert gs.core.get("bad") is None
        aborted = {c[1] for c in w.calls if c[0] == "abort" and c[2] == "bad"}
        assert aborted == {"p-a", "d-a"}
        got = decode(await asyncio.wait_for(anext(notices), 2), NoticeBatch)
        assert [(n.req_id, n.error, n.retryable) for n in got.notices] == [
            ("bad", "engine_error", False)]
        await notices.aclose()
        await gs.close()

    asyncio.run(go())


def test_preempt_orders_are_sent_and_counted() -> None:
    async def go() -> None:
        gs, w = make_scheduler({"d-a": 16})
        gs.submit_batch(SubmitBatch((spec("low", 200, tier=3),)))  # 13 blocks
        await settle(gs)
        now = time.time()
        gs.report(WorkerReport("p-a", 64, 64, (ReqEvent("low", WorkerEvent.PREFILL_DONE, now),)))
        gs.report(WorkerReport("d-a", 0, 16, (ReqEvent("low", WorkerEvent.DECODE_START, now),),
                               running=(RunningReq("low", 16, 2),)))
        gs.submit_batch(SubmitBatch((spec("high", 100, tier=0),)))
        await settle(gs)
        victims = [c[2] for c in w.calls if c[0] == "preempt"]
        assert victims and victims[0][0] == "low" and victims[0][2] == "high"
        assert sum(gs.preemptions.values()) == 1
        await gs.close()

    asyncio.run(go())


def test_work_conservation_reaches_stats_and_the_metrics_per_tier(monkeypatch) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    def counter(gs: GlobalScheduler) -> dict[str, float]:
        text = gs.render_metrics()[0].decode()
        return {s.labels["tier"]: s.value for fam in text_string_to_metric_families(text)
                for s in fam.samples if s.name == "tierserve:work_conservation_seconds_total"}

    async def go() -> None:
        gs, _ = make_scheduler({"d-a": 64})
        gs.submit_batch(SubmitBatch((spec("x", 40, tier=2),)))
        await settle(gs)
        # Nothing that fitted was left waiting: zero for every tier, in both places.
        assert gs.stats()["work_conservation_s"] == [0.0] * 4
        assert counter(gs) == {str(t): 0.0 for t in range(4)}
        # What the kernel counts is what both show, per tier.
        asked: list[float] = []

        def totals(now: float) -> tuple[float, ...]:
            asked.append(now)
            return (0.0, 1.5, 0.0, 0.25)

        monkeypatch.setattr(gs.core, "work_conservation_s", totals)
        assert gs.stats()["work_conservation_s"] == [0.0, 1.5, 0.0, 0.25]
        assert counter(gs) == {"0": 0.0, "1": 1.5, "2": 0.0, "3": 0.25}
        assert counter(gs)["1"] == 1.5  # a scrape again counts nothing twice
        assert asked and all(abs(t - time.time()) < 60 for t in asked)  # asked for now
        await gs.close()

    asyncio.run(go())


def test_a_dead_worker_ends_its_requests_with_a_retryable_notice() -> None:
    async def go() -> None:
        gs, w = make_scheduler({"d-a": 64, "d-b": 64})
        notices = gs.notices("router-1")
        await anext(notices)
        w.dead.add("d-b")
        gs.submit_batch(SubmitBatch(tuple(spec(f"r{i}", 30) for i in range(4))))
        await settle(gs)
        assert gs.stats()["workers"]["d-b"]["alive"] is False
        got = decode(await asyncio.wait_for(anext(notices), 2), NoticeBatch)
        assert got.notices and all(n.error == "worker_failed" and n.retryable
                                   for n in got.notices)
        # What d-b lost is ended; the rest went to d-a.
        live = [rid for rid in (f"r{i}" for i in range(4)) if gs.core.get(rid) is not None]
        assert all(gs.core.get(r).decode_worker_id == "d-a" for r in live)
        await notices.aclose()
        await gs.close()

    asyncio.run(go())


def test_closed_requests_are_traced_and_scrapes_snapshot_counts_and_shares() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from prometheus_client.parser import text_string_to_metric_families

    from cluster.tracing import RequestTracer

    def samples(gs: GlobalScheduler) -> dict[tuple[str, tuple], float]:
        text = gs.render_metrics()[0].decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    async def go() -> None:
        exporter = InMemorySpanExporter()
        gs, _ = make_scheduler({"d-a": 64}, tracer=RequestTracer(exporter))
        gs.submit_batch(SubmitBatch((spec("x", 40, tier=2),)))
        await settle(gs)
        m = samples(gs)
        assert m[("tierserve:num_requests_running", (("tier", "2"),))] == 1
        assert m[("tierserve:prefix_cache_queries_total", ())] == 40 // BS
        assert sum(v for (name, _), v in m.items() if name == "tierserve:tier_share") \
            == pytest.approx(1.0)
        now = time.time()
        gs.report(WorkerReport("d-a", 61, 64, (
            ReqEvent("x", WorkerEvent.PREFILL_DONE, now),
            ReqEvent("x", WorkerEvent.DECODE_START, now),
            ReqEvent("x", WorkerEvent.PREEMPTED_SWAP, now, for_req_id="y"))))
        m = samples(gs)
        assert m[("tierserve:num_requests_preempted", (("tier", "2"),))] == 1
        assert m[("tierserve:num_requests_swapped", (("tier", "2"),))] == 1
        assert m[("tierserve:num_requests_running", (("tier", "2"),))] == 0
        assert not exporter.get_finished_spans()  # traced when closed, not before
        gs.abort("x")
        spans = exporter.get_finished_spans()
        (pre,) = [s for s in spans if s.name == "preemption"]
        assert pre.attributes["tierserve.preempt.blocking_req_id"] == "y"
        assert {s.attributes["tierserve.req_id"] for s in spans} == {"x"}
        await gs.close()

    asyncio.run(go())


def test_the_scheduler_actor_does_not_load_torch() -> None:
    """Issue 23: the global scheduler decides in pure objects; its actor's process loads no
    torch (the prompt's block hashes, the cost and link priors and the asyncio helpers it
    uses live below the engine's model code)."""
    import subprocess
    import sys

    code = ("import sys, cluster.scheduler_actor, cluster.global_scheduler; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_health_counts_the_live_workers_of_each_role() -> None:
    gs, _ = make_scheduler({"d-a": 64, "d-b": 64})
    assert gs.health() == {"policy": "tierserve", "mode": gs.core.mode.value,
                           "live_workers": {"prefill": 2, "decode": 2}}
    gs.worker_failed("d-b")
    assert gs.health()["live_workers"] == {"prefill": 2, "decode": 1}


def test_the_planner_window_reads_reports_ends_and_kv_in_use() -> None:
    async def go() -> None:
        gs, _ = make_scheduler({"d-a": 64})
        gs.submit_batch(SubmitBatch((spec("x", 20, tier=0),)))
        await settle(gs)
        gs.pool_window.start = time.time() - 10.0  # a 10 s window, whatever the clock did
        gs.report(WorkerReport("p-a", 64, 64, step_seconds=1.0))
        gs.report(WorkerReport("p-a", 64, 64, step_seconds=6.0))
        gs.report(WorkerReport("d-a", 16, 64, step_seconds=2.0))
        gs.report(WorkerReport("d-a", 16, 64, step_seconds=4.0))
        gs.core.abort("x", time.time(), Decision.ERROR, "test", error="boom")  # a tier-0 miss
        sig = gs.planner_signals(time.time(), 2, 1)
        assert (sig.num_prefill, sig.num_decode) == (2, 1)
        assert sig.kv_used == pytest.approx(48 / 64)
        assert sig.tier0_attainment == 0.0 and sig.tier0_prefill_waits
        assert sig.prefill_busy == pytest.approx(5.0 / 20.0, rel=0.05)  # 5 s of 2 x 10 s
        assert sig.decode_busy == pytest.approx(2.0 / 10.0, rel=0.05)
        # The next window starts empty.
        assert gs.planner_signals(time.time(), 2, 1).tier0_attainment is None
        await gs.close()

    asyncio.run(go())
