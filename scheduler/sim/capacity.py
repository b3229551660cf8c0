"""SLO capacity: the highest load at which every tier clears its attainment bar.

DistServe measures a serving system by its per-GPU goodput: the highest request rate at
which the SLO attainment target holds. Here the target is per tier
(:class:`scheduler.sim.slo.SloBars`: tier 0 at least 99 %, every other tier at least
90 %) and the rate is the trace's load (time compression). :func:`find_capacity` walks
the sweep loads upwards until one fails, then bisects between the last load that cleared
and that one; a probe at a load is any function that simulates it and says whether the
run cleared the bars. Attainment is assumed to fall with load: the first failure ends
the sweep (a later sweep load that clears again is not looked for). When no sweep load
fails, the capacity is only known to be at least the highest one (``is_lower_bound``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class CapacityResult:
    capacity: float  # highest load found to clear the bars (0.0: none did)
    is_lower_bound: bool = False  # every load probed cleared: the capacity is at least this
    probes: list[tuple[float, bool]] = field(default_factory=list)  # (load, cleared), in order


def find_capacity(probe: Callable[[float], bool], loads: Sequence[float], *,
                  bisect_steps: int = 3, known: Mapping[float, bool] | None = None
                  ) -> CapacityResult:
    """The SLO capacity over ``loads`` (ascending after sorting), refined by
    ``bisect_steps`` bisections below the first failing load; ``known``: loads already
    simulated (not probed again)."""
    if not loads:
        raise ValueError("loads: at least one sweep load is needed")
    known = dict(known or {})
    out = CapacityResult(0.0)

    def cleared(load: float) -> bool:
        if load not in known:
            known[load] = probe(load)
            out.probes.append((load, known[load]))
        return known[load]

    lo, hi = 0.0, None
    for load in sorted(loads):
        if cleared(load):
            lo = load
        else:
            hi = load
            break
    if hi is None:
        out.capacity, out.is_lower_bound = lo, True
        return out
    for _ in range(bisect_steps):
        mid = round((lo + hi) / 2, 6)
        if mid in (lo, hi):
            break
        if cleared(mid):
            lo = mid
        else:
            hi = mid
    out.capacity = lo
    return out


@dataclass(frozen=True, slots=True)
class Spread:
    """Mean and spread of one figure over seeds."""

    mean: float
    std: float
    min: float
    max: float
    n: int

    @staticmethod
    def of(values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("values: none to summarize")
        n = len(values)
        mean = sum(values) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
        return Spread(mean, std, min(values), max(values), n)

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "std": self.std, "min": self.min, "max": self.max,
                "n": self.n}


__all__ = ["CapacityResult", "Spread", "find_capacity"]
