"""Fair share: per-tier shares, moved every control interval from observed tails.

:class:`FairShareController` recomputes the shares from each tier's observed
tail latency against its target (``TailTracker``): a tier over its target asks
for more, one well under it gives some back. Each update moves any share by at
most ``max_share_step`` (10 percentage points) and keeps the sum at exactly 1:
the step is the full move towards the desired shares scaled by one factor, so
the deltas still sum to zero. In quota mode the shares are reservations and
do not move.

:class:`ShareLedger` keeps decayed counts of tokens demanded and served per tier.
A tier served less than ``floor`` x min(share, demand) is in deficit; ordering
policies serve deficit tiers first, which is what keeps any tier from starving
while another borrows its idle share (soft mode).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from scheduler.tiers import ShareMode, TierConfig


class TailTracker:
    """Recent latency/target ratios per tier; ``p99`` of the last ``window`` ones."""

    def __init__(self, num_tiers: int, window: int = 200) -> None:
        self._ratios = [deque(maxlen=window) for _ in range(num_tiers)]

    def observe(self, tier: int, latency_s: float, target_s: float) -> None:
        self._ratios[tier].append(latency_s / target_s)

    def p99_ratio(self, tier: int) -> float | None:
        xs = self._ratios[tier]
        if not xs:
            return None
        s = sorted(xs)
        return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


class FairShareController:
    RATIO_CLIP = (0.5, 4.0)

    def __init__(self, tiers: TierConfig) -> None:
        self.tiers = tiers
        self.base = tiers.shares()
        self.shares: tuple[float, ...] = self.base
        self._last = float("-inf")

    def update(self, now: float, tail_ratios: Sequence[float | None]) -> tuple[float, ...] | None:
        """New shares, or None when the interval has not passed or nothing moved.

        ``tail_ratios[t]`` is tier t's observed p99 latency over its target (None:
        no recent requests; the tier keeps its configured share as a wish).
        """
        if now - self._last < self.tiers.control_interval_s:
            return None
        self._last = now
        if self.tiers.share_mode is ShareMode.QUOTA:
            return None
        lo, hi = self.RATIO_CLIP
        want = [
            b * (1.0 if r is None else min(max(r, lo), hi))
            for b, r in zip(self.base, tail_ratios, strict=True)
        ]
        total = sum(want)
        if total <= 0:
            return None
        desired = [w / total for w in want]
        deltas = [d - s for d, s in zip(desired, self.shares, strict=True)]
        biggest = max(abs(d) for d in deltas)
        if biggest < 1e-9:
            return None
        scale = min(1.0, self.tiers.max_share_step / biggest)
        new = [s + scale * d for s, d in zip(self.shares, deltas, strict=True)]
        # Deltas sum to 0; remove float drift so the sum is 1 to the last bit we can.
        drift = sum(new) - 1.0
        j = max(range(len(new)), key=lambda i: new[i])
        new[j] -= drift
        self.shares = tuple(max(0.0, x) for x in new)
        return self.shares


class ShareLedger:
    """Exponentially decayed demand and service (tokens) per tier."""

    def __init__(self, num_tiers: int, half_life_s: float = 30.0) -> None:
        self.demand = [0.0] * num_tiers
        self.served = [0.0] * num_tiers
        self.total_demand = [0.0] * num_tiers
        self.total_served = [0.0] * num_tiers
        self._decay = math.log(2) / half_life_s
        self._t = 0.0

    def _advance(self, now: float) -> None:
        if now > self._t:
            f = math.exp(-self._decay * (now - self._t))
            self.demand = [x * f for x in self.demand]
            self.served = [x * f for x in self.served]
            self._t = now

    def record_demand(self, tier: int, tokens: float, now: float) -> None:
        self._advance(now)
        self.demand[tier] += tokens
        self.total_demand[tier] += tokens

    def record_served(self, tier: int, tokens: float, now: float) -> None:
        self._advance(now)
        self.served[tier] += tokens
        self.total_served[tier] += tokens

    def deficit_tiers(self, shares: Sequence[float], now: float, floor: float = 0.9) -> frozenset[int]:
        self._advance(now)
        tot_d = sum(self.demand)
        tot_s = sum(self.served)
        if tot_d <= 0 or tot_s <= 0:
            return frozenset()
        out = set()
        for t, share in enumerate(shares):
            entitled = min(share, self.demand[t] / tot_d)
            if self.served[t] / tot_s < floor * entitled:
                out.add(t)
        return frozenset(out)

    @staticmethod
    def entitlement(shares: Sequence[float], demand: Sequence[float]) -> list[float]:
        """min(share, demand fraction) per tier (the no-starvation yardstick)."""
        tot = sum(demand)
        if tot <= 0:
            return [0.0 for _ in shares]
        return [min(s, d / tot) for s, d in zip(shares, demand, strict=True)]
