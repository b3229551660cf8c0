"""Invariant checks return violations as values."""

from __future__ import annotations

from scheduler.invariants import (
    Invariant,
    check_anti_thrash,
    check_kv_budget,
    check_shares,
    check_starvation,
    check_tier_order,
    check_transitions,
    count_by_invariant,
    is_starving,
)
from scheduler.kv import KVBlockAccount
from scheduler.queues import Pick, PickSite, Verdict
from scheduler.request import Decision, DecisionRecord, RequestState, transition
from scheduler.testing import EST, make_request
from scheduler.tiers import default_tiers

S = RequestState


def test_kv_budget() -> None:
    acc = KVBlockAccount("w", 10)
    acc.allocate("a", 10)
    assert check_kv_budget([acc]) == []
    acc.num_cached = 1  # a broken mechanism, as a checker must catch it
    assert [v.invariant for v in check_kv_budget([acc])] == [Invariant.KV_BUDGET]


def test_transitions_must_be_legal_and_chain() -> None:
    req = make_request("r")
    recs = [transition(req, S.PREFILLING, decision=Decision.SCHEDULE_PREFILL,
                       triggered_by="t", now=0.0)]
    assert check_transitions(recs) == []
    bad = DecisionRecord("r", S.QUEUED, S.DECODING, Decision.START_DECODE, "t", 1.0)
    gap = DecisionRecord("r", S.DECODING, S.PREEMPTING, Decision.PREEMPT_SWAP, "t", 1.0)
    found = check_transitions(recs + [bad]) + check_transitions(recs + [gap])
    assert len(found) == 3 and all(v.invariant is Invariant.LEGAL_TRANSITIONS for v in found)


def test_shares() -> None:
    assert check_shares([0.25] * 4) == []
    assert check_shares([0.5, 0.6])


def test_anti_thrash() -> None:
    def rec(t: float) -> DecisionRecord:
        return DecisionRecord("r", S.DECODING, S.PREEMPTING, Decision.PREEMPT_SWAP, "t", t)

    assert check_anti_thrash([rec(0.0), rec(1.0)], 1.0) == []
    assert len(check_anti_thrash([rec(0.0), rec(0.5)], 1.0)) == 1


def test_starvation_bound_per_tier() -> None:
    tiers = default_tiers()
    waiting = make_request("w", tier=0, arrival=0.0)
    assert check_starvation([waiting], 4.0, tiers) == []
    v = check_starvation([waiting], 6.0, tiers)
    assert count_by_invariant(v)[Invariant.STARVATION.value] == 1
    # A retry keeps its arrival time; its wait counts from its submission.
    assert check_starvation([waiting], 6.0, tiers, submitted={"w": 2.0}) == []


def _pick(offers, rest=(), now=1.0):
    return Pick(PickSite.DISPATCH, "", now, tuple(offers), tuple(rest))


def test_tier_order_flags_a_hopeless_urgent_request_passed_over_for_feasible_work() -> None:
    tiers = default_tiers()
    late0 = make_request("late0", tier=0, arrival=0.0)  # TTFT 0.2 s: hopeless at t=1
    fresh1 = make_request("fresh1", tier=1, arrival=0.9)  # TTFT 2 s: slack ~1.9 s
    take, skip = Verdict.TAKE, Verdict.SKIP
    # Considered first (taken or found without room): no inversion.
    assert check_tier_order(_pick([(late0, take), (fresh1, take)]), tiers, EST) == []
    assert check_tier_order(_pick([(late0, skip), (fresh1, take)]), tiers, EST) == []
    # Ordered behind the feasible tier-1 request, or never offered: an inversion.
    for pick in (_pick([(fresh1, take), (late0, take)]), _pick([(fresh1, take)], [late0])):
        (v,) = check_tier_order(pick, tiers, EST)
        assert v.invariant is Invariant.TIER_INVERSION and "late0" in v.detail
    # Work of the same tier, or hopeless work, may go first; so may a starving request.
    late1 = make_request("late1", tier=1, arrival=-5.0)
    assert check_tier_order(_pick([(late1, take)], [late0]), tiers, EST) == []
    # Tier 3 (600 s end to end, 900 s bound): starving after 450 s, feasible until ~600 s.
    old3 = make_request("old3", tier=3, arrival=0.0)
    newer3 = make_request("newer3", tier=3, arrival=100.0)
    late0 = make_request("late0", tier=0, arrival=490.0)
    assert is_starving(old3, 500.0, tiers) and not is_starving(newer3, 500.0, tiers)
    assert check_tier_order(_pick([(old3, take)], [late0], now=500.0), tiers, EST) == []
    assert check_tier_order(_pick([(newer3, take)], [late0], now=500.0), tiers, EST) != []
