"""Decode-memory reserves sized from what is measured (issue 22, item 2).

A request of tier t placed on a decode worker leaves some of its blocks free for two
kinds of later need, and for nothing else:

1. **More urgent arrivals.** The KV blocks per second that arriving requests of tiers
   before t ask for (:class:`DemandMeter`, measured over the last ``TAU_S`` seconds), the
   share that lands on this worker, over the worker's *release window*: how long its own
   decodes take to give back one such request's blocks as they finish, at most
   ``REACTION_PLANS`` planning intervals. Within that window an urgent arrival finds the
   reserve; after it, released memory serves it (the kernel hands released blocks to the
   most urgent waiting request first) or the kernel preempts for it (tier 0 at once).
   Sized to the whole flow of a busy tier instead, the reserve held half of each worker
   idle under overload (issue 22's bench-pressure run: tiers 2 and 3 queued for minutes
   beside 100 free blocks). No traffic of a more urgent tier: nothing is held for it; nor
   on a worker whose decodes release nothing (the reserve would never come back).
2. **Growth of the running decodes** (tiers after 0 only) of tiers up to t: the blocks
   they add within one anti-thrash window at the worker's measured step time, each up
   to its token budget, so their growth does not preempt the request inside it (a
   release at a decode's predicted end is not counted against it: output lengths are a
   guess, growth is not). A less urgent decode's growth does not count: when it finds
   no block, it is the one that gives way.

Both together are capped at ``MAX_FRACTION`` of the worker. The same :func:`decode_reserve` is
what placement applies and what the work-conservation invariant reads
(:mod:`scheduler.invariants`): a waiting request that fits a worker's free blocks less
this reserve must be placed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# Arrival demand is averaged over about this many seconds (an exponentially decayed sum).
TAU_S = 10.0
# The longest window a reserve covers, in planning intervals: past it the kernel makes
# room for an urgent arrival itself (tier 0 preempts at once, a later tier once late),
# and memory held idle longer only starves the tiers that could use it.
REACTION_PLANS = 2
# No reserve takes more than this share of a worker's blocks.
MAX_FRACTION = 0.5


class DemandMeter:
    """Per tier, the KV blocks and requests that arrive per second, decayed over
    ``tau_s`` (normalised for the time observed so far, so a constant rate reads as that
    rate from the first seconds on)."""

    __slots__ = ("tau_s", "_blocks", "_count", "_last", "_first")

    def __init__(self, num_tiers: int, tau_s: float = TAU_S) -> None:
        self.tau_s = tau_s
        self._blocks = [0.0] * num_tiers
        self._count = [0.0] * num_tiers
        self._last: float | None = None
        self._first: float | None = None

    def _decay(self, now: float) -> None:
        if self._last is None:
            self._last = self._first = now
            return
        dt = now - self._last
        if dt > 0:
            f = math.exp(-dt / self.tau_s)
            self._blocks = [b * f for b in self._blocks]
            self._count = [c * f for c in self._count]
            self._last = now

    def record(self, tier: int, num_blocks: int, now: float) -> None:
        self._decay(now)
        self._blocks[tier] += num_blocks
        self._count[tier] += 1.0

    def _span(self, now: float) -> float:
        if self._first is None:
            return 0.0
        seen = max(now - self._first, 0.0)
        return self.tau_s * (1.0 - math.exp(-seen / self.tau_s))

    def rates(self, now: float) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """(blocks per second, requests per second) per tier, as of ``now``."""
        self._decay(now)
        span = self._span(now)
        if span <= 0:
            n = len(self._blocks)
            return (0.0,) * n, (0.0,) * n
        return (tuple(b / span for b in self._blocks), tuple(c / span for c in self._count))


@dataclass(frozen=True, slots=True)
class UrgentDemand:
    """For a request of each tier: the blocks per second the tiers before it ask for, in
    the whole cluster, and the mean blocks one such request holds (0 without any)."""

    blocks_per_s: tuple[float, ...]
    mean_blocks: tuple[float, ...]

    @classmethod
    def none(cls, num_tiers: int) -> UrgentDemand:
        return cls((0.0,) * num_tiers, (0.0,) * num_tiers)

    @classmethod
    def of(cls, meter: DemandMeter, now: float) -> UrgentDemand:
        blocks, reqs = meter.rates(now)
        bps, mean = [], []
        for t in range(len(blocks)):
            b, r = sum(blocks[:t]), sum(reqs[:t])
            bps.append(b)
            mean.append(b / r if r > 0 else 0.0)
        return cls(tuple(bps), tuple(mean))


def growth_blocks(decodes: Iterable[tuple[int, int, int]], *, tokens: int,
                  block_size: int) -> int:
    """Blocks ``decodes`` (context tokens, blocks held, tokens left in the budget) add
    within ``tokens`` more steps each (the anti-thrash window at the measured step time),
    each no further than its budget: what they are certain to need while they run (a
    release at their predicted end is not: output lengths are a guess)."""
    out = 0
    for ctx, held, left in decodes:
        out += max(-(-(ctx + min(tokens, max(left, 0))) // block_size) - held, 0)
    return out


def decode_reserve(tier: int, urgent: UrgentDemand, *, num_kv_blocks: int,
                   release_blocks_per_s: float | None, growth: int, num_workers: int,
                   min_window_s: float) -> int:
    """Blocks a request of ``tier`` leaves free on a decode worker (module docstring):
    the more urgent tiers' measured demand over the worker's release window, and for
    tiers after 0 the ``growth`` of its running decodes (:func:`growth_blocks`)."""
    reserve = 0.0
    rate = urgent.blocks_per_s[tier] / max(num_workers, 1)
    if rate > 0:
        size = urgent.mean_blocks[tier]
        rel = release_blocks_per_s or 0.0
        # A worker that releases nothing (none of its requests decodes) would hold the
        # reserve forever and starve the request: an urgent arrival preempts instead.
        if rel > 0:
            reserve += rate * min(size / rel, REACTION_PLANS * min_window_s)
    if tier > 0:
        reserve += growth
    return min(math.ceil(reserve), int(MAX_FRACTION * num_kv_blocks))
