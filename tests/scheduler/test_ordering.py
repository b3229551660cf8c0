"""Ordering policies through the public registry."""

from __future__ import annotations

import pytest

from scheduler.deadlines import DeadlineWatcher
from scheduler.ordering import ORDERING_POLICIES, UnknownPolicy, make_ordering
from scheduler.request import RequestState
from scheduler.testing import EST, make_request
from scheduler.tiers import default_tiers

TIERS = default_tiers()


def test_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(UnknownPolicy) as e:
        make_ordering("edf", TIERS, EST)
    for name in ORDERING_POLICIES:
        assert name in str(e.value)


def test_utility_falls_as_deadline_nears_and_penalises_preempted() -> None:
    pol = make_ordering("utility", TIERS, EST)
    old = make_request("old", tier=1, arrival=0.0)
    fresh = make_request("fresh", tier=1, arrival=1.5)
    assert [r.req_id for r in pol.order([old, fresh], now=1.6)] == ["fresh", "old"]
    running = make_request("run", tier=1, arrival=1.0, state=RequestState.DECODING)
    pre = make_request("pre", tier=1, arrival=1.0, state=RequestState.PREEMPTED)
    assert [r.req_id for r in pol.order([pre, running], now=1.1)] == ["run", "pre"]


def test_slack_demotes_hopeless_within_its_tier_but_never_behind_a_lower_tier() -> None:
    pol = make_ordering("slack", TIERS, EST)
    t0 = make_request("t0", tier=0, arrival=0.0, prompt=100)  # deadline 0.2
    t1 = make_request("t1", tier=1, arrival=0.0, prompt=100)  # deadline 2.0
    late = make_request("late", tier=0, arrival=-1.0, prompt=100)  # deadline passed
    t2 = make_request("t2", tier=2, arrival=0.0, prompt=100)
    late1 = make_request("late1", tier=1, arrival=-9.0, prompt=100)  # deadline passed
    order = [r.req_id for r in pol.order([late, t2, late1, t1, t0], now=0.05)]
    # Hopeless tier 0 after feasible tier 0 but before feasible tier 1; hopeless tier 1
    # after feasible tier 1 but before feasible tier 2 (DESIGN §5: no tier inversion).
    assert order == ["t0", "late", "t1", "late1", "t2"]


def test_slack_prefers_urgent_lower_tier_over_relaxed_higher_tier() -> None:
    pol = make_ordering("slack", TIERS, EST)
    relaxed = make_request("t1", tier=1, arrival=10.0, prompt=100)  # deadline 12
    urgent = make_request("t2", tier=2, arrival=-19.0, prompt=100, out=10)  # deadline 11
    assert [r.req_id for r in pol.order([relaxed, urgent], now=10.0)][0] == "t2"


def test_wfq_boosts_requests_past_the_boost_fraction() -> None:
    watcher = DeadlineWatcher(TIERS)
    pol = make_ordering("wfq", TIERS, EST, watcher)
    reqs = [make_request(f"a{i}", tier=3, arrival=0.0) for i in range(3)]
    old = make_request("old", tier=2, arrival=-25.0)  # used 25/30 > 0.7 of its deadline
    watcher.tick(0.0, reqs + [old])
    assert pol.order(reqs + [old], now=0.0)[0].req_id == "old"


def test_wfq_interleaves_tiers_by_share() -> None:
    pol = make_ordering("wfq", TIERS, EST)
    reqs = [make_request(f"t1-{i}", tier=1, arrival=i * 0.001) for i in range(10)]
    reqs += [make_request(f"t3-{i}", tier=3, arrival=i * 0.001) for i in range(10)]
    first = pol.order(reqs, now=0.01)[:6]
    assert sum(r.tier == 1 for r in first) >= 4
    assert any(r.tier == 3 for r in pol.order(reqs, now=0.01)[:12])


@pytest.mark.parametrize("name", sorted(ORDERING_POLICIES))
def test_starving_request_goes_first(name: str) -> None:
    pol = make_ordering(name, TIERS, EST)
    fresh = make_request("fresh", tier=1, arrival=1000.0)
    starving = make_request("starving", tier=3, arrival=0.0)  # guard at 450 s
    assert pol.order([fresh, starving], now=1000.0)[0].req_id == "starving"


def test_slack_guard_yields_only_to_feasible_tier0() -> None:
    pol = make_ordering("slack", TIERS, EST)
    t0 = make_request("t0", tier=0, arrival=1000.0)
    late_t0 = make_request("late_t0", tier=0, arrival=999.0)  # past its 0.2 s TTFT
    starving = make_request("starving", tier=3, arrival=0.0)
    order = [r.req_id for r in pol.order([late_t0, starving, t0], now=1000.0)]
    assert order == ["t0", "starving", "late_t0"]


def test_deficit_tiers_are_favoured() -> None:
    a = make_request("a", tier=0, arrival=0.0)
    b = make_request("b", tier=3, arrival=0.0)
    for name in ("utility", "wfq"):
        pol = make_ordering(name, TIERS, EST)
        pol.deficit_tiers = frozenset({3})
        assert pol.order([a, b], now=0.0)[0].req_id == "b"
    # slack: feasible requests keep their deadline order unless
    # DEFICIT_FEASIBLE_FIRST; among the hopeless, the deficit tier goes first.
    pol = make_ordering("slack", TIERS, EST)
    pol.deficit_tiers = frozenset({3})
    c = make_request("c", tier=1, arrival=0.0)
    assert [r.req_id for r in pol.order([c, b, a], now=0.0)] == ["a", "c", "b"]
    pol.DEFICIT_FEASIBLE_FIRST = True  # type: ignore[misc]
    assert [r.req_id for r in pol.order([c, b, a], now=0.0)] == ["a", "b", "c"]
    pol.deficit_tiers = frozenset({2})
    late_a = make_request("late_a", tier=1, arrival=-10.0)  # hopeless, not yet starving
    late_b = make_request("late_b", tier=2, arrival=-40.0)
    order = [r.req_id for r in pol.order([late_a, late_b, a], now=0.0)]
    assert order == ["a", "late_b", "late_a"]
