"""The planner's window: tier-0 outcomes and busy fractions from what the scheduler sees."""

from __future__ import annotations

import pytest

from scheduler.pool_planner import Pool
from scheduler.pool_window import PoolWindow
from scheduler.request import Decision, Request, RequestState, transition
from scheduler.tiers import default_tiers

T0 = default_tiers()[0]  # ttft 0.2 s, tpot 0.05 s


def ended(rid: str, tier: int = 0, ttft: float | None = 0.1, tpot: float = 0.01, n: int = 11,
          state: RequestState = RequestState.FINISHED_STOPPED) -> Request:
    r = Request(rid, tier, 0.0, 32, 64, state=state)
    r.num_output_tokens = n
    if ttft is not None:
        r.first_token_time = ttft
        r.finish_time = ttft + tpot * (n - 1)
    return r


def test_tier0_attainment_and_which_target_was_missed() -> None:
    w = PoolWindow(0.0)
    w.on_closed(ended("met"), T0)
    w.on_closed(ended("slow-pace", tpot=0.2), T0)
    sig = w.close(10.0, 1, 1, 0.3, tier0_prefill_queued=False)
    assert sig.tier0_attainment == 0.5 and not sig.tier0_prefill_waits
    w.on_closed(ended("late-first", ttft=0.5), T0)
    w.on_closed(ended("tier1-late", tier=1, ttft=9.0), T0)  # not tier 0: not counted
    sig = w.close(20.0, 1, 1, 0.3, tier0_prefill_queued=False)
    assert sig.tier0_attainment == 0.0 and sig.tier0_prefill_waits


def aborted(rid: str, decision: Decision) -> Request:
    r = ended(rid, ttft=None, state=RequestState.QUEUED)
    transition(r, RequestState.ABORTED, decision=decision, triggered_by="test", now=1.0)
    return r


def test_client_aborts_are_not_a_capacity_signal_but_failures_are() -> None:
    w = PoolWindow(0.0)
    w.on_closed(aborted("gone", Decision.CLIENT_GONE), T0)
    assert w.close(1.0, 1, 1, 0.0, False).tier0_attainment is None
    w.on_closed(aborted("failed", Decision.ERROR), T0)
    sig = w.close(2.0, 1, 1, 0.0, False)
    assert sig.tier0_attainment == 0.0 and sig.tier0_prefill_waits


def test_busy_fraction_per_pool_from_the_step_seconds_counters() -> None:
    w = PoolWindow(0.0)
    for wid, pool in (("p0", Pool.PREFILL), ("d0", Pool.DECODE), ("d1", Pool.DECODE)):
        w.on_report(wid, pool, 100.0)  # counters from before the window
    w.on_report("p0", Pool.PREFILL, 108.0)
    w.on_report("d0", Pool.DECODE, 105.0)
    w.on_report("d1", Pool.DECODE, 101.0)
    sig = w.close(10.0, 1, 2, 0.7, tier0_prefill_queued=True)
    assert sig.prefill_busy == pytest.approx(0.8)
    assert sig.decode_busy == pytest.approx(0.3)  # 6 s of 2 x 10 s
    assert sig.kv_used == 0.7 and sig.tier0_prefill_waits and sig.tier0_attainment is None
    # The next window counts from where this one ended; a restarted worker's counter
    # starts again at 0 (counted from there, not as negative time).
    w.on_report("p0", Pool.PREFILL, 110.0)
    w.on_report("d0", Pool.DECODE, 2.0)
    w.on_report("d0", Pool.DECODE, 4.0)
    sig = w.close(20.0, 1, 2, 0.0, False)
    assert sig.prefill_busy == pytest.approx(0.2) and sig.decode_busy == pytest.approx(0.1)
