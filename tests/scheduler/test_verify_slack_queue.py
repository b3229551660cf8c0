"""Differential check: the incremental SlackQueue offers, step after step, exactly the
order SlackPolicy.order gives the requests still waiting (skips, stops and starving
requests kept across steps included)."""

from __future__ import annotations

import random

from scheduler.ordering import SlackPolicy, make_ordering
from scheduler.queues import SlackQueue, Verdict
from scheduler.request import Request
from scheduler.testing import EST, make_request
from scheduler.tiers import default_tiers


class _Accept:
    """Takes some, skips the rest, stops after ``limit`` offers; records the order."""

    def __init__(self, rng: random.Random, limit: int) -> None:
        self.rng = rng
        self.limit = limit
        self.offered: list[str] = []

    def __call__(self, r: Request) -> Verdict:
        self.offered.append(r.req_id)
        if len(self.offered) >= self.limit:
            return Verdict.STOP
        return Verdict.TAKE if self.rng.random() < 0.3 else Verdict.SKIP


def _run(seed: int) -> int:
    rng = random.Random(seed)
    pol = make_ordering("slack", default_tiers(), EST)
    assert isinstance(pol, SlackPolicy)
    q = SlackQueue(pol)
    live: dict[str, Request] = {}
    n = 0
    now = 0.0
    compared = 0
    for _ in range(25):
        now += rng.uniform(0.05, 3.0)
        for _ in range(rng.randint(0, 8)):
            r = make_request(f"r{n}", tier=rng.randrange(4), arrival=now - rng.uniform(0, 40),
                             prompt=rng.randrange(10, 3000), out=rng.randrange(1, 300))
            n += 1
            live[r.req_id] = r
            q.push(r, now)
        expected = [r.req_id for r in pol.order(list(live.values()), now)]
        accept = _Accept(rng, limit=rng.randint(1, 12))
        for r in q.take(now, accept):
            del live[r.req_id]
        offered = accept.offered
        assert offered == expected[:len(offered)], (seed, now)
        assert len(q) == len(live)
        compared += len(offered)
    return compared


def test_slack_queue_keeps_the_policy_order_across_steps() -> None:
    assert sum(_run(seed) for seed in range(6)) > 100
