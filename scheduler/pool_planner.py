"""How many prefill and decode workers each pool needs: the SLO planner's decision.

A pure object, stepped with what the control plane measured over the last window
(:class:`PoolSignals`); it answers with at most one change per pool (:class:`PoolChange`),
which the cluster applies by adding a worker actor or draining one away. The shape
follows NVIDIA Dynamo's SLA planner and every bounded autoscaler (Kubernetes' HPA):
demand is read from measurements, not from a model of the future, and every change is
bounded, so a noisy window cannot make the pools flap.

What each pool's size answers to:

- **Prefill**: how busy its workers were (the fraction of the window they spent
  running prefill steps) and whether tier-0 requests missed their time to first token
  while prefill work waited. Prefill is what TTFT waits on.
- **Decode**: how full its KV memory is (a request that does not fit waits or preempts
  others) and how busy its steps are. Decode memory is what admission of long prompts and
  the inter-token latency wait on.

The bounds (issue 25): one worker per pool per decision; ``cooldown_s`` between two
changes of a pool; ``min``/``max`` per pool; hysteresis: up at a high watermark, down
only when the pool *after* losing a worker would still sit under a low watermark, and
only after that has held for ``down_stable_s`` with tier 0 meeting its target. Growing
is fast (tier 0 is the promise) and shrinking slow (a worker taken away too early costs
a miss; one kept too long costs only money).

In ``auto`` pools a worker may change role instead: when one pool must grow, is at the
cluster's total worker budget and the other pool can spare one, the decision is a move.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Pool(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class Why(enum.Enum):
    """The reason for a change, as the planner's log and ``tierserve why`` print it."""

    TIER0_TTFT = "tier-0 missed its TTFT target while prefill work waited"
    PREFILL_BUSY = "prefill workers busy above the high watermark"
    TIER0_DECODE = "tier-0 missed its target while decode memory or steps were short"
    KV_FULL = "decode KV memory above the high watermark"
    DECODE_BUSY = "decode workers busy above the high watermark"
    IDLE = "the pool stayed under the low watermark with one worker less"
    BELOW_MIN = "the pool is below its minimum size"
    ABOVE_MAX = "the pool is above its maximum size"


@dataclass(frozen=True, slots=True)
class PoolLimits:
    min_size: int = 1
    max_size: int = 4

    def __post_init__(self) -> None:
        if not 0 <= self.min_size <= self.max_size:
            raise ValueError(f"pool limits: need 0 <= min ({self.min_size}) <= max "
                             f"({self.max_size})")


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    """The planner's bounds and watermarks (``planner.*`` in the cluster config)."""

    prefill: PoolLimits = field(default_factory=PoolLimits)
    decode: PoolLimits = field(default_factory=PoolLimits)
    cooldown_s: float = 20.0  # between two changes of one pool
    down_stable_s: float = 45.0  # a pool under its low watermark this long may shrink
    target_attainment: float = 0.99  # tier 0's, over the window
    busy_high: float = 0.85  # fraction of the window a pool's workers ran steps
    busy_low: float = 0.45
    kv_high: float = 0.85  # decode KV memory in use
    kv_low: float = 0.45
    max_total: int | None = None  # workers of both pools together (None: no budget)
    allow_role_moves: bool = False  # auto pools: a worker may change role

    def __post_init__(self) -> None:
        for lo, hi, name in ((self.busy_low, self.busy_high, "busy"),
                             (self.kv_low, self.kv_high, "kv")):
            if not 0.0 <= lo < hi <= 1.0:
                raise ValueError(f"planner {name} watermarks: need 0 <= low ({lo}) < high "
                                 f"({hi}) <= 1")
        if self.cooldown_s < 0 or self.down_stable_s < 0:
            raise ValueError("planner: cooldown_s and down_stable_s must be >= 0")
        if not 0.0 < self.target_attainment <= 1.0:
            raise ValueError(f"planner: target_attainment must be in (0, 1], got "
                             f"{self.target_attainment}")

    def limits(self, pool: Pool) -> PoolLimits:
        return self.prefill if pool is Pool.PREFILL else self.decode


@dataclass(frozen=True, slots=True)
class PoolSignals:
    """What the control plane measured over the last window.

    ``tier0_attainment``: the fraction of tier-0 requests that ended in the window
    meeting their targets (None: none ended). ``tier0_prefill_waits``: some tier-0
    request of the window waited for a prefill worker (queued prefill work of tier 0, or
    a TTFT miss with its prefill queued). ``prefill_busy``/``decode_busy``: the mean
    fraction of the window the pool's workers spent in steps. ``kv_used``: the decode
    workers' KV memory in use (mean fraction)."""

    now: float
    num_prefill: int
    num_decode: int
    tier0_attainment: float | None
    tier0_prefill_waits: bool
    prefill_busy: float
    decode_busy: float
    kv_used: float

    def size(self, pool: Pool) -> int:
        return self.num_prefill if pool is Pool.PREFILL else self.num_decode


@dataclass(frozen=True, slots=True)
class PoolChange:
    """Grow (``delta`` +1) or shrink (-1) ``pool``; a role move is a pair of changes with
    ``move`` set: the shrinking pool's worker comes back in the growing one."""

    pool: Pool
    delta: int
    why: Why
    move: bool = False


class PoolPlanner:
    """Steps once per window with the window's signals; remembers only when each pool
    last changed and since when it has been idle enough to shrink."""

    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings
        self._changed_at: dict[Pool, float] = {}
        self._low_since: dict[Pool, float | None] = {Pool.PREFILL: None, Pool.DECODE: None}

    def step(self, sig: PoolSignals) -> list[PoolChange]:
        s = self.settings
        wants = {pool: self._want(pool, sig) for pool in Pool}
        changes: list[PoolChange] = []
        for pool, want in wants.items():
            if (want is None or not self._cooled(pool, sig.now)
                    or any(c.pool is pool for c in changes)):  # a move took it already
                continue
            delta, why = want
            if delta > 0 and s.max_total is not None and why is not Why.BELOW_MIN:
                if sum(sizes_after(sig, changes)) >= s.max_total:
                    move = self._move_from(pool, sig, wants)
                    if move is not None:
                        changes += [PoolChange(move, -1, why, move=True),
                                    PoolChange(pool, +1, why, move=True)]
                    continue
            changes.append(PoolChange(pool, delta, why))
        for c in changes:
            self._changed_at[c.pool] = sig.now
            self._low_since[c.pool] = None
        return changes

    # -- one pool ----------------------------------------------------------------------

    def _want(self, pool: Pool, sig: PoolSignals) -> tuple[int, Why] | None:
        s = self.settings
        lim = s.limits(pool)
        n = sig.size(pool)
        if n < lim.min_size:
            return +1, Why.BELOW_MIN
        if n > lim.max_size:
            return -1, Why.ABOVE_MAX
        up = self._up_reason(pool, sig)
        if up is not None:
            self._low_since[pool] = None
            return (+1, up) if n < lim.max_size else None
        if n <= lim.min_size or not self._could_shrink(pool, sig):
            self._low_since[pool] = None
            return None
        since = self._low_since[pool]
        if since is None:
            self._low_since[pool] = sig.now
            return None
        return (-1, Why.IDLE) if sig.now - since >= s.down_stable_s else None

    def _up_reason(self, pool: Pool, sig: PoolSignals) -> Why | None:
        s = self.settings
        missing = (sig.tier0_attainment is not None
                   and sig.tier0_attainment < s.target_attainment)
        if pool is Pool.PREFILL:
            if missing and sig.tier0_prefill_waits:
                return Why.TIER0_TTFT
            return Why.PREFILL_BUSY if sig.prefill_busy >= s.busy_high else None
        if sig.kv_used >= s.kv_high:
            return Why.TIER0_DECODE if missing else Why.KV_FULL
        if sig.decode_busy >= s.busy_high:
            return Why.TIER0_DECODE if missing else Why.DECODE_BUSY
        if missing and (not sig.tier0_prefill_waits or s.prefill.max_size == 0):
            # Not prefill's misses, or no prefill pool (aggregated: the decode workers
            # prefill, so every tier-0 miss is theirs).
            return Why.TIER0_DECODE
        return None

    def _could_shrink(self, pool: Pool, sig: PoolSignals) -> bool:
        """Would the pool with one worker less still sit under its low watermarks, with
        tier 0 meeting its target (or idle)?"""
        s = self.settings
        if sig.tier0_attainment is not None and sig.tier0_attainment < s.target_attainment:
            return False
        n = sig.size(pool)
        if n <= 1:
            return False
        scale = n / (n - 1)  # the same work over one worker less
        if pool is Pool.PREFILL:
            return sig.prefill_busy * scale < s.busy_low
        return sig.decode_busy * scale < s.busy_low and sig.kv_used * scale < s.kv_low

    def _cooled(self, pool: Pool, now: float) -> bool:
        last = self._changed_at.get(pool)
        return last is None or now - last >= self.settings.cooldown_s

    def _move_from(self, pool: Pool, sig: PoolSignals,
                   wants: dict[Pool, tuple[int, Why] | None]) -> Pool | None:
        """The other pool, when it can give a worker to ``pool`` (auto pools only): it is
        not growing itself, stays within its minimum and would not cross a high
        watermark with one worker less."""
        if not self.settings.allow_role_moves:
            return None
        other = Pool.DECODE if pool is Pool.PREFILL else Pool.PREFILL
        want = wants.get(other)
        if (want is not None and want[0] > 0) or not self._cooled(other, sig.now):
            return None
        n = sig.size(other)
        if n - 1 < self.settings.limits(other).min_size or n <= 1:
            return None
        s = self.settings
        scale = n / (n - 1)
        if other is Pool.PREFILL:
            fine = sig.prefill_busy * scale < s.busy_high
        else:
            fine = sig.decode_busy * scale < s.busy_high and sig.kv_used * scale < s.kv_high
        return other if fine else None


def busy_fraction(step_seconds: float, window_s: float, num_workers: int) -> float:
    """The mean fraction of a window ``num_workers`` spent in steps, from the seconds
    their steps took (clipped to [0, 1])."""
    if window_s <= 0 or num_workers <= 0:
        return 0.0
    return min(max(step_seconds / (window_s * num_workers), 0.0), 1.0)


def sizes_after(sig: PoolSignals, changes: list[PoolChange]) -> tuple[int, int]:
    """(prefill, decode) sizes once ``changes`` are applied."""
    p, d = sig.num_prefill, sig.num_decode
    for c in changes:
        if c.pool is Pool.PREFILL:
            p += c.delta
        else:
            d += c.delta
    return p, d


__all__ = ["Pool", "PoolChange", "PoolLimits", "PoolPlanner", "PoolSignals",
           "PlannerSettings", "Why", "busy_fraction", "sizes_after"]
