"""SLO tiers (DESIGN §5): targets, shares and the knobs that act per tier.

A :class:`TierConfig` is frozen and validated on construction; an invalid one
raises :class:`ConfigError` naming the field (``tiers[2].share``) and why.
The cluster's pydantic config tree converts into this; the kernel never sees
raw user input.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

MIN_TIERS = 2
MAX_TIERS = 8
_SHARE_TOLERANCE = 1e-6


class ConfigError(ValueError):
    """An invalid configuration; the message names the field and the reason."""


class ShareMode(enum.Enum):
    SOFT = "soft"  # an idle tier's share can be borrowed by others
    QUOTA = "quota"  # reservations stay idle when their tier has no work


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier's targets (seconds; ``None`` means no such target)."""

    name: str
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    share: float
    # Relative importance in utility and preemption cost (higher matters more).
    weight: float
    # A new arrival of this tier preempts at once only when free memory plus one
    # eviction round covers at least this fraction of its KV need.
    preempt_threshold: float = 0.9
    # Bound on how long a request of this tier may wait without progress.
    max_starvation_s: float = 60.0

    @property
    def deadline_s(self) -> float:
        """The binding per-request deadline used for ordering: e2e, else TTFT."""
        if self.e2e_s is not None:
            return self.e2e_s
        assert self.ttft_s is not None  # guaranteed by TierConfig validation
        return self.ttft_s


@dataclass(frozen=True, slots=True)
class TierConfig:
    tiers: tuple[TierSpec, ...]
    share_mode: ShareMode = ShareMode.SOFT
    # A request is not preempted twice within this window (DESIGN §7).
    anti_thrash_s: float = 1.0
    # Fraction of its deadline after which a request's priority is boosted.
    boost_fraction: float = 0.7
    # How often the deadline watcher and the fair share controller run.
    control_interval_s: float = 0.1
    # Most a tier's share may move in one fair-share update.
    max_share_step: float = 0.10

    def __post_init__(self) -> None:
        n = len(self.tiers)
        if not MIN_TIERS <= n <= MAX_TIERS:
            raise ConfigError(f"tiers: {n} tiers given, between {MIN_TIERS} and {MAX_TIERS} allowed")
        for i, t in enumerate(self.tiers):
            where = f"tiers[{i}]"
            for name in ("ttft_s", "tpot_s", "e2e_s"):
                v = getattr(t, name)
                if v is not None and not (math.isfinite(v) and v > 0):
                    raise ConfigError(f"{where}.{name}: must be a positive number of seconds, got {v}")
            if t.ttft_s is None and t.e2e_s is None:
                raise ConfigError(f"{where}: needs a ttft_s or an e2e_s target")
            if not (math.isfinite(t.share) and 0.0 <= t.share <= 1.0):
                raise ConfigError(f"{where}.share: must be in [0, 1], got {t.share}")
            if not (math.isfinite(t.weight) and t.weight > 0):
                raise ConfigError(f"{where}.weight: must be positive, got {t.weight}")
            if not 0.0 < t.preempt_threshold <= 1.0:
                raise ConfigError(
                    f"{where}.preempt_threshold: must be in (0, 1], got {t.preempt_threshold}"
                )
            if not t.max_starvation_s > 0:
                raise ConfigError(f"{where}.max_starvation_s: must be positive, got {t.max_starvation_s}")
        total = sum(t.share for t in self.tiers)
        if abs(total - 1.0) > _SHARE_TOLERANCE:
            raise ConfigError(f"tiers[*].share: shares must sum to 1, they sum to {total:.6g}")
        if not self.anti_thrash_s >= 0:
            raise ConfigError(f"anti_thrash_s: must be >= 0, got {self.anti_thrash_s}")
        if not 0.0 < self.boost_fraction <= 1.0:
            raise ConfigError(f"boost_fraction: must be in (0, 1], got {self.boost_fraction}")
        if not self.control_interval_s > 0:
            raise ConfigError(f"control_interval_s: must be positive, got {self.control_interval_s}")
        if not 0.0 < self.max_share_step <= 1.0:
            raise ConfigError(f"max_share_step: must be in (0, 1], got {self.max_share_step}")

    @property
    def num_tiers(self) -> int:
        return len(self.tiers)

    def __getitem__(self, tier: int) -> TierSpec:
        return self.tiers[tier]

    def shares(self) -> tuple[float, ...]:
        return tuple(t.share for t in self.tiers)


def default_tiers() -> TierConfig:
    """DESIGN §5: latency-critical, interactive, batch, best-effort."""
    return TierConfig(
        tiers=(
            TierSpec("latency-critical", ttft_s=0.2, tpot_s=0.05, e2e_s=None, share=0.30,
                     weight=8.0, preempt_threshold=0.9, max_starvation_s=5.0),
            TierSpec("interactive", ttft_s=2.0, tpot_s=0.1, e2e_s=None, share=0.50,
                     weight=4.0, preempt_threshold=1.0, max_starvation_s=30.0),
            TierSpec("batch", ttft_s=None, tpot_s=None, e2e_s=30.0, share=0.10,
                     weight=2.0, preempt_threshold=1.0, max_starvation_s=120.0),
            TierSpec("best-effort", ttft_s=None, tpot_s=None, e2e_s=600.0, share=0.10,
                     weight=1.0, preempt_threshold=1.0, max_starvation_s=900.0),
        )
    )


def cpu_tiers() -> TierConfig:
    """DESIGN §5's preset for CPU serving: targets a CPU engine can meet (a tier-0 TTFT of
    200 ms is below one step of a small model on a few cores, which would mark every
    tier-0 request hopeless on arrival)."""
    return TierConfig(
        tiers=(
            TierSpec("latency-critical", ttft_s=1.0, tpot_s=0.25, e2e_s=None, share=0.30,
                     weight=8.0, preempt_threshold=0.9, max_starvation_s=5.0),
            TierSpec("interactive", ttft_s=4.0, tpot_s=0.5, e2e_s=None, share=0.50,
                     weight=4.0, preempt_threshold=1.0, max_starvation_s=30.0),
            TierSpec("batch", ttft_s=None, tpot_s=None, e2e_s=60.0, share=0.10,
                     weight=2.0, preempt_threshold=1.0, max_starvation_s=120.0),
            TierSpec("best-effort", ttft_s=None, tpot_s=None, e2e_s=300.0, share=0.10,
                     weight=1.0, preempt_threshold=1.0, max_starvation_s=900.0),
        )
    )


@dataclass(frozen=True, slots=True)
class TierMix:
    """Seeded assignment of tiers to trace requests (default 10/40/30/20 %)."""

    fractions: tuple[float, ...] = field(default=(0.10, 0.40, 0.30, 0.20))

    def __post_init__(self) -> None:
        if any(f < 0 for f in self.fractions) or abs(sum(self.fractions) - 1.0) > _SHARE_TOLERANCE:
            raise ConfigError(f"tier mix: fractions must be >= 0 and sum to 1, got {self.fractions}")
