"""Whether a request met its tier's targets, and the attainment bars of SLO capacity.

A request meets its SLO when it completed (stop or length) within every target of its
tier: TTFT, TPOT (mean time per output token after the first) and end to end. A rejected
or aborted request does not. It is feasible when its prefill alone, on an idle worker
with a cold cache, fits its tier's TTFT (no scheduler can serve the others in time).
:class:`SloBars` are the attainment bars a run must clear for its load to count towards
SLO capacity (DistServe's per-GPU goodput, with tiers): tier 0 at least 99 %, every
other tier at least 90 % by default; with ``feasible_only`` the bars apply to the
feasible requests of each tier.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from scheduler.request import Request, RequestState
from scheduler.tiers import TierSpec

_DONE = (RequestState.FINISHED_STOPPED, RequestState.FINISHED_LENGTH)


def met_slo(req: Request, num_output_tokens: int, spec: TierSpec) -> bool:
    """``req`` (closed) completed within every target of ``spec``; ``num_output_tokens`` is
    what the client got."""
    if req.state not in _DONE or req.first_token_time is None or req.finish_time is None:
        return False
    ttft = req.first_token_time - req.arrival_time
    e2e = req.finish_time - req.arrival_time
    tpot = ((req.finish_time - req.first_token_time) / (num_output_tokens - 1)
            if num_output_tokens > 1 else 0.0)
    return ((spec.ttft_s is None or ttft <= spec.ttft_s)
            and (spec.tpot_s is None or tpot <= spec.tpot_s)
            and (spec.e2e_s is None or e2e <= spec.e2e_s))


def is_feasible(prompt_len: int, spec: TierSpec, prefill_s: Callable[[int, int], float]
                ) -> bool:
    """The prompt's prefill alone (``prefill_s``: the cost model's, on an idle worker with
    a cold cache) fits the tier's TTFT target, if it has one."""
    return spec.ttft_s is None or prefill_s(prompt_len, 0) <= spec.ttft_s


@dataclass(frozen=True, slots=True)
class SloBars:
    """Attainment a run needs per tier: ``first`` for tier 0, ``others`` for the rest;
    ``feasible_only``: among the tier's feasible requests."""

    first: float = 0.99
    others: float = 0.90
    feasible_only: bool = False

    def __post_init__(self) -> None:
        if not (0 < self.first <= 1 and 0 < self.others <= 1):
            raise ValueError("attainment bars must be in (0, 1]")

    def bar(self, tier: int) -> float:
        return self.first if tier == 0 else self.others

    def allowed_misses(self, tier: int, num_requests: int) -> int:
        """Most requests of ``tier`` (of ``num_requests``) that may miss while it clears."""
        return math.floor((1.0 - self.bar(tier)) * num_requests + 1e-9)

    def cleared(self, run: dict[str, object]) -> bool:
        """Every tier of a summarized run (``scheduler.sim.metrics.summarize``) clears."""
        tiers = run["tiers"]
        assert isinstance(tiers, dict)
        key = "attainment_feasible" if self.feasible_only else "attainment"
        for t, d in tiers.items():
            att = d[key]
            if att is not None and att < self.bar(int(t)) - 1e-12:
                return False
        return True


__all__ = ["SloBars", "is_feasible", "met_slo"]
