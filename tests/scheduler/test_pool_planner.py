"""The SLO planner stepped by hand: grows fast on tier-0 misses and high watermarks,
shrinks slowly with hysteresis, never flaps, stays within its bounds."""

from __future__ import annotations

import pytest

from scheduler.pool_planner import (
    PlannerSettings,
    Pool,
    PoolChange,
    PoolLimits,
    PoolPlanner,
    PoolSignals,
    Why,
    busy_fraction,
    sizes_after,
)


def sig(now: float, p: int = 1, d: int = 1, *, att: float | None = 1.0, waits: bool = False,
        pb: float = 0.5, db: float = 0.5, kv: float = 0.5) -> PoolSignals:
    return PoolSignals(now, p, d, att, waits, pb, db, kv)


def settings(**kw) -> PlannerSettings:
    base = dict(prefill=PoolLimits(1, 4), decode=PoolLimits(1, 4), cooldown_s=20.0,
                down_stable_s=45.0)
    return PlannerSettings(**(base | kw))


def test_tier0_ttft_misses_with_prefill_waiting_grow_prefill_only() -> None:
    pl = PoolPlanner(settings())
    out = pl.step(sig(0, att=0.9, waits=True, pb=0.6))
    assert out == [PoolChange(Pool.PREFILL, +1, Why.TIER0_TTFT)]


def test_tier0_misses_without_prefill_waiting_grow_decode() -> None:
    pl = PoolPlanner(settings())
    assert pl.step(sig(0, att=0.9, waits=False)) == [PoolChange(Pool.DECODE, +1, Why.TIER0_DECODE)]


def test_kv_and_busy_watermarks() -> None:
    pl = PoolPlanner(settings())
    assert pl.step(sig(0, kv=0.9)) == [PoolChange(Pool.DECODE, +1, Why.KV_FULL)]
    pl = PoolPlanner(settings())
    assert pl.step(sig(0, pb=0.9)) == [PoolChange(Pool.PREFILL, +1, Why.PREFILL_BUSY)]
    pl = PoolPlanner(settings())
    assert pl.step(sig(0, db=0.9)) == [PoolChange(Pool.DECODE, +1, Why.DECODE_BUSY)]


def test_one_worker_per_step_and_a_cooldown_between_changes() -> None:
    pl = PoolPlanner(settings())
    assert len(pl.step(sig(0, pb=1.0))) == 1
    assert pl.step(sig(10, p=2, pb=1.0)) == []  # within the cooldown: nothing
    assert pl.step(sig(20, p=2, pb=1.0)) == [PoolChange(Pool.PREFILL, +1, Why.PREFILL_BUSY)]


def test_never_above_max_never_below_min() -> None:
    pl = PoolPlanner(settings(prefill=PoolLimits(1, 2)))
    assert pl.step(sig(0, p=2, pb=1.0)) == []
    assert pl.step(sig(0, p=5)) == [PoolChange(Pool.PREFILL, -1, Why.ABOVE_MAX)]
    pl = PoolPlanner(settings(decode=PoolLimits(2, 4)))
    assert pl.step(sig(0, d=1)) == [PoolChange(Pool.DECODE, +1, Why.BELOW_MIN)]
    pl = PoolPlanner(settings())
    for t in range(0, 600, 10):  # idle for ten minutes at the minimum: stays
        assert pl.step(sig(t, pb=0.0, db=0.0, kv=0.0, att=None)) == []


def test_shrinks_only_after_the_low_watermark_held_with_one_worker_less() -> None:
    pl = PoolPlanner(settings())
    # 3 prefill workers at 0.35 busy: with 2 they would be 0.525, over the low mark.
    for t in range(0, 300, 10):
        assert pl.step(sig(t, p=3, pb=0.35)) == []
    pl = PoolPlanner(settings())
    # At 0.25: with 2 workers 0.375 < 0.45, so it shrinks after down_stable_s.
    got = [(t, pl.step(sig(t, p=3, pb=0.25))) for t in range(0, 100, 5)]
    first = next(t for t, c in got if c)
    assert first == 45
    assert dict(got)[45] == [PoolChange(Pool.PREFILL, -1, Why.IDLE)]


def test_a_busy_window_resets_the_idle_clock() -> None:
    pl = PoolPlanner(settings())
    for t in (0, 10, 20, 30):
        assert pl.step(sig(t, p=3, pb=0.2)) == []
    assert pl.step(sig(40, p=3, pb=0.6)) == []  # not idle any more
    for t in (50, 60, 70, 80):
        assert pl.step(sig(t, p=3, pb=0.2)) == []  # the clock started again at 50
    assert pl.step(sig(95, p=3, pb=0.2)) == [PoolChange(Pool.PREFILL, -1, Why.IDLE)]


def test_no_shrinking_while_tier0_misses() -> None:
    pl = PoolPlanner(settings())
    for t in range(0, 300, 10):
        out = pl.step(sig(t, p=3, d=3, att=0.95, waits=True, pb=0.1, db=0.1, kv=0.1))
        assert all(c.delta > 0 for c in out)


def test_steady_load_between_the_watermarks_never_flaps() -> None:
    pl = PoolPlanner(settings())
    changes = []
    for t in range(0, 600, 5):  # ten minutes of a load between the marks
        changes += pl.step(sig(t, p=2, d=2, pb=0.6, db=0.5, kv=0.6))
    assert changes == []


def test_role_move_at_the_budget_in_auto_pools() -> None:
    s = settings(max_total=4, allow_role_moves=True)
    pl = PoolPlanner(s)
    out = pl.step(sig(0, p=1, d=3, pb=0.95, db=0.2, kv=0.2))
    assert out == [PoolChange(Pool.DECODE, -1, Why.PREFILL_BUSY, move=True),
                   PoolChange(Pool.PREFILL, +1, Why.PREFILL_BUSY, move=True)]
    assert sizes_after(sig(0, p=1, d=3), out) == (2, 2)
    # Without role moves, at the budget: nothing.
    pl = PoolPlanner(settings(max_total=4))
    assert pl.step(sig(0, p=1, d=3, pb=0.95, db=0.2, kv=0.2)) == []
    # The other pool busy: no move.
    pl = PoolPlanner(s)
    assert pl.step(sig(0, p=1, d=3, pb=0.95, db=0.8, kv=0.2)) == []


def test_a_shrink_in_the_same_step_frees_the_budget() -> None:
    pl = PoolPlanner(settings(max_total=4, down_stable_s=0.0))
    pl.step(sig(0, p=3, d=1, pb=0.1))  # starts the idle clock of prefill
    out = pl.step(sig(30, p=3, d=1, pb=0.1, kv=0.95))
    assert out == [PoolChange(Pool.PREFILL, -1, Why.IDLE),
                   PoolChange(Pool.DECODE, +1, Why.KV_FULL)]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="min"):
        PoolLimits(3, 2)
    with pytest.raises(ValueError, match="watermarks"):
        PlannerSettings(busy_low=0.9, busy_high=0.5)
    with pytest.raises(ValueError, match="target_attainment"):
        PlannerSettings(target_attainment=0.0)


def test_busy_fraction() -> None:
    assert busy_fraction(5.0, 10.0, 1) == 0.5
    assert busy_fraction(30.0, 10.0, 2) == 1.0
    assert busy_fraction(1.0, 0.0, 2) == 0.0


def test_without_a_prefill_pool_the_decode_pool_answers_tier0_ttft_misses() -> None:
    pl = PoolPlanner(settings(prefill=PoolLimits(0, 0)))
    out = pl.step(sig(0, p=0, att=0.9, waits=True))
    assert out == [PoolChange(Pool.DECODE, +1, Why.TIER0_DECODE)]
