"""Ordering policies: which requests a worker runs first (chosen by name).

A policy turns a snapshot (the requests waiting on one queue, the time) into an
order; the caller runs requests in that order until its step budget is full,
so a request placed last never blocks one placed before it. Four policies:

- ``utility`` (the design notes): U = max(0, 1 - elapsed/D) x weight(tier) x
  state_penalty (running 1.0, preempted 0.6, evicted 0.3), highest first. U
  falls as a request nears its deadline: the opposite of a deadline boost.
- ``slack`` (the default, best in the simulator: see scheduler/RESULTS.md):
  slack = deadline - now - predicted remaining work. A request whose slack is
  negative can no longer make its deadline: it is demoted behind every feasible
  request, so it never blocks others, and is served by tier, then started
  prefills, then longest waiting. Feasible requests run by deadline less a
  credit of ``URGENCY_CREDIT_S`` x weight(tier) (``WORK_WEIGHT`` = 1: equal
  deadlines go shortest work first, which is what maximises the requests that
  meet a shared deadline in a burst; ``WORK_WEIGHT`` = 0 gives least-laxity
  first). The credit keeps a fresh tier-0 request from being starved by
  lower-tier requests that are merely closer to their looser deadlines. None of
  these keys depends on ``now``, so a worker keeps them in heaps
  (:class:`scheduler.queues.SlackQueue`); only the feasible/hopeless split
  moves with time.
- ``tier``: strict priority, tier then arrival (the peers' priority queues; the
  ablation of ``slack``).
- ``wfq``: weighted fair queueing across tiers with dynamic weights. A tier's
  weight is its share divided by its SLO headroom ratio r = (remaining SLO time /
  predicted remaining work) of its most urgent request, so a tier closing on its
  deadlines gets more; a request that has used ``boost_fraction`` (0.7) of its
  deadline is boosted ahead of the fair order (the :class:`DeadlineWatcher`
  marks it every control interval).

Every policy puts first a request that has waited without progress for half its
tier's ``max_starvation_s`` (the starvation guard behind the bounded-starvation
invariant); ``slack`` lets feasible tier-0 requests go even before those
(``GUARD_YIELDS_TO_TIERS``), which under 160 % overload kept tier 0 at 99.6 %
instead of 94 % with no starvation violation. Tiers the fair-share ledger reports below their guaranteed share
(``deficit_tiers``) are favoured: ``utility`` and ``wfq`` put their requests
first; ``slack`` puts their hopeless ones first among the hopeless (and, with
``DEFICIT_FEASIBLE_FIRST``, their feasible ones right after feasible tier 0 and
the starving).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Sequence

from scheduler.deadlines import (
    DeadlineWatcher,
    ServiceEstimate,
    deadline,
    last_progress_time,
    remaining_work_s,
)
from scheduler.request import Request, RequestState
from scheduler.tiers import TierConfig

STARVATION_GUARD_FRACTION = 0.5


def hopeless_key(req: Request) -> tuple[bool, float]:
    """Within a tier's hopeless requests: started prefills first (finish work begun),
    then longest without progress first (which is also what the starvation guard reads)."""
    return (req.state is not RequestState.PREFILLING, last_progress_time(req))


class OrderingKind(enum.Enum):
    UTILITY = "utility"
    SLACK = "slack"
    WFQ = "wfq"
    TIER = "tier"


class UnknownPolicy(ValueError):
    """A policy name not in a registry; the message lists the valid names."""


def _penalty(req: Request) -> float:
    if req.state is RequestState.PREEMPTED:
        # Evicted (blocks dropped, recompute) weighs less than swapped out.
        return 0.3 if req.num_computed_tokens == 0 else 0.6
    return 1.0


class OrderingPolicy:
    """Base: the starvation guard and the share-deficit tier set."""

    kind: OrderingKind
    deficit_first = True  # serve deficit tiers' requests before all others

    def __init__(self, tiers: TierConfig, est: ServiceEstimate,
                 watcher: DeadlineWatcher | None = None) -> None:
        self.tiers = tiers
        self.est = est
        self.watcher = watcher or DeadlineWatcher(tiers)
        self.deficit_tiers: frozenset[int] = frozenset()
        self.shares: tuple[float, ...] = tiers.shares()
        self._guard = [STARVATION_GUARD_FRACTION * t.max_starvation_s for t in tiers.tiers]

    def is_starving(self, req: Request, now: float) -> bool:
        return now - last_progress_time(req) > self._guard[req.tier]

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        guard = [r for r in reqs if self.is_starving(r, now)]
        if guard:
            guard.sort(key=lambda r: r.arrival_time)
            ids = {r.req_id for r in guard}
            rest = [r for r in reqs if r.req_id not in ids]
        else:
            rest = list(reqs)
        if self.deficit_tiers and self.deficit_first:
            first = [r for r in rest if r.tier in self.deficit_tiers]
            later = [r for r in rest if r.tier not in self.deficit_tiers]
            return guard + self._order(first, now) + self._order(later, now)
        return guard + self._order(rest, now)

    def _order(self, reqs: list[Request], now: float) -> list[Request]:
        raise TypeError(f"{type(self).__name__} must implement _order")

    def on_served(self, tier: int, work_s: float) -> None:
        """Tell the policy ``work_s`` seconds of service went to ``tier``."""

    def set_shares(self, shares: Sequence[float]) -> None:
        self.shares = tuple(shares)


class UtilityPolicy(OrderingPolicy):
    kind = OrderingKind.UTILITY

    def utility(self, req: Request, now: float) -> float:
        spec = self.tiers[req.tier]
        d = spec.deadline_s
        return max(0.0, 1.0 - (now - req.arrival_time) / d) * spec.weight * _penalty(req)

    def _order(self, reqs: list[Request], now: float) -> list[Request]:
        return sorted(reqs, key=lambda r: (-self.utility(r, now), r.arrival_time))


class SlackPolicy(OrderingPolicy):
    kind = OrderingKind.SLACK
    deficit_first = False
    URGENCY_CREDIT_S = 0.25  # seconds of slack credited per unit of tier weight

    # Order key = latest start + WORK_WEIGHT x work = deadline - (1 - WORK_WEIGHT) x work:
    # 0 is least-laxity first; 1 is earliest deadline first with shorter work
    # breaking ties (what maximises the requests that meet a shared deadline in a burst).
    WORK_WEIGHT = 1.0

    def latest_start(self, req: Request) -> float:
        """deadline - predicted work: slack = latest_start - now."""
        return deadline(req, self.tiers) - remaining_work_s(req, self.tiers, self.est)

    def order_key(self, req: Request) -> tuple[float, float, float]:
        """(key, work, latest start); none depends on ``now``."""
        work = remaining_work_s(req, self.tiers, self.est)
        dl = deadline(req, self.tiers)
        return dl - (1.0 - self.WORK_WEIGHT) * work, work, dl - work

    # Feasible requests of tiers below this one run even before starving requests:
    # tier 0's share is small, so the starving still progress, and under overload
    # the guard would otherwise hand the latency-critical tier's deadlines away.
    GUARD_YIELDS_TO_TIERS = 1
    # Serve the feasible requests of tiers below their guaranteed token share
    # before other feasible work. Off by default: at 160 % load on the Azure trace
    # it lifts tier 3's token share while arrivals last from 0.8 % to 8.7 % (its
    # entitlement is 10 %) but costs 13 % of goodput (RESULTS.md); every request
    # still meets the bounded-starvation invariant either way.
    DEFICIT_FEASIBLE_FIRST = False

    def credit(self, tier: int) -> float:
        return self.URGENCY_CREDIT_S * self.tiers[tier].weight

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        """Feasible tier 0, starving, feasible of deficit tiers, other feasible, hopeless;
        a hopeless request is never behind a feasible one of a less urgent tier."""
        guard = sorted((r for r in reqs if self.is_starving(r, now)),
                       key=lambda r: r.arrival_time)
        ids = {r.req_id for r in guard}
        feasible, hopeless = self._split([r for r in reqs if r.req_id not in ids], now)
        top = self.GUARD_YIELDS_TO_TIERS
        deficit = self.deficit_tiers
        if not self.DEFICIT_FEASIBLE_FIRST:
            deficit = frozenset()
        head = [r for r in feasible if r.tier < top]
        owed = [r for r in feasible if r.tier >= top and r.tier in deficit]
        other = [r for r in feasible if r.tier >= top and r.tier not in deficit]
        return head + guard + no_inversion(owed + other, hopeless)

    def _split(self, reqs: list[Request], now: float) -> tuple[list[Request], list[Request]]:
        keyed = [(self.order_key(r), r) for r in reqs]
        feasible = [((k[0] - self.credit(r.tier), k[1], r.arrival_time), r)
                    for k, r in keyed if k[2] >= now]
        hopeless = [r for k, r in keyed if k[2] < now]
        feasible.sort(key=lambda kr: kr[0])
        deficit = self.deficit_tiers
        hopeless.sort(key=lambda r: (r.tier not in deficit, r.tier) + hopeless_key(r))
        return [r for _, r in feasible], hopeless

    def _order(self, reqs: list[Request], now: float) -> list[Request]:
        feasible, hopeless = self._split(reqs, now)
        return no_inversion(feasible, hopeless)


def no_inversion(feasible: list[Request], hopeless: list[Request]) -> list[Request]:
    """``feasible`` in order, with each hopeless request (``hopeless`` in order) moved
    ahead of the first feasible request of a less urgent tier (DESIGN §5)."""
    out: list[Request] = []
    pending = list(hopeless)
    low = min((h.tier for h in pending), default=None)
    for r in feasible:
        if low is not None and low < r.tier:
            out.extend(sorted((h for h in pending if h.tier < r.tier), key=lambda h: h.tier))
            pending = [h for h in pending if h.tier >= r.tier]
            low = min((h.tier for h in pending), default=None)
        out.append(r)
    return out + pending


class WfqPolicy(OrderingPolicy):
    kind = OrderingKind.WFQ
    MIN_RATIO = 0.05

    def __init__(self, tiers: TierConfig, est: ServiceEstimate,
                 watcher: DeadlineWatcher | None = None) -> None:
        super().__init__(tiers, est, watcher)
        # Virtual service received per tier, in seconds / weight.
        self.vtime = [0.0] * tiers.num_tiers

    def on_served(self, tier: int, work_s: float) -> None:
        self.vtime[tier] += work_s / max(self.shares[tier], 1e-3)

    def tier_weights(self, by_tier: dict[int, list[Request]], now: float) -> dict[int, float]:
        out = {}
        for t, rs in by_tier.items():
            head = rs[0]
            remaining = deadline(head, self.tiers) - now
            work = max(remaining_work_s(head, self.tiers, self.est), 1e-6)
            ratio = max(remaining / work, self.MIN_RATIO)
            out[t] = max(self.shares[t], 1e-3) / ratio
        return out

    def _order(self, reqs: list[Request], now: float) -> list[Request]:
        boosted = [r for r in reqs if self.watcher.is_boosted(r)]
        boosted.sort(key=lambda r: deadline(r, self.tiers))
        by_tier: dict[int, list[Request]] = {}
        for r in reqs:
            if not self.watcher.is_boosted(r):
                by_tier.setdefault(r.tier, []).append(r)
        for rs in by_tier.values():
            rs.sort(key=lambda r: r.arrival_time)
        if not by_tier:
            return boosted
        weights = self.tier_weights(by_tier, now)
        base = min(self.vtime[t] for t in by_tier)
        heap: list[tuple[float, int, int]] = []
        tags = {t: self.vtime[t] - base for t in by_tier}
        for t, rs in by_tier.items():
            w = remaining_work_s(rs[0], self.tiers, self.est)
            heapq.heappush(heap, (tags[t] + w / weights[t], t, 0))
        out = boosted
        while heap:
            tag, t, i = heapq.heappop(heap)
            out.append(by_tier[t][i])
            if i + 1 < len(by_tier[t]):
                nxt = by_tier[t][i + 1]
                w = remaining_work_s(nxt, self.tiers, self.est)
                heapq.heappush(heap, (tag + w / weights[t], t, i + 1))
        return out


class TierPolicy(OrderingPolicy):
    """Strict priority: tier, then arrival (what vLLM's and SGLang's priority queues do);
    the ablation of the slack ordering."""

    kind = OrderingKind.TIER
    deficit_first = False

    def _order(self, reqs: list[Request], now: float) -> list[Request]:
        return sorted(reqs, key=lambda r: (r.tier, r.arrival_time))


ORDERING_POLICIES: dict[str, type[OrderingPolicy]] = {
    OrderingKind.UTILITY.value: UtilityPolicy,
    OrderingKind.SLACK.value: SlackPolicy,
    OrderingKind.WFQ.value: WfqPolicy,
    OrderingKind.TIER.value: TierPolicy,
}
DEFAULT_ORDERING = OrderingKind.SLACK.value


def make_ordering(name: str, tiers: TierConfig, est: ServiceEstimate,
                  watcher: DeadlineWatcher | None = None) -> OrderingPolicy:
    cls = ORDERING_POLICIES.get(name)
    if cls is None:
        raise UnknownPolicy(
            f"unknown ordering policy {name!r}; valid: {', '.join(sorted(ORDERING_POLICIES))}"
        )
    return cls(tiers, est, watcher)
