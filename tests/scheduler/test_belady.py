"""The Belady bound is a real upper bound on what the prefix index reaches."""

from __future__ import annotations

import random

from scheduler.prefix_index import PrefixIndex
from scheduler.sim.belady import belady_hits


def _workload(seed: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    convs = [[rng.randrange(10**6)] for _ in range(12)]
    out = []
    for _ in range(200):
        c = rng.choice(convs)
        c.append(rng.randrange(10**6, 2 * 10**6))  # a conversation grows by one block
        out.append(tuple([0] + c))
    return out


def _lru_hits(accesses: list[tuple[int, ...]], capacity: int) -> tuple[int, int]:
    idx = PrefixIndex(capacity)
    for a in accesses:
        assert idx.acquire(a) is not None
        idx.release(a)
    return idx.num_hit_blocks, idx.num_lookup_blocks


def test_belady_beats_lru_and_infinite_cache_bounds_both() -> None:
    for seed in range(3):
        acc = _workload(seed)
        cap = 60
        bh, bl = belady_hits(acc, cap)
        lh, ll = _lru_hits(acc, cap)
        inf_h, _ = belady_hits(acc, 10**9)
        assert bl == ll
        assert lh <= bh <= inf_h
        assert bh > 0


def test_belady_small_case_by_hand() -> None:
    # Capacity 2: keep {1, 2}; 3 is never reused, so it bypasses the cache.
    hits, lookups = belady_hits([(1, 2), (3,), (1, 2)], 2)
    assert (hits, lookups) == (2, 5)
