"""The global scheduler over fake workers (the layer above the Ray workers, no Ray):
placement by domain, reservation before prefill, preemption for a higher tier,
worker reports driving the state machine, dead workers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from cluster.global_scheduler import GlobalScheduler, WorkerGone
from cluster.messages import WorkerEvent, event
from scheduler.request import RequestState
from scheduler.tiers import default_tiers
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16


class FakeWorkers:
    """Decode workers with a block count; records every call in order."""

    def __init__(self, free: dict[str, int]) -> None:
        self.free = dict(free)
        self.calls: list[tuple[str, str, Any]] = []
        self.dead: set[str] = set()

    def _check(self, wid: str) -> None:
        if wid in self.dead:
            raise WorkerGone(wid)

    async def reserve(self, worker_id: str, msg: dict[str, Any]) -> dict[str, Any]:
        self._check(worker_id)
        need = -(-len(msg["prompt_token_ids"]) // BS)
        self.calls.append(("reserve", worker_id, msg["req_id"]))
        if self.free[worker_id] < need:
            return {"ok": False, "num_free_blocks": self.free[worker_id]}
        self.free[worker_id] -= need
        return {"ok": True, "ticket": {"req_id": msg["req_id"]}, "num_cached_blocks": 0,
                "num_free_blocks": self.free[worker_id]}

    async def start_prefill(self, worker_id: str, msg: dict[str, Any]) -> None:
        self._check(worker_id)
        self.calls.append(("start", worker_id, msg["spec"]["req_id"]))

    async def preempt(self, worker_id: str, req_id: str, mode: str, for_req_id: str) -> bool:
        self._check(worker_id)
        self.calls.append(("preempt", worker_id, (req_id, mode, for_req_id)))
        return True

    async def abort(self, worker_id: str, req_id: str) -> None:
        self._check(worker_id)
        self.calls.append(("abort", worker_id, req_id))


def make_scheduler(free: dict[str, int], policy: str = "tierserve"
                   ) -> tuple[GlobalScheduler, FakeWorkers]:
    workers = FakeWorkers(free)
    gs = GlobalScheduler(default_tiers(), policy, BS, workers, control_interval_s=0.01)
    for wid, dom in (("p-a", "A"), ("p-b", "B")):
        gs.register_worker(WorkerInfo(wid, WorkerRole.PREFILL, "n", "cpu", dom, 64), 64)
    for wid in free:
        dom = "A" if wid.endswith("a") else "B"
        gs.register_worker(WorkerInfo(wid, WorkerRole.DECODE, "n", "cpu", dom, 64), free[wid])
    return gs, workers


def spec(rid: str, n: int, tier: int = 1) -> dict[str, Any]:
    return {"req_id": rid, "prompt_token_ids": list(range(n)), "max_tokens": 8, "tier": tier,
            "temperature": 0.0, "top_p": 1.0, "seed": None, "tenant": "t",
            "arrival_time": time.time()}


def test_reserve_precedes_prefill_and_decode_stays_in_domain() -> None:
    async def go() -> None:
        gs, w = make_scheduler({"d-a": 64, "d-b": 64})
        tickets = [await gs.submit(spec(f"r{i}", 40)) for i in range(6)]
        assert all(t["kind"] == "placed" for t in tickets)
        for t in tickets:
            pdom = t["prefill_worker_id"][-1]
            assert t["decode_worker_id"].endswith(pdom)
            assert t["topology_class"] == "same_domain"
        for rid in (f"r{i}" for i in range(6)):
            kinds = [c[0] for c in w.calls if c[2] == rid]
            assert kinds == ["reserve", "start"]
        assert gs.transfers_by_class["same_domain"] == 6
        assert all(gs.live[f"r{i}"].req.state is RequestState.PREFILLING for i in range(6))
        await gs.close()

    asyncio.run(go())


def test_reports_move_the_state_machine_and_finish_closes_the_books() -> None:
    async def go() -> None:
        gs, _ = make_scheduler({"d-a": 64, "d-b": 64})
        t = await gs.submit(spec("x", 20, tier=0))
        now = time.time()
        gs.report({"worker_id": t["prefill_worker_id"], "num_free_blocks": 64,
                   "events": [event("x", WorkerEvent.PREFILL_DONE, now)]})
        gs.report({"worker_id": t["decode_worker_id"], "num_free_blocks": 60,
                   "running": [["x", 2]], "events": [event("x", WorkerEvent.DECODE_START, now)],
                   "block_events": [{"kind": "stored", "block_hashes": [11], "parent_hash": None}]})
        assert gs.live["x"].req.state is RequestState.DECODING
        gs.finish("x", {"first_token_time": now, "finish_time": now + 0.1,
                        "num_output_tokens": 5, "outcome": "length"})
        assert "x" not in gs.live
        states = [r.to_state for r in gs.logs["x"].records]
        assert states[-1] is RequestState.FINISHED_LENGTH
        report = gs.why("x")
        assert report is not None and report["req_id"] == "x"
        await gs.close()

    asyncio.run(go())


def test_worker_abort_ends_the_request_on_every_worker_without_a_router_abort() -> None:
    """A decode worker whose reader left reports ABORTED: the prefill worker is told too,
    and the books close, though the router's own abort never arrives."""
    from scheduler.request import Decision

    async def go() -> None:
        gs, w = make_scheduler({"d-a": 64, "d-b": 64})
        t = await gs.submit(spec("gone", 40, tier=1))
        gs.report({"worker_id": t["decode_worker_id"], "num_free_blocks": 61,
                   "events": [event("gone", WorkerEvent.ABORTED, time.time())
                              | {"reason": "reader_gone"}]})
        for _ in range(100):
            if "gone" not in gs.live:
                break
            await asyncio.sleep(0.01)
        assert "gone" not in gs.live
        aborted = {c[1] for c in w.calls if c[0] == "abort" and c[2] == "gone"}
        assert aborted == {t["prefill_worker_id"], t["decode_worker_id"]}
        last = gs.logs["gone"].records[-1]
        assert last.to_state is RequestState.ABORTED and last.decision is Decision.CLIENT_GONE
        await gs.close()

    asyncio.run(go())


def test_full_decode_pool_preempts_a_lower_tier_for_tier0() -> None:
    async def go() -> None:
        gs, w = make_scheduler({"d-a": 16, "d-b": 0})
        t = await gs.submit(spec("low", 90, tier=3))  # 6 blocks
        assert t["decode_worker_id"] == "d-a"
        w.free["d-a"] = 0  # and it grew: d-a is full
        gs.report({"worker_id": "d-a", "num_free_blocks": 0, "running": [["low", 6]],
                   "events": [event("low", WorkerEvent.PREFILL_DONE, time.time()),
                              event("low", WorkerEvent.DECODE_START, time.time())]})
        high = asyncio.get_running_loop().create_task(gs.submit(spec("high", 40, tier=0)))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if any(c[0] == "preempt" for c in w.calls):
                break
        victims = [c[2] for c in w.calls if c[0] == "preempt"]
        assert victims and victims[0][0] == "low" and victims[0][2] == "high"
        w.free["d-a"] = 6  # the worker swapped "low" out and reports it
        gs.report({"worker_id": "d-a", "num_free_blocks": 6, "running": [],
                   "events": [event("low", WorkerEvent.PREEMPTED_SWAP, time.time())
                              | {"for_req_id": "high"}]})
        ticket = await asyncio.wait_for(high, 5)
        assert ticket["kind"] == "placed" and ticket["decode_worker_id"] == "d-a"
        assert gs.live["low"].req.state is RequestState.PREEMPTED
        assert gs.preemptions == {"3:swap": 1}
        await gs.close()

    asyncio.run(go())


def test_dead_worker_loses_its_requests_and_placement_avoids_it() -> None:
    async def go() -> None:
        gs, w = make_scheduler({"d-a": 64, "d-b": 64})
        placed = [await gs.submit(spec(f"r{i}", 30)) for i in range(4)]
        on_a = [p for p in placed if p["decode_worker_id"] == "d-a"]
        w.dead.add("d-a")
        lost = gs.mark_dead("d-a")
        assert len(lost) == len(on_a)
        assert all(gs.live[rid].req.state is RequestState.ABORTED for rid in lost)
        again = await gs.submit(spec("after", 30))
        assert again["decode_worker_id"] == "d-b"
        assert gs.stats()["workers"]["d-a"]["alive"] is False
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
        workers = FakeWorkers({"d-a": 64})
        gs = GlobalScheduler(default_tiers(), "tierserve", BS, workers,
                             control_interval_s=0.01, tracer=RequestTracer(exporter))
        gs.register_worker(WorkerInfo("p-a", WorkerRole.PREFILL, "n", "cpu", "A", 64), 64)
        gs.register_worker(WorkerInfo("d-a", WorkerRole.DECODE, "n", "cpu", "A", 64), 64)
        t = await gs.submit(spec("x", 40, tier=2))
        m = samples(gs)
        assert m[("tierserve:num_requests_running", (("tier", "2"),))] == 1
        assert m[("tierserve:prefix_cache_queries_total", ())] == 40 // BS
        assert sum(v for (name, _), v in m.items() if name == "tierserve:tier_share") \
            == pytest.approx(1.0)
        now = time.time()
        gs.report({"worker_id": t["decode_worker_id"], "num_free_blocks": 61,
                   "running": [["x", 3]], "events": [
                       event("x", WorkerEvent.PREFILL_DONE, now),
                       event("x", WorkerEvent.DECODE_START, now),
                       event("x", WorkerEvent.PREEMPTED_SWAP, now) | {"for_req_id": "y"}]})
        m = samples(gs)
        assert m[("tierserve:num_requests_preempted", (("tier", "2"),))] == 1
        assert m[("tierserve:num_requests_swapped", (("tier", "2"),))] == 1
        assert m[("tierserve:num_requests_running", (("tier", "2"),))] == 0
        assert not exporter.get_finished_spans()  # traced when closed, not before
        await gs.abort("x")
        spans = exporter.get_finished_spans()
        (pre,) = [s for s in spans if s.name == "preemption"]
        assert pre.attributes["tierserve.preempt.blocking_req_id"] == "y"
        assert {s.attributes["tierserve.req_id"] for s in spans} == {"x"}
        await gs.close()

    asyncio.run(go())
