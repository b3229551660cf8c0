"""Fair share controller, share ledger and admission through their public API."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.admission import (
    AdmissionController,
    AdmissionKind,
    LoadSnapshot,
    should_preempt_now,
)
from scheduler.fairshare import FairShareController, ShareLedger
from scheduler.invariants import check_shares
from scheduler.testing import EST, make_request
from scheduler.tiers import ShareMode, default_tiers

TIERS = default_tiers()


def test_shares_move_at_most_the_step_and_sum_to_one() -> None:
    fs = FairShareController(TIERS)
    before = fs.shares
    new = fs.update(0.0, [4.0, 0.5, None, 0.5])
    assert new is not None
    assert max(abs(a - b) for a, b in zip(new, before, strict=True)) <= 0.10 + 1e-12
    assert new[0] > before[0]
    assert check_shares(new) == []


def test_shares_update_once_per_interval_and_converge() -> None:
    fs = FairShareController(TIERS)
    assert fs.update(0.0, [4.0, 1.0, 1.0, 1.0]) is not None
    assert fs.update(0.05, [4.0, 1.0, 1.0, 1.0]) is None
    t = 0.0
    for _ in range(50):
        t += 0.1
        fs.update(t, [4.0, 1.0, 1.0, 1.0])
        assert check_shares(fs.shares) == []
    assert fs.shares[0] > 0.5


def test_quota_mode_keeps_reservations() -> None:
    fs = FairShareController(dataclasses.replace(TIERS, share_mode=ShareMode.QUOTA))
    assert fs.update(0.0, [4.0, 0.5, 0.5, 0.5]) is None
    assert fs.shares == TIERS.shares()


def test_ledger_flags_a_tier_served_below_its_entitlement() -> None:
    led = ShareLedger(4)
    for t in range(4):
        led.record_demand(t, 1000, 0.0)
    led.record_served(0, 1000, 0.0)
    led.record_served(1, 1000, 0.0)
    deficit = led.deficit_tiers(TIERS.shares(), 0.0)
    assert deficit == frozenset({2, 3})


def test_admission_accepts_queues_and_rejects_with_retry_after() -> None:
    adm = AdmissionController(TIERS, EST, tolerance=0.0)
    t0 = make_request("t0", tier=0, arrival=0.0, prompt=500)  # 0.05 s prefill, 0.2 s TTFT
    t1 = make_request("t1", tier=1, arrival=0.0, prompt=500)  # 2 s TTFT
    idle = LoadSnapshot([0.0, 0.0, 0.0, 0.0], 1, True)
    busy = LoadSnapshot([0.05, 5.0, 5.0, 5.0], 1, False)
    assert adm.decide(t0, 0.0, idle).kind is AdmissionKind.ACCEPT
    assert adm.decide(t0, 0.0, busy).kind is AdmissionKind.QUEUE
    flooded = LoadSnapshot([0.19, 2.0, 0.0, 0.0], 1, False)
    d = adm.decide(t1, 0.0, flooded)
    # 0.19 s of tier-0 and 2.0 s of tier-1 work ahead, plus its own 0.05 s: past 2 s.
    assert d.kind is AdmissionKind.REJECT and d.retry_after_s == pytest.approx(0.24)
    # Tier-0 work past its deadlines still runs first (no tier inversion): it counts.
    stale = LoadSnapshot([50.0, 0.0, 0.0, 0.0], 1, False)
    assert adm.decide(t1, 0.0, stale).kind is AdmissionKind.REJECT
    # Its own tier's work counts up to one deadline window: the rest is demoted behind.
    own_flood = LoadSnapshot([0.0, 1.9, 0.0, 0.0], 1, False)
    assert adm.decide(t1, 0.0, own_flood).kind is AdmissionKind.QUEUE


def test_admission_sees_decode_memory_when_prefill_is_idle() -> None:
    """Prefill has no backlog but decode memory is spoken for: a tier-1 request that
    would wait past twice its 2 s TTFT for blocks is rejected; tier 0, which may preempt
    what the later tiers hold, is queued; without a release rate there is no KV term."""
    import dataclasses

    from scheduler.admission import kv_release_rate

    adm = AdmissionController(TIERS, EST)
    t1 = make_request("t1", tier=1, arrival=0.0, prompt=1600)  # 101 blocks of 16
    t0 = make_request("t0", tier=0, arrival=0.0, prompt=160)  # 11 blocks
    rate = kv_release_rate([(100, 100), (100, 100), (0, 5)], 0.01)
    assert rate == pytest.approx(200.0)  # 2 x 100 blocks, each freed after 1 s
    assert kv_release_rate([], 0.01) is None
    full = LoadSnapshot([0.0] * 4, 1, False, kv_queued_blocks_by_tier=[0, 1000, 0, 0],
                        kv_held_blocks_by_tier=[0, 0, 200, 0], kv_free_blocks=0,
                        kv_release_blocks_per_s=rate, block_size=16)
    # Of tier 1's queued 1000 blocks only what the running requests release in its 2 s
    # window (400) is ahead of it (the rest is hopeless and goes behind it); with its own
    # 101, less the 200 tier 2 holds: 1.5 s, within its target.
    assert adm.kv_wait_s(t1, full) == pytest.approx(301 / 200)
    assert adm.decide(t1, 0.0, full).kind is AdmissionKind.QUEUE
    # Tier 0's queued 1000 blocks all run first: 6.5 s, past twice the target.
    urgent = dataclasses.replace(full, kv_queued_blocks_by_tier=[1000, 1000, 0, 0])
    assert adm.kv_wait_s(t1, urgent) == pytest.approx(1301 / 200)
    d = adm.decide(t1, 0.0, urgent)
    assert d.kind is AdmissionKind.REJECT and d.retry_after_s == pytest.approx(
        d.predicted_s - 2.0)
    assert d.sheds_tier  # the wait alone misses: every tier-1 arrival would
    assert adm.decide(t0, 0.0, urgent).kind is AdmissionKind.QUEUE
    light = dataclasses.replace(urgent, kv_queued_blocks_by_tier=[200, 200, 0, 0])
    assert adm.decide(t1, 0.0, light).kind is AdmissionKind.QUEUE
    unknown = dataclasses.replace(full, kv_release_blocks_per_s=None)
    assert adm.kv_wait_s(t1, unknown) == 0.0


def test_batch_tiers_are_rejected_only_past_their_long_deadlines() -> None:
    adm = AdmissionController(TIERS, EST)
    req = make_request("r", tier=3, arrival=0.0, prompt=500)
    busy = LoadSnapshot([0.0, 100.0, 100.0, 100.0], 1, False)  # 300 s ahead of a 600 s bound
    assert adm.decide(req, 0.0, busy).kind is AdmissionKind.QUEUE
    flooded = LoadSnapshot([0.0, 1000.0, 1000.0, 0.0], 1, False)  # 2000 s ahead of it
    assert adm.decide(req, 0.0, flooded).kind is AdmissionKind.REJECT
    too_big = make_request("big", tier=3, arrival=0.0, prompt=500, out=10**7)
    # Too big even on an idle worker: served best effort, never refused.
    assert adm.decide(too_big, 0.0, flooded).kind is AdmissionKind.QUEUE


def test_conditional_preemption_threshold() -> None:
    assert should_preempt_now(100, 50, 40, 0.9)
    assert not should_preempt_now(100, 50, 39, 0.9)
    assert not should_preempt_now(0, 50, 40, 0.9)
