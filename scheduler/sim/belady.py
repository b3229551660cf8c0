"""Offline-optimal (Belady) prefix-cache hit rate for a recorded access sequence.

Given the prompts' block-hash chains in the order a worker looked them up, and
the cache capacity in blocks, evict the block whose next use lies farthest in
the future (bypassing the cache when the newest blocks are those). A lookup
hits its leading cached blocks, as in :class:`scheduler.prefix_index.PrefixIndex`.
No online policy can beat this on block hits, so it bounds the achievable
prefix hit rate at that capacity.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

_NEVER = float("inf")


def belady_hits(accesses: Sequence[Sequence[int]], capacity: int) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) under Belady eviction."""
    if capacity <= 0:
        raise ValueError(f"capacity: must be positive, got {capacity}")
    n = len(accesses)
    next_use: list[dict[int, float]] = [{} for _ in range(n)]
    seen: dict[int, float] = {}
    for i in range(n - 1, -1, -1):
        for h in accesses[i]:
            next_use[i][h] = seen.get(h, _NEVER)
        for h in accesses[i]:
            seen[h] = i
    cache: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    hits = lookups = 0
    for i, acc in enumerate(accesses):
        lookups += len(acc)
        for h in acc:
            if h not in cache:
                break
            hits += 1
        for h in acc:
            nu = next_use[i][h]
            cache[h] = nu
            heapq.heappush(heap, (-nu, h))
        while len(cache) > capacity:
            neg, h = heapq.heappop(heap)
            if cache.get(h) == -neg:
                del cache[h]
    return hits, lookups
