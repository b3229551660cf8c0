"""The hard invariants (DESIGN §7) as pure checks that return violations as values.

Each check reads a snapshot (block accounts, decision records, shares,
requests) and returns a list of :class:`Violation`; an empty list means the
invariant holds. The simulator runs them as it goes, and ``tierserve check``
runs them over every explored state. Nothing here raises on a violation.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from scheduler.deadlines import last_progress_time
from scheduler.kv import KVBlockAccount
from scheduler.request import ALLOWED_TRANSITIONS, DecisionRecord, Request, RequestState
from scheduler.tiers import TierConfig


class Invariant(enum.Enum):
    KV_BUDGET = "kv_budget"
    LEGAL_TRANSITIONS = "legal_transitions"
    SHARES_SUM = "shares_sum"
    ANTI_THRASH = "anti_thrash"
    STARVATION = "starvation"


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


def check_starvation(reqs: Iterable[Request], now: float, tiers: TierConfig) -> list[Violation]:
    """No waiting request has gone longer than its tier's bound without progress."""
    out = []
    for r in reqs:
        if r.state not in _WAITING:
            continue
        waited = now - last_progress_time(r)
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


def count_by_invariant(violations: Iterable[Violation]) -> dict[str, int]:
    counts = {inv.value: 0 for inv in Invariant}
    for v in violations:
        counts[v.invariant.value] += 1
    return counts
