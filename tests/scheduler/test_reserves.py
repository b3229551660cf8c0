"""Decode reserves from what is measured (issue 22, item 2): the meter, the reserve, and
the kernel placing what fits beside them."""

from __future__ import annotations

import pytest

from scheduler.cluster_scheduler import ClusterScheduler, NewRequest, PoolMode
from scheduler.messages import ReqEvent, RunningReq, WorkerEvent, WorkerReport
from scheduler.request import RequestState
from scheduler.reserves import (
    MAX_FRACTION,
    DemandMeter,
    UrgentDemand,
    decode_reserve,
    growth_blocks,
)
from scheduler.testing import make_costs
from scheduler.tiers import default_tiers
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16


def test_the_meter_reads_a_constant_rate_as_that_rate_from_the_start() -> None:
    m = DemandMeter(2, tau_s=10.0)
    for i in range(40):  # 4 requests of 10 blocks a second, for 10 s, all tier 0
        m.record(0, 10, i * 0.25)
    blocks, reqs = m.rates(10.0)
    assert blocks[0] == pytest.approx(40.0, rel=0.1) and reqs[0] == pytest.approx(4.0, rel=0.1)
    assert blocks[1] == reqs[1] == 0.0
    u = UrgentDemand.of(m, 10.0)
    assert u.blocks_per_s[0] == 0.0 and u.blocks_per_s[1] == pytest.approx(40.0, rel=0.1)
    assert u.mean_blocks[1] == pytest.approx(10.0)
    # A minute of silence: the rate decays away.
    assert m.rates(70.0)[0][0] < 1.0


def _reserve(tier: int, urgent: UrgentDemand, *, rel: float | None = 20.0, growth: int = 0,
             blocks: int = 256) -> int:
    return decode_reserve(tier, urgent, num_kv_blocks=blocks, release_blocks_per_s=rel,
                          growth=growth, num_workers=2, min_window_s=0.1)


def test_nothing_is_held_for_a_tier_nobody_sends() -> None:
    none = UrgentDemand.none(4)
    assert [_reserve(t, none) for t in range(4)] == [0, 0, 0, 0]
    # Growth room only below tier 0 (tier 0 may preempt for its own growth).
    assert [_reserve(t, none, growth=7) for t in range(4)] == [0, 7, 7, 7]


def test_urgent_demand_is_held_over_the_release_window_and_capped() -> None:
    u = UrgentDemand((0.0, 40.0, 40.0, 40.0), (0.0, 10.0, 10.0, 10.0))
    # 20 blocks/s land on each of the two workers; the worker frees one such request (10
    # blocks) in 0.25 s at 40 blocks/s, but the reserve covers at most two planning
    # intervals (0.2 s): 4 blocks.
    assert _reserve(1, u, rel=40.0) == 4
    # A worker that frees it sooner holds less; one that releases nothing holds nothing.
    assert _reserve(1, u, rel=200.0) == 1
    assert _reserve(1, u, rel=None) == 0
    huge = UrgentDemand((0.0, 1e6, 1e6, 1e6), (0.0, 10.0, 10.0, 10.0))
    assert _reserve(3, huge, growth=1000) == int(MAX_FRACTION * 256)


def test_growth_counts_each_request_up_to_its_budget() -> None:
    # (context tokens, blocks held, tokens left): 100 tokens more each.
    assert growth_blocks([(32, 2, 1000)], tokens=100, block_size=BS) == 7
    assert growth_blocks([(32, 2, 10)], tokens=100, block_size=BS) == 1
    assert growth_blocks([(32, 2, 0), (40, 3, 5)], tokens=100, block_size=BS) == 0


def _cluster() -> ClusterScheduler:
    cs = ClusterScheduler(default_tiers(), "tierserve", BS, make_costs(),
                          mode=PoolMode.DISAGGREGATED)
    cs.add_worker(WorkerInfo("p0", WorkerRole.PREFILL, "n", "cpu", "A", 512), 512,
                  can_prefill=True, can_decode=False)
    cs.add_worker(WorkerInfo("d0", WorkerRole.DECODE, "n", "cpu", "A", 100), 100,
                  can_prefill=False, can_decode=True)
    return cs


def test_a_batch_request_that_fits_is_placed_when_no_urgent_tier_sends() -> None:
    """The placement before issue 22 kept 5 % x tier free (15 blocks of 100 for tier 3)
    plus growth room at the prior's step time for every running request: a tier-3 prompt
    of 88 blocks waited beside 90 free blocks, for a tier that nobody sent."""
    cs = _cluster()
    cs.submit(NewRequest("a", 3, 0.0, 120, 8), 0.0)  # 8 blocks, short budget
    (d,) = cs.plan(0.0).dispatches
    cs.on_dispatch_result("a", True, 0.0, num_free_blocks=92)
    cs.on_report(WorkerReport("p0", 512, 512, events=(
        ReqEvent("a", WorkerEvent.PREFILL_DONE, 0.1),)), 0.1)
    cs.on_report(WorkerReport("d0", 92, 100, events=(
        ReqEvent("a", WorkerEvent.DECODE_START, 0.2),),
        running=(RunningReq("a", 8, 1),)), 0.2)
    cs.submit(NewRequest("b", 3, 0.3, 88 * BS - 1, 2), 0.3)  # 88 blocks
    plan = cs.plan(0.3)
    assert [x.req_id for x in plan.dispatches] == ["b"]
    assert cs.unplaced_fits() == []


def test_a_less_urgent_decodes_growth_is_no_reserve_for_a_more_urgent_request() -> None:
    """A running tier-3 decode with a long budget will grow by several blocks a second:
    a tier-3 arrival leaves that room (it would be the victim when the growth comes), a
    tier-1 arrival does not (the tier-3 decode gives way to it)."""
    cs = _cluster()
    cs.submit(NewRequest("a", 3, 0.0, 120, 4000), 0.0)  # 8 blocks, a long budget
    cs.plan(0.0)
    cs.on_dispatch_result("a", True, 0.0, num_free_blocks=92)
    cs.on_report(WorkerReport("p0", 512, 512, events=(
        ReqEvent("a", WorkerEvent.PREFILL_DONE, 0.1),)), 0.1)
    cs.on_report(WorkerReport("d0", 92, 100, events=(
        ReqEvent("a", WorkerEvent.DECODE_START, 0.2),),
        running=(RunningReq("a", 8, 1),)), 0.2)
    growth = cs.decode_reserves("d0")
    assert growth[0] == growth[1] == growth[2] == 0 and growth[3] >= 3
    cs.submit(NewRequest("low", 3, 0.3, 90 * BS - 1, 2), 0.3)  # 90 of the 92 free
    assert not cs.plan(0.3).dispatches
    cs.submit(NewRequest("mid", 1, 0.4, 90 * BS - 1, 2), 0.4)
    assert [d.req_id for d in cs.plan(0.4).dispatches] == ["mid"]


def test_a_preempted_decode_comes_back_before_new_requests_of_its_tier() -> None:
    """A decode preempted on a worker (here by recompute, for its own KV pressure) claims
    the blocks it needs to come back there: a new request of its tier or a later one
    does not take them (its dispatch would reserve them at once and the preempted decode
    would wait behind arrivals for seconds, issue 22's bench-pressure), a more urgent one
    does."""
    cs = _cluster()
    cs.submit(NewRequest("a", 2, 0.0, 40 * BS - 1, 8), 0.0)  # 40 blocks
    cs.plan(0.0)
    cs.on_dispatch_result("a", True, 0.0, num_free_blocks=60)
    cs.on_report(WorkerReport("p0", 512, 512, events=(
        ReqEvent("a", WorkerEvent.PREFILL_DONE, 0.1),)), 0.1)
    cs.on_report(WorkerReport("d0", 60, 100, events=(
        ReqEvent("a", WorkerEvent.DECODE_START, 0.2),),
        running=(RunningReq("a", 40 * BS, 1),)), 0.2)
    cs.on_report(WorkerReport("d0", 100, 100, events=(
        ReqEvent("a", WorkerEvent.PREEMPTED_RECOMPUTE, 0.3),),
        running=(RunningReq("a", 0, 1),)), 0.3)  # held there, its blocks freed
    assert cs.get("a").state is RequestState.PREEMPTED
    cs.submit(NewRequest("late", 3, 0.4, 80 * BS - 1, 2), 0.4)  # 80 of the 100 free
    cs.submit(NewRequest("same", 2, 0.4, 80 * BS - 1, 2), 0.4)
    assert not cs.plan(0.4).dispatches
    assert cs.unplaced_fits() == []  # what they would take is a's: no idle memory
    cs.submit(NewRequest("urgent", 1, 0.5, 80 * BS - 1, 2), 0.5)
    assert [d.req_id for d in cs.plan(0.5).dispatches] == ["urgent"]
