"""The scope of a check: cluster size, clock, workload shapes, policy and tiers.

:class:`Scope` is frozen and validated (``ScopeError`` names the field). The
tiers under check are the default tiers of DESIGN §5 cut to ``num_tiers``
(:func:`scope_tiers`), with starvation bounds that may be scaled to the scope's
clock so the ordering's starvation guard acts within a short run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from scheduler.tiers import TierConfig, TierSpec, default_tiers


class ScopeError(ValueError):
    """An invalid scope; the message names the field."""


@dataclass(frozen=True, slots=True)
class Shape:
    """A request the workload may generate."""

    tier: int
    prompt_len: int
    max_new_tokens: int
    block_hashes: tuple[int, ...] = ()

    def label(self) -> str:
        return f"tier{self.tier}/p{self.prompt_len}/o{self.max_new_tokens}"


def scope_tiers(num_tiers: int, starvation_s: Sequence[float] | None = None) -> TierConfig:
    """The first ``num_tiers`` default tiers (DESIGN §5), shares renormalised.

    Beyond the four defaults, best-effort tiers with falling weights. A
    ``starvation_s`` list overrides the per-tier starvation bounds.
    """
    base = default_tiers()
    specs: list[TierSpec] = []
    for i in range(num_tiers):
        spec = base.tiers[min(i, 3)]
        if i > 3:
            spec = replace(spec, name=f"best-effort-{i}", weight=1.0 / (i - 2))
        specs.append(spec)
    total = sum(s.share for s in specs)
    specs = [replace(s, share=s.share / total) for s in specs]
    drift = 1.0 - sum(s.share for s in specs)
    specs[0] = replace(specs[0], share=specs[0].share + drift)
    if starvation_s is not None:
        if len(starvation_s) != num_tiers:
            raise ScopeError(f"starvation_s: {len(starvation_s)} bounds for {num_tiers} tiers")
        specs = [replace(s, max_starvation_s=b) for s, b in zip(specs, starvation_s, strict=True)]
    return TierConfig(tiers=tuple(specs), anti_thrash_s=base.anti_thrash_s)


def default_shapes(num_tiers: int) -> tuple[Shape, ...]:
    """One shape per tier, sharing a system-prompt block: tier 0 a chat turn
    (3 blocks, growing to 4), every other tier a longer one (4, growing to 6). On
    8-block workers a lower-tier and a tier-0 request outgrow their worker (KV
    pressure), and a further tier-0 arrival must preempt or wait."""
    out = [Shape(0, 32, 32, (1, 2))]
    out.extend(Shape(t, 48, 48, (1, 3, 4)) for t in range(1, num_tiers))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Scope:
    """The cluster and the mechanics; the policy and tiers under check."""

    max_requests: int = 4
    num_tiers: int = 2
    blocks_per_worker: int = 8
    num_workers: int = 2
    max_failures: int = 1
    dt_s: float = 0.5
    # Arrivals happen at ticks 0 .. arrival_ticks - 1 (exhaustive mode).
    arrival_ticks: int = 4
    max_ticks: int = 64
    block_size: int = 16
    tokens_per_tick: int = 16
    step_budget_tokens: int = 64
    # Most early stops (a stop token before max_new_tokens) in one run.
    max_stops: int = 1
    shapes: tuple[Shape, ...] = ()
    policy: str = "tierserve"
    starvation_s: tuple[float, ...] | None = None
    prefill_per_token_s: float = 1e-4
    decode_per_token_s: float = 0.02
    # Routers retry the requests a worker failure ended (cluster.backend's retries).
    retries: bool = False

    def __post_init__(self) -> None:
        for name in ("max_requests", "num_workers", "blocks_per_worker", "arrival_ticks",
                     "max_ticks", "block_size", "tokens_per_tick", "step_budget_tokens"):
            if getattr(self, name) <= 0:
                raise ScopeError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("max_failures", "max_stops"):
            if getattr(self, name) < 0:
                raise ScopeError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if not (math.isfinite(self.dt_s) and self.dt_s > 0):
            raise ScopeError(f"dt_s: must be a positive number of seconds, got {self.dt_s}")
        for s in self.shapes:
            if not 0 <= s.tier < self.num_tiers:
                raise ScopeError(f"shapes: tier {s.tier} outside 0..{self.num_tiers - 1}")
            if s.prompt_len <= 0 or s.max_new_tokens <= 0:
                raise ScopeError(f"shapes: {s.label()} needs a positive prompt and output")

    def with_default_shapes(self) -> Scope:
        return self if self.shapes else replace(self, shapes=default_shapes(self.num_tiers))
