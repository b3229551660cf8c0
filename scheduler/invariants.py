"""The hard invariants (DESIGN §7) as pure checks that return violations as values.

Each check reads a snapshot (block accounts, decision records, shares,
requests, a selection of work) and returns a list of :class:`Violation`; an empty
list means the invariant holds. The simulator runs them as it goes, and
``tierserve check`` runs them over every explored state. Nothing here raises on a
violation.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from scheduler.deadlines import ServiceEstimate, last_progress_time, slack_s
from scheduler.kv import KVBlockAccount
from scheduler.ordering import STARVATION_GUARD_FRACTION
from scheduler.queues import Pick, Verdict
from scheduler.request import ALLOWED_TRANSITIONS, DecisionRecord, Request, RequestState
from scheduler.tiers import TierConfig


class Invariant(enum.Enum):
    KV_BUDGET = "kv_budget"
    LEGAL_TRANSITIONS = "legal_transitions"
    SHARES_SUM = "shares_sum"
    ANTI_THRASH = "anti_thrash"
    STARVATION = "starvation"
    TIER_INVERSION = "tier_inversion"
    WORK_CONSERVATION = "work_conservation"


HARD_INVARIANTS = tuple(Invariant)
_WAITING = frozenset({RequestState.QUEUED, RequestState.PREEMPTED})


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: Invariant
    detail: str


def check_kv_budget(accounts: Iterable[KVBlockAccount]) -> list[Violation]:
    out = []
    for a in accounts:
        owned = sum(a.owned.values())
        if owned != a.num_owned or any(n < 0 for n in a.owned.values()):
            out.append(Violation(Invariant.KV_BUDGET,
                                 f"{a.worker_id}: owned blocks {owned} != counted {a.num_owned}"))
        if a.num_cached < 0 or a.num_owned + a.num_cached > a.num_total_blocks:
            out.append(Violation(
                Invariant.KV_BUDGET,
                f"{a.worker_id}: {a.num_owned} owned + {a.num_cached} cached > "
                f"{a.num_total_blocks} blocks",
            ))
    return out


def check_transitions(records: Iterable[DecisionRecord]) -> list[Violation]:
    """Every move is in the table, and each request's moves chain up."""
    out = []
    last: dict[str, RequestState] = {}
    for r in records:
        if r.to_state not in ALLOWED_TRANSITIONS[r.from_state]:
            out.append(Violation(Invariant.LEGAL_TRANSITIONS,
                                 f"{r.req_id}: {r.from_state.value} -> {r.to_state.value}"))
        prev = last.get(r.req_id)
        if prev is not None and prev is not r.from_state:
            out.append(Violation(Invariant.LEGAL_TRANSITIONS,
                                 f"{r.req_id}: left {r.from_state.value} but was {prev.value}"))
        last[r.req_id] = r.to_state
    return out


def check_shares(shares: Sequence[float], tol: float = 1e-6) -> list[Violation]:
    out = []
    if abs(sum(shares) - 1.0) > tol:
        out.append(Violation(Invariant.SHARES_SUM, f"shares sum to {sum(shares):.9f}"))
    for i, s in enumerate(shares):
        if not 0.0 <= s <= 1.0 + tol:
            out.append(Violation(Invariant.SHARES_SUM, f"share of tier {i} is {s}"))
    return out


def preemption_times(records: Iterable[DecisionRecord]) -> dict[str, list[float]]:
    """When each request was preempted (entering PREEMPTING, or PREEMPTED directly)."""
    out: dict[str, list[float]] = {}
    for r in records:
        if r.to_state is RequestState.PREEMPTING or (
            r.to_state is RequestState.PREEMPTED and r.from_state is not RequestState.PREEMPTING
        ):
            out.setdefault(r.req_id, []).append(r.time)
    return out


def check_anti_thrash(records: Iterable[DecisionRecord], window_s: float) -> list[Violation]:
    out = []
    for req_id, times in preemption_times(records).items():
        times.sort()
        for a, b in zip(times, times[1:], strict=False):
            if b - a < window_s - 1e-9:
                out.append(Violation(Invariant.ANTI_THRASH,
                                     f"{req_id}: preempted at {a:.3f} and {b:.3f}"))
    return out


def check_starvation(reqs: Iterable[Request], now: float, tiers: TierConfig,
                     submitted: Mapping[str, float] | None = None) -> list[Violation]:
    """No waiting request has gone longer than its tier's bound without progress.

    ``submitted``: per request id, when it was submitted, where that is later than its
    arrival (a router's retry keeps the arrival time, and so the deadline, of the
    request it retries); its wait counts from then."""
    out = []
    for r in reqs:
        if r.state not in _WAITING:
            continue
        since = last_progress_time(r)
        if submitted is not None:
            since = max(since, submitted.get(r.req_id, since))
        waited = now - since
        bound = tiers[r.tier].max_starvation_s
        if waited > bound:
            out.append(Violation(Invariant.STARVATION,
                                 f"{r.req_id} (tier {r.tier}) waited {waited:.3f}s > {bound}s"))
    return out


def check_starvation_history(reqs: Iterable[Request], tiers: TierConfig,
                             end_time: float) -> list[Violation]:
    """Replay each request's records: no waiting spell (queued or preempted) beat its bound."""
    out = []
    for r in reqs:
        bound = tiers[r.tier].max_starvation_s
        since: float | None = r.arrival_time
        for rec in r.history:
            if since is not None and rec.time - since > bound:
                out.append(Violation(Invariant.STARVATION,
                                     f"{r.req_id} (tier {r.tier}) waited {rec.time - since:.3f}s "
                                     f"> {bound}s before {rec.to_state.value}"))
            since = rec.time if rec.to_state in _WAITING else None
        if since is not None and not r.state.is_finished and end_time - since > bound:
            out.append(Violation(Invariant.STARVATION,
                                 f"{r.req_id} (tier {r.tier}) still waiting after "
                                 f"{end_time - since:.3f}s > {bound}s"))
    return out


# Slack within this of zero is not judged either way (float noise at the boundary).
SLACK_TOLERANCE_S = 1e-9


def is_starving(req: Request, now: float, tiers: TierConfig) -> bool:
    """The starvation guard's test (:mod:`scheduler.ordering`): no state change for more
    than ``STARVATION_GUARD_FRACTION`` of the tier's ``max_starvation_s``."""
    return now - last_progress_time(req) > STARVATION_GUARD_FRACTION * tiers[req.tier].max_starvation_s


def check_work_conservation(unplaced: Iterable[tuple[Request, str]]) -> list[Violation]:
    """Right after a plan, no waiting request fits a decode worker (free blocks, less what
    more urgent waiting requests claim there and the policy's reserve, with a prefill site
    within the dispatch horizon) and was left waiting: ``unplaced`` is
    ``ClusterScheduler.unplaced_fits()`` (issue 22: a worker with free KV while a request
    that fits waits is a bug, not a policy choice)."""
    return [Violation(Invariant.WORK_CONSERVATION,
                      f"{r.req_id} (tier {r.tier}) fits {wid} and was not placed")
            for r, wid in unplaced]


def check_tier_order(pick: Pick, tiers: TierConfig, est: ServiceEstimate) -> list[Violation]:
    """No tier inversion in one selection of work (DESIGN §5).

    A pick (:class:`scheduler.queues.Pick`) is one decision that chose work from one set
    of candidates: a global dispatch in ``ClusterScheduler.plan`` (its wait queue), or in a
    worker's ``StepPlan`` the prefill chunks (its wait queue), the decode batch, the growers
    that get a block under KV pressure, or the swap-ins (its running / swapped requests).
    At the pick's time ``now``, with ``slack = scheduler.deadlines.slack_s(req, now, tiers,
    est)`` (``est`` the policy's estimate), a candidate is *hopeless* when slack < 0 and
    *feasible* when slack >= 0 (within ``SLACK_TOLERANCE_S`` of 0: neither).

    The invariant: for every candidate ``f`` the pick took (``Verdict.TAKE``) that is
    feasible, every hopeless candidate ``h`` of a more urgent tier (``h.tier < f.tier``)
    was considered before ``f`` was taken. Considered means offered to the decision,
    which then took it or answered that it had no room for it now (SKIP: no decode
    blocks, no KV block to grow into, no room in the step's time or sequence budget;
    STOP: the step was full). So a violation is exactly: ``h`` was waiting in the same
    queue, could have been picked instead (nothing had said it had no room), and was
    passed over, ordered behind less urgent work that still had slack. Only its own
    decision can say whether ``h`` had room, so a request the order puts behind ``f``
    counts as passed over whatever its size.

    The one exception is the starvation guard: ``f`` may be taken first when it is
    starving (:func:`is_starving`: no state change for more than
    ``STARVATION_GUARD_FRACTION`` = half its tier's ``max_starvation_s``). That bypass is
    bounded: a request becomes starving only after half its bound without a state
    change, the guard serves starving requests longest-waiting first, and the
    bounded-starvation invariant caps its wait at the whole bound; once it changes state
    (dispatched, prefilled, resumed) it stops being starving. A request that stays in one
    state while it progresses (a long prefill in chunks, a decode) keeps the exemption for
    that stretch, which its remaining work bounds.
    """
    now = pick.now
    slack: dict[str, float] = {}
    hopeless_tiers: dict[str, int] = {}
    candidates = [r for r, _ in pick.offers] + list(pick.rest)
    for r in candidates:
        s = slack_s(r, now, tiers, est)
        slack[r.req_id] = s
        if s < -SLACK_TOLERANCE_S:
            hopeless_tiers[r.req_id] = r.tier
    if not hopeless_tiers:
        return []
    out = []
    waiting = dict(hopeless_tiers)  # hopeless candidates not yet considered
    for r, verdict in pick.offers:
        waiting.pop(r.req_id, None)
        if verdict is not Verdict.TAKE or slack[r.req_id] < SLACK_TOLERANCE_S or not waiting:
            continue
        if min(waiting.values()) >= r.tier or is_starving(r, now, tiers):
            continue
        h = next(c for c in candidates if waiting.get(c.req_id, r.tier) < r.tier)
        where = pick.worker_id or "global"
        out.append(Violation(Invariant.TIER_INVERSION,
                             f"{pick.site.value}@{where} t={now:.3f}: {r.req_id} (tier {r.tier}, "
                             f"slack {slack[r.req_id]:.3f}s) taken before {h.req_id} "
                             f"(tier {h.tier}, slack {slack[h.req_id]:.3f}s)"))
        break  # one violation per pick is enough to explain it
    return out


def count_by_invariant(violations: Iterable[Violation]) -> dict[str, int]:
    counts = {inv.value: 0 for inv in Invariant}
    for v in violations:
        counts[v.invariant.value] += 1
    return counts
