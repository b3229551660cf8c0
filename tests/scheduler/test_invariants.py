"""Invariant checks return violations as values."""

from __future__ import annotations

from scheduler.invariants import (
    Invariant,
    check_anti_thrash,
    check_kv_budget,
    check_shares,
    check_starvation,
    check_transitions,
    count_by_invariant,
)
from scheduler.kv import KVBlockAccount
from scheduler.request import Decision, DecisionRecord, RequestState, transition
from scheduler.testing import make_request
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
