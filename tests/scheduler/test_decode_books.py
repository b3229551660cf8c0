"""The decode workers' books kept across plans equal a recomputation after every event.

``ClusterScheduler`` keeps, per decode worker, what placement reads of its held requests
(release rate, growth, running count, the blocks its preempted requests need back) from
one plan to the next, and drops it whenever one of its inputs changes. A missed drop
would not fail any decision test until the stale view happened to matter; this drives
the real kernel through random event sequences (arrivals, plans, worker steps with their
reports, preemptions, stops, a worker failure) and compares every kept view with one
recomputed from the books after each event.
"""

from __future__ import annotations

import random

import pytest

from scheduler.verify.model import Event, EventKind, World
from scheduler.verify.scope import Shape
from scheduler.verify.trajectories import trajectory_scope


def _random_shape(rng: random.Random, num_tiers: int, earlier: list[Shape]) -> Shape:
    prompt = rng.randint(16, 320)
    n = prompt // 16
    head = rng.choice(earlier).block_hashes[:n] if earlier and rng.random() < 0.3 else ()
    hashes = head + tuple(rng.randrange(2, 1 << 30) for _ in range(n - len(head)))
    return Shape(rng.randrange(num_tiers), prompt, rng.randint(1, 96), hashes)


def _walk(seed: int, num_events: int) -> tuple[int, int]:
    """Random events through a 2-worker World; returns (views compared, preemptions)."""
    rng = random.Random(seed)
    scope = trajectory_scope()
    world = World.initial(scope)
    cs = world.cs
    decode_ids = [wid for wid, w in cs.workers.items() if w.can_decode]
    shapes: list[Shape] = []
    compared = 0
    for _ in range(num_events):
        if world.num_arrived < scope.max_requests and rng.random() < 0.15:
            shapes.append(_random_shape(rng, scope.num_tiers, shapes))
            ev = Event(EventKind.ARRIVE, shape=shapes[-1])
        else:
            options = world.enabled()
            if not options:
                break
            ev = rng.choice(options)
        world.apply(ev)
        assert cs.stale_views() == [], f"seed {seed}: after {world.describe(ev)}"
        compared += len(decode_ids)
        for wid in decode_ids:  # keep every worker's view for the next event to test
            cs.decode_reserves(wid)
    return compared, world.num_preemptions


@pytest.mark.parametrize("seed", range(6))
def test_kept_decode_views_equal_a_recomputation(seed: int) -> None:
    compared, _ = _walk(seed, 600)
    assert compared > 0


def test_the_walks_preempt() -> None:
    """The walks reach the events that change a view most (preemptions), so the test
    above covers them."""
    assert sum(_walk(seed, 600)[1] for seed in range(6)) > 0
