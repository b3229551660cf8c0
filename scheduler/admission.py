"""Admission: accept, queue, or reject with a retry-after, from SLO feasibility.

On arrival the global scheduler predicts the request's time to its binding
deadline's milestone: the prefill work queued ahead of it (work of its own and
more urgent tiers, spread over the prefill workers) plus its own prefill. If
that fits its deadline it is accepted (capacity free now) or queued (capacity
frees up in time); if the load makes it miss (its own prefill alone would fit)
by more than ``tolerance``, it is rejected with ``retry_after_s`` = how long
until the work ahead has drained enough for it to fit. Rejecting early keeps
doomed work from taking capacity that feasible requests need; a request too big
for its target even on an idle worker is queued and served best effort.

Conditional preemption (``should_preempt_now``): a higher-tier arrival preempts
at once only when free memory plus one eviction round covers at least its
tier's ``preempt_threshold`` (0.9 for tier 0 by default) of its KV need;
otherwise it waits for memory to free up.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.deadlines import ServiceEstimate, deadline
from scheduler.request import Request
from scheduler.tiers import TierConfig


class AdmissionKind(enum.Enum):
    ACCEPT = "accept"
    QUEUE = "queue"
    REJECT = "reject"


class AdmissionReason(enum.Enum):
    CAPACITY_NOW = "capacity_now"
    FEASIBLE_LATER = "feasible_later"
    NO_SLO_HEADROOM = "no_slo_headroom"


@dataclass(frozen=True, slots=True)
class AdmissionDecision:
    kind: AdmissionKind
    reason: AdmissionReason
    predicted_s: float  # predicted time from now to the request's first milestone
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What admission reads: queued prefill work per tier (seconds of one worker)."""

    backlog_s_by_tier: Sequence[float]
    num_prefill_workers: int
    has_capacity_now: bool


class AdmissionController:
    def __init__(self, tiers: TierConfig, est: ServiceEstimate, tolerance: float = 1.0,
                 reject_tiers: frozenset[int] | None = None) -> None:
        """``reject_tiers``: tiers that may be rejected (default: those with a TTFT target)."""
        if tolerance < 0:
            raise ValueError(f"tolerance: must be >= 0, got {tolerance}")
        self.tiers = tiers
        self.est = est
        self.tolerance = tolerance
        self.reject_tiers = (
            reject_tiers if reject_tiers is not None
            else frozenset(i for i, t in enumerate(tiers.tiers) if t.ttft_s is not None)
        )

    def decide(self, req: Request, now: float, load: LoadSnapshot) -> AdmissionDecision:
        workers = max(load.num_prefill_workers, 1)
        # Work of a more urgent tier counts as ahead only up to what can still meet
        # that tier's deadline: the rest is demoted behind feasible work.
        ahead = sum(min(b, self.tiers[u].deadline_s * workers)
                    for u, b in enumerate(load.backlog_s_by_tier[: req.tier + 1])) / workers
        own = self.est.prefill_s(max(req.prompt_len - req.num_computed_tokens, 1),
                                 req.num_computed_tokens)
        predicted = ahead + own
        budget = deadline(req, self.tiers) - now
        if predicted <= budget:
            kind = AdmissionKind.ACCEPT if load.has_capacity_now else AdmissionKind.QUEUE
            reason = (AdmissionReason.CAPACITY_NOW if load.has_capacity_now
                      else AdmissionReason.FEASIBLE_LATER)
            return AdmissionDecision(kind, reason, predicted)
        # A request too large to meet its target even on an idle worker is not
        # rejected (a retry would not help): it is queued and served best effort.
        if (req.tier in self.reject_tiers and own <= budget
                and predicted > budget * (1.0 + self.tolerance)):
            retry = max(predicted - budget, 0.0)
            return AdmissionDecision(AdmissionKind.REJECT, AdmissionReason.NO_SLO_HEADROOM,
                                     predicted, retry_after_s=retry)
        return AdmissionDecision(AdmissionKind.QUEUE, AdmissionReason.FEASIBLE_LATER, predicted)


def should_preempt_now(need_blocks: int, free_blocks: int, one_round_blocks: int,
                       threshold: float) -> bool:
    """Preempt at once only if free + one eviction round covers ``threshold`` of the need."""
    if need_blocks <= 0:
        return False
    return free_blocks + one_round_blocks >= threshold * need_blocks
