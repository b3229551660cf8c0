"""Admission: accept, queue, or reject with a retry-after, from SLO feasibility.

On arrival the global scheduler predicts the request's time to its binding
deadline's milestone: the longer of two waits, plus its own work (its prefill, and
for a tier with an end-to-end target its decode too). One is the prefill work
queued ahead of it, spread over the prefill workers: all of the more urgent tiers'
(a hopeless request is never ordered behind a less urgent tier, DESIGN §5) and its
own tier's up to one deadline window (its tier's hopeless requests go behind it). The other is the wait for decode memory: the KV
blocks that queued requests of more urgent tiers want, those of its own tier up to
what the running requests release in one deadline window (the rest of its tier is
hopeless and goes behind it, as with the prefill work), plus its own, beyond what is
free or held by tiers it may preempt, drained at the rate the running requests
release blocks. Prefill is rarely the bottleneck when prompts
are long and KV is short; without the second term admission let in requests
that then waited past their tier's starvation bound for decode memory. If
that fits its deadline it is accepted (capacity free now) or queued (capacity
frees up in time); if the load makes it miss (its own prefill alone would fit)
by more than ``tolerance``, it is rejected with ``retry_after_s`` = how long
until the work ahead has drained enough for it to fit. Rejecting early keeps
doomed work from taking capacity that feasible requests need, whatever its tier;
a request too big for its target even on an idle worker is queued and served best
effort.

Conditional preemption (``should_preempt_now``): a higher-tier arrival preempts
at once only when free memory plus one eviction round covers at least its
tier's ``preempt_threshold`` (0.9 for tier 0 by default) of its KV need;
otherwise it waits for memory to free up.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.deadlines import ServiceEstimate, deadline, remaining_work_s
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
    # A rejection whose wait alone (the work ahead, without the request's own) misses the
    # target: every arrival of its tier would be rejected too until that work drains, so
    # the tier may be shed for a moment without asking again (never a feasible request).
    sheds_tier: bool = False


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What admission reads: queued prefill work per tier (seconds of one worker) and,
    when the caller knows it, decode memory (blocks summed over the decode workers)."""

    backlog_s_by_tier: Sequence[float]
    num_prefill_workers: int
    has_capacity_now: bool
    # Decode KV, all optional: without a release rate the decode wait is not predicted.
    kv_queued_blocks_by_tier: Sequence[int] = ()  # wanted by requests waiting for decode
    kv_held_blocks_by_tier: Sequence[int] = ()  # held by running requests
    kv_free_blocks: int = 0
    kv_release_blocks_per_s: float | None = None
    block_size: int = 16


def kv_release_rate(held: Iterable[tuple[int, int]], decode_token_s: float) -> float | None:
    """Blocks per second the running requests release, from (blocks, max new tokens)
    pairs: each frees its blocks once per max_new_tokens x decode_token_s."""
    rate = sum(b / max(n * decode_token_s, 1e-9) for b, n in held if b > 0)
    return rate if rate > 0 else None


class AdmissionController:
    def __init__(self, tiers: TierConfig, est: ServiceEstimate, tolerance: float = 1.0,
                 reject_tiers: frozenset[int] | None = None) -> None:
        """``reject_tiers``: tiers that may be rejected (default: every tier)."""
        if tolerance < 0:
            raise ValueError(f"tolerance: must be >= 0, got {tolerance}")
        self.tiers = tiers
        self.est = est
        self.tolerance = tolerance
        self.reject_tiers = (
            reject_tiers if reject_tiers is not None else frozenset(range(tiers.num_tiers))
        )

    def decide(self, req: Request, now: float, load: LoadSnapshot) -> AdmissionDecision:
        workers = max(load.num_prefill_workers, 1)
        backlog = load.backlog_s_by_tier
        t = req.tier
        # All the more urgent tiers' work runs first; of its own tier only what can still
        # meet a deadline (one window), since its hopeless requests are demoted behind it.
        ahead = (sum(backlog[:t]) + min(backlog[t] if t < len(backlog) else 0.0,
                                        self.tiers[t].deadline_s * workers)) / workers
        own = remaining_work_s(req, self.tiers, self.est)
        wait = max(ahead, self.kv_wait_s(req, load))
        predicted = wait + own
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
                                     predicted, retry_after_s=retry,
                                     sheds_tier=wait > budget * (1.0 + self.tolerance))
        return AdmissionDecision(AdmissionKind.QUEUE, AdmissionReason.FEASIBLE_LATER, predicted)

    def kv_wait_s(self, req: Request, load: LoadSnapshot) -> float:
        """Predicted wait for decode memory (0 when the snapshot has no release rate)."""
        rate = load.kv_release_blocks_per_s
        if not rate or not load.kv_queued_blocks_by_tier:
            return 0.0
        t = req.tier
        own = -(-(req.prompt_len + 1) // max(load.block_size, 1))
        queued = load.kv_queued_blocks_by_tier
        # Of its own tier, only what can still be served within one deadline window is
        # ahead of it (the hopeless rest is ordered behind it, DESIGN §5).
        same = queued[t] if t < len(queued) else 0
        need = sum(queued[:t]) + min(same, rate * self.tiers[t].deadline_s) + own
        # Tiers after this one can be preempted for it (swap, recompute or migrate).
        avail = load.kv_free_blocks + sum(load.kv_held_blocks_by_tier[t + 1:])
        return max(need - avail, 0) / rate


def should_preempt_now(need_blocks: int, free_blocks: int, one_round_blocks: int,
                       threshold: float) -> bool:
    """Preempt at once only if free + one eviction round covers ``threshold`` of the need."""
    if need_blocks <= 0:
        return False
    return free_blocks + one_round_blocks >= threshold * need_blocks
