"""Blocks that waiting requests claim on decode workers during one plan.

A request that finds no room claims what is free for it on the worker with the most
(``ClusterScheduler._claim``): blocks released later go to it before a less urgent
request, or a large prompt would wait forever behind smaller ones that fit sooner. A
request of tier ``t`` needing ``n`` blocks sees a worker's free blocks less what the
requests that go before it claim there: every claim of a more urgent tier, and the claims
of its own tier that need no more than it.

Kept per worker and tier as running totals and, within a tier, claims sorted by need with
their prefix sums, so that what one request sees costs O(tiers + log claims) rather than a
walk over every claim: a plan offers every waiting request, and under overload hundreds of
them claim (a walk per offer made the plan quadratic in the queue).
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate


class _TierClaims:
    __slots__ = ("needs", "blocks", "prefix")

    def __init__(self) -> None:
        self.needs: list[int] = []  # sorted
        self.blocks: list[int] = []  # each claim's blocks, in the order of ``needs``
        self.prefix: list[int] = [0]  # prefix[i]: blocks of the first i claims

    def add(self, need: int, blocks: int) -> None:
        i = bisect_right(self.needs, need)
        self.needs.insert(i, need)
        self.blocks.insert(i, blocks)
        self.prefix[i:] = accumulate(self.blocks[i:], initial=self.prefix[i])

    def up_to(self, need: int) -> int:
        """Blocks claimed by the claims that need no more than ``need``."""
        return self.prefix[bisect_right(self.needs, need)]

    @property
    def total(self) -> int:
        return self.prefix[-1]


class Claims:
    """One plan's claims, by decode worker."""

    def __init__(self, num_tiers: int) -> None:
        self.num_tiers = num_tiers
        self._by_worker: dict[str, list[_TierClaims]] = {}
        # A dispatch took blocks on a worker where a claim it did not count (a less urgent
        # tier's, or its own tier's for a larger need) holds some: that claim was sized by
        # what was free before, and may now wrongly keep a fitting request out.
        self.passed = False

    def add(self, worker_id: str, tier: int, need: int, blocks: int) -> None:
        tiers = self._by_worker.get(worker_id)
        if tiers is None:
            tiers = self._by_worker[worker_id] = [_TierClaims() for _ in range(self.num_tiers)]
        tiers[tier].add(need, blocks)

    def held(self, worker_id: str, tier: int, need: int) -> int:
        """The blocks that go before a request of ``tier`` needing ``need`` on the worker."""
        tiers = self._by_worker.get(worker_id)
        if tiers is None:
            return 0
        return sum(tiers[t].total for t in range(tier)) + tiers[tier].up_to(need)

    def note_dispatch(self, worker_id: str, tier: int, need: int) -> None:
        """A request of ``tier`` needing ``need`` was dispatched to the worker."""
        tiers = self._by_worker.get(worker_id)
        if tiers is None or self.passed:
            return
        self.passed = (tiers[tier].total > tiers[tier].up_to(need)
                       or any(tiers[t].total for t in range(tier + 1, self.num_tiers)))

    def entries(self, worker_id: str) -> list[tuple[int, int, int]]:
        """(tier, need, blocks) of every claim on the worker (for tests and stats)."""
        tiers = self._by_worker.get(worker_id, [])
        return [(t, n, b) for t, tc in enumerate(tiers) for n, b in zip(tc.needs, tc.blocks, strict=True)]


__all__ = ["Claims"]
