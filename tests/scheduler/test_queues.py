"""Wait queues hand out requests in their policy's order, touching only what they offer."""

from __future__ import annotations

import random

from scheduler.ordering import make_ordering
from scheduler.queues import HeapQueue, SlackQueue, SortedQueue, Verdict
from scheduler.request import Decision, RequestState, transition
from scheduler.testing import EST, make_request
from scheduler.tiers import default_tiers

TIERS = default_tiers()


def _random_requests(n: int, seed: int) -> list:
    rng = random.Random(seed)
    return [make_request(f"r{i}", tier=rng.randrange(4), arrival=rng.uniform(0, 20),
                         prompt=rng.randrange(10, 3000), out=rng.randrange(1, 300))
            for i in range(n)]


def _drain(q, now: float) -> list[str]:
    return [r.req_id for r in q.take(now, lambda r: Verdict.TAKE)]


def test_slack_queue_matches_the_slack_policy_order() -> None:
    for seed in range(5):
        reqs = _random_requests(60, seed)
        pol = make_ordering("slack", TIERS, EST)
        pol.deficit_tiers = frozenset({2}) if seed % 2 else frozenset()
        q = SlackQueue(pol)  # type: ignore[arg-type]
        for r in reqs:
            q.push(r, now=0.0)
        now = 20.0
        # Hopeless ones within a tier go by arrival in both; compare as (tier, class) streams.
        expected = [r.req_id for r in pol.order(reqs, now)]
        assert _drain(q, now) == expected
        assert len(q) == 0


def test_skip_keeps_requests_and_stop_ends_the_step() -> None:
    q = HeapQueue(key=lambda r: (r.arrival_time,))
    for i in range(5):
        q.push(make_request(f"r{i}", arrival=float(i)), now=0.0)
    verdicts = {"r0": Verdict.SKIP, "r1": Verdict.TAKE, "r2": Verdict.STOP}
    taken = q.take(0.0, lambda r: verdicts.get(r.req_id, Verdict.TAKE))
    assert [r.req_id for r in taken] == ["r1"]
    assert _drain(q, 0.0) == ["r0", "r2", "r3", "r4"]


def test_heap_queue_long_key_takes_over_past_the_threshold() -> None:
    q = HeapQueue(key=lambda r: (-r.prompt_len,), long_key=lambda r: (r.arrival_time,),
                  long_threshold=3)
    for i, p in enumerate([10, 30, 20]):
        q.push(make_request(f"r{i}", arrival=float(i), prompt=p), now=0.0)
    assert [r.req_id for r in q.take(0.0, lambda r: Verdict.STOP)] == []
    assert _drain(q, 0.0) == ["r1", "r2", "r0"]
    for i, p in enumerate([10, 30, 20, 40]):
        q.push(make_request(f"s{i}", arrival=float(i), prompt=p), now=0.0)
    assert _drain(q, 0.0) == ["s0", "s1", "s2", "s3"]


def test_removed_and_repushed_requests_are_offered_once() -> None:
    pol = make_ordering("slack", TIERS, EST)
    q = SlackQueue(pol)  # type: ignore[arg-type]
    a = make_request("a", tier=1, arrival=0.0)
    b = make_request("b", tier=1, arrival=0.1)
    q.push(a, 0.0)
    q.push(b, 0.0)
    q.remove("a")
    transition(b, RequestState.PREFILLING, decision=Decision.SCHEDULE_PREFILL,
               triggered_by="t", now=0.0)
    b.num_computed_tokens = 50
    q.push(b, 0.0)
    assert _drain(q, 0.0) == ["b"]


def test_sorted_queue_uses_any_policy() -> None:
    pol = make_ordering("utility", TIERS, EST)
    q = SortedQueue(pol)
    reqs = _random_requests(20, 7)
    for r in reqs:
        q.push(r, 0.0)
    assert _drain(q, 20.0) == [r.req_id for r in pol.order(reqs, 20.0)]


def test_hopeless_started_prefills_go_first_and_starving_ones_are_found() -> None:
    pol = make_ordering("slack", TIERS, EST)
    q = SlackQueue(pol)  # type: ignore[arg-type]
    old = make_request("old", tier=1, arrival=0.0)
    started = make_request("started", tier=1, arrival=1.0)
    transition(started, RequestState.PREFILLING, decision=Decision.SCHEDULE_PREFILL,
               triggered_by="t", now=19.0)
    started.num_computed_tokens = 10
    young = make_request("young", tier=1, arrival=5.0)
    for r in (old, started, young):
        q.push(r, now=20.0)
    # At 20 s "old" has waited past the 15 s tier-1 guard: it goes first; then the
    # started prefill, ahead of the request that waited longer but has not started.
    order = [r.req_id for r in pol.order([old, started, young], 20.0)]
    assert order == ["old", "started", "young"]
    assert _drain(q, 20.0) == order
