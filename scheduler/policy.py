"""The scheduling policy: every decision the cluster or the simulator asks for.

A :class:`SchedulingPolicy` bundles the decisions of one scheduler design, each
a function of a snapshot returning a plan that the caller applies:

1. ``admit``: on arrival, accept / queue / reject (with retry-after).
2. ``place_prefill``: which prefill worker (prefix match + load).
3. ``order``: which waiting requests a worker runs first this step.
4. ``place_decode``: which decode worker reserves the request's blocks.
5. ``preempt_for``: a waiting request finds no decode memory: preempt now?
6. ``on_kv_pressure``: running requests need blocks the worker lacks: victims of tiers
   after the most urgent one that needs a block.
7. ``tick``: every control interval, the deadline watcher and fair share.
8. ``dispatch_horizon_s``: how much queued prefill work a worker may hold before the
   cluster scheduler keeps a request in its own queue (None: no limit).
9. ``compose_step``: a worker's next engine step (:mod:`scheduler.step_planner`): decodes,
   prefill chunks, KV-pressure victims, swap-ins.

:class:`TierservePolicy` is this project's design; the peer policies that
reproduce vLLM, SGLang and Dynamo live in :mod:`scheduler.peers`, and
:mod:`scheduler.policies` is the registry that builds any of them by name.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from scheduler.admission import (
    AdmissionController,
    AdmissionDecision,
    AdmissionKind,
    AdmissionReason,
    LoadSnapshot,
    should_preempt_now,
)
from scheduler.deadlines import DeadlineWatcher, ServiceEstimate, slack_s
from scheduler.fairshare import FairShareController, ShareLedger, TailTracker
from scheduler.links import LinkPricer
from scheduler.ordering import (
    DEFAULT_ORDERING,
    OrderingPolicy,
    SlackPolicy,
    WfqPolicy,
    make_ordering,
)
from scheduler.placement import (
    DecodeChoice,
    DecodeView,
    PrefillView,
    choose_decode,
    choose_prefill,
)
from scheduler.preemption import (
    PreemptionPlan,
    PreemptMode,
    Victim,
    VictimScorer,
    VictimView,
    choose_victims,
)
from scheduler.queues import HeapQueue, SlackQueue, SortedQueue, WaitQueue
from scheduler.request import Request
from scheduler.reserves import DemandMeter, UrgentDemand, decode_reserve
from scheduler.step_planner import (
    MIN_CHUNK_TOKENS,
    StepPlan,
    StepView,
    compose_budget_step,
    compose_slo_step,
    is_started,
)
from scheduler.tiers import TierConfig
from scheduler.topology import WorkerInfo


@dataclass(frozen=True, slots=True)
class PolicyContext:
    tiers: TierConfig
    est: ServiceEstimate
    costs: LinkPricer  # LinkCosts (priors) or a LinkModel the workers' measurements refine
    block_size: int = 16


class SchedulingPolicy:
    """Defaults: accept everything, least-loaded placement, arrival order, no preemption."""

    name = "base"
    # The frozen dataclass of settings the policy takes (``NAME:key=value``,
    # scheduler.policy_spec); None: none. Its constructor takes (ctx, settings).
    settings_cls: ClassVar[type | None] = None
    respects_anti_thrash = True
    # Whether ``admit`` reads the load snapshot's backlog and decode memory (building them
    # walks every queued and running request; a policy that only asks whether there is
    # room now gets a snapshot without them).
    reads_load = False
    # Whether every selection keeps the tier order (DESIGN §5: a hopeless request is never
    # ordered behind a less urgent tier's feasible work; scheduler.invariants.check_tier_order).
    keeps_tier_order = False

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.tiers = ctx.tiers
        self.shares: tuple[float, ...] = ctx.tiers.shares()

    def admit(self, req: Request, now: float, load: LoadSnapshot) -> AdmissionDecision:
        kind = AdmissionKind.ACCEPT if load.has_capacity_now else AdmissionKind.QUEUE
        reason = (AdmissionReason.CAPACITY_NOW if load.has_capacity_now
                  else AdmissionReason.FEASIBLE_LATER)
        return AdmissionDecision(kind, reason, 0.0)

    def place_prefill(self, req: Request, views: Sequence[PrefillView]) -> PrefillView | None:
        return min(views, key=lambda v: v.backlog_s, default=None)

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        return sorted(reqs, key=lambda r: r.arrival_time)

    def make_queue(self) -> WaitQueue:
        """A wait queue that hands out requests in this policy's order (started prefills
        first, as vLLM v1 schedules its running requests before its waiting ones)."""
        return HeapQueue(key=lambda r: (not is_started(r), r.arrival_time))

    def dispatch_horizon_s(self, req: Request) -> float | None:
        """Queued prefill work (s) past which a worker gets no more requests; None: send
        everything at once (the engine's own queue orders it, as in vLLM)."""
        return None

    def compose_step(self, view: StepView) -> StepPlan:
        """A worker's next engine step; default: vLLM v1's token budget."""
        return compose_budget_step(view, self)

    # Whether a request that cannot run now (no decode memory) lets later ones pass.
    skips_blocked = False

    def prefill_step_tokens(self, default: int) -> int:
        """Token budget of one prefill step (the engine's configured chunk by default)."""
        return default

    def prefill_step_seconds(self) -> float | None:
        """Time budget of one prefill step (long contexts cost more per token); None: none."""
        return None

    def place_decode(self, req: Request, need_blocks: int, views: Sequence[DecodeView],
                     prefill: WorkerInfo) -> DecodeChoice | None:
        return choose_decode(need_blocks, views, prefill, self.ctx.costs, min_headroom=0.0)

    # Whether ``place_decode`` places a request on any worker whose free blocks less
    # ``decode_reserve`` hold it, and the queue offers every waiting request (no head-of-
    # line stop): the work-conservation invariant binds only such a policy (vLLM's
    # waiting loop stops at its first request that does not fit, by design).
    work_conserving = False

    def decode_reserve(self, tier: int, view: DecodeView) -> int:
        """Blocks of ``view``'s worker a request of ``tier`` must leave free (none here)."""
        return 0

    # A migration target keeps at least this share of its blocks free after the move.
    MIGRATION_HEADROOM = 0.1

    def place_migration(self, req: Request, num_blocks: int, views: Sequence[DecodeView],
                        source: WorkerInfo) -> DecodeChoice | None:
        """Where a decoding request preempted on ``source`` may move with its KV (None:
        nowhere): the cheapest move to a worker that keeps MIGRATION_HEADROOM of its
        blocks free after it, so the move itself forces no preemption there. Not the
        tier reserve of ``place_decode``: that keeps room from new lower-tier work, and
        this request is already running."""
        ok = [v for v in views if v.num_free_blocks - num_blocks
              >= self.MIGRATION_HEADROOM * v.info.num_kv_blocks]
        return choose_decode(num_blocks, ok, source, self.ctx.costs, min_headroom=0.0)

    def preempt_for(self, req: Request, need_blocks: int, free_blocks: int,
                    candidates: Sequence[VictimView], now: float,
                    wait_s: float | None = None) -> PreemptionPlan | None:
        """Victims to preempt so waiting ``req`` gets ``need_blocks`` (None: it waits).
        ``wait_s``: the predicted seconds until the worker's finishing decodes free the
        shortfall by themselves (None: unknown, or never)."""
        return None

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        """Default: recompute the newest running requests until the need is met.

        ``requester_tier``: the most urgent tier among the running requests that need
        the blocks (a policy that honours tiers evicts only tiers after it)."""
        chosen = []
        freed = 0
        for v in sorted(candidates, key=lambda v: -v.req.arrival_time):
            if freed >= need_blocks:
                break
            chosen.append(Victim(v.req.req_id, PreemptMode.RECOMPUTE, v.num_blocks, 0.0))
            freed += v.num_blocks
        return PreemptionPlan(tuple(chosen), freed)

    def tick(self, now: float, waiting: Iterable[Request]) -> None:
        """Periodic control work (deadline watcher, fair share); none by default."""

    def record_demand(self, tier: int, tokens: int, now: float) -> None: ...

    def record_served(self, tier: int, tokens: int, work_s: float, now: float) -> None: ...

    def observe_latency(self, tier: int, latency_s: float, target_s: float) -> None: ...

    def protected_hashes(self, waiting: Iterable[Request]) -> Collection[int]:
        """Block hashes that prefix waiting requests worth keeping cached; none by default."""
        return ()


@dataclass(frozen=True, slots=True)
class TierserveSettings:
    """tierserve's mechanisms, each on by default; turning one off is an ablation (what
    that mechanism is worth, measured with the rest in place)."""

    # Ordering of every queue: slack (default), utility, wfq, or tier (strict priority:
    # the ablation of the slack ordering).
    ordering: str = DEFAULT_ORDERING
    # Steps sized to the tiers' targets (a prefill step within a quarter of the tightest
    # TTFT, the decode batch within the tightest TPOT); off: the engine's token budget
    # (vLLM's step).
    step_budget: bool = True
    # Feasibility admission and tier shedding; off: accept everything.
    admission: bool = True
    # Prefill by prefix hit and the work of as-urgent tiers ahead, decode in the prefill
    # worker's NVLink domain, leaving the reserve that the more urgent tiers' measured
    # arrivals and the running decodes' measured growth need (scheduler.reserves); off:
    # least queued prefill, most free decode blocks.
    placement: bool = True
    # Lower tiers wait in the cluster's queue beyond a few steps of queued work per
    # worker; off: every request goes to a worker at once.
    dispatch_horizon: bool = True
    # Victims restored by the cheapest of swap and recompute (migrate where a peer is
    # known); off: always recompute.
    preempt_modes: bool = True
    # Victims priced by tier weight x restore cost (topology); off: the design notes'
    # memory / progress score.
    topology_pricing: bool = True
    # Prefix blocks of waiting tier-0/1 requests are kept out of cache eviction; off:
    # plain LRU.
    reuse_eviction: bool = True
    # A waiting request below tier 0 preempts only once its slack no longer covers the
    # wait for the memory the running decodes release as they finish; off: as soon as it
    # finds no room.
    preempt_when_late: bool = True

    def __post_init__(self) -> None:
        from scheduler.ordering import ORDERING_POLICIES

        if self.ordering not in ORDERING_POLICIES:
            raise ValueError(f"ordering {self.ordering!r}: valid: "
                             f"{', '.join(sorted(ORDERING_POLICIES))}")


class TierservePolicy(SchedulingPolicy):
    """SLO tiers end to end: feasibility admission, prefix+load placement, slack (or
    the configured) ordering with fair-share deficits, domain-aware decode
    placement, conditional preemption priced by topology and restore cost. Each
    mechanism can be turned off (:class:`TierserveSettings`)."""

    name = "tierserve"
    settings_cls = TierserveSettings
    # Admit while the predicted milestone is within this fraction past the target: a
    # request that waits much longer misses anyway and only takes capacity from others.
    ADMISSION_TOLERANCE = 0.25
    # A waiting request holds off preempting while its slack is this many times the
    # predicted wait for released memory (a decode's release is an estimate from its
    # expected output, and the running decodes grow meanwhile).
    WAIT_MARGIN = 2.0

    def __init__(self, ctx: PolicyContext, settings: TierserveSettings | None = None
                 ) -> None:
        super().__init__(ctx)
        self.settings = s = settings or TierserveSettings()
        self.watcher = DeadlineWatcher(ctx.tiers)
        self.ordering: OrderingPolicy = make_ordering(s.ordering, ctx.tiers, ctx.est,
                                                      self.watcher)
        # Tier 0 is never turned away by a prediction: a false rejection is a certain miss
        # of the tier the cluster exists to protect (and it would shed every tier for a
        # window), while a tier-0 request queued past its deadline is served after the
        # feasible ones and may preempt every later tier. The later tiers are shed.
        self.admission = AdmissionController(
            ctx.tiers, ctx.est, tolerance=self.ADMISSION_TOLERANCE,
            reject_tiers=frozenset(range(1, ctx.tiers.num_tiers)))
        self.fair = FairShareController(ctx.tiers)
        self.ledger = ShareLedger(ctx.tiers.num_tiers)
        self.tails = TailTracker(ctx.tiers.num_tiers)
        self.scorer = VictimScorer.TOPOLOGY if s.topology_pricing else VictimScorer.DESIGN_NOTES
        self.modes = (frozenset(PreemptMode) if s.preempt_modes
                      else frozenset({PreemptMode.RECOMPUTE}))
        self.reads_load = s.admission
        # What arrives per tier, measured: the reserves placement keeps for the more
        # urgent tiers (scheduler.reserves), refreshed every control interval.
        self.demand = DemandMeter(ctx.tiers.num_tiers)
        self.urgent = UrgentDemand.none(ctx.tiers.num_tiers)
        ttfts = [t.ttft_s for t in ctx.tiers.tiers if t.ttft_s is not None]
        tightest = min(ttfts) if ttfts else min(t.deadline_s for t in ctx.tiers.tiers)
        # A step's share of the tightest TTFT: an arrival of that tier waits at most one
        # such step (compose_step also keeps a step at least twice its fixed cost, so
        # slow hardware does not spend half its time on step overhead).
        self._slo_step_s = self.STEP_FRACTION_OF_TTFT * tightest
        self._tpots = tuple(t.tpot_s for t in ctx.tiers.tiers)
        self._slo_step_tokens = self._step_tokens_within(self._slo_step_s)

    def admit(self, req: Request, now: float, load: LoadSnapshot) -> AdmissionDecision:
        if not self.settings.admission:
            return super().admit(req, now, load)
        return self.admission.decide(req, now, load)

    def place_prefill(self, req: Request, views: Sequence[PrefillView]) -> PrefillView | None:
        if not self.settings.placement:
            return super().place_prefill(req, views)
        # Slack ordering runs tiers roughly in order, so only the work of this and
        # more urgent tiers is ahead of the request.
        ahead = req.tier + 1 if isinstance(self.ordering, SlackPolicy) else None
        return choose_prefill(req.prompt_len, self.ctx.block_size, views, self.ctx.est, ahead)

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        return self.ordering.order(reqs, now)

    @property  # type: ignore[override]
    def keeps_tier_order(self) -> bool:
        """Only the slack ordering promises it (utility and WFQ rank hopeless work low)."""
        return isinstance(self.ordering, SlackPolicy)

    def make_queue(self) -> WaitQueue:
        if isinstance(self.ordering, SlackPolicy):
            return SlackQueue(self.ordering)
        return SortedQueue(self.ordering)

    # A worker holds at most this many steps' worth of queued prefill work of the tiers
    # after the tightest one; the rest waits where admission and ordering see all of it.
    DISPATCH_HORIZON_STEPS = 4

    def dispatch_horizon_s(self, req: Request) -> float | None:
        if req.tier == 0 or not self.settings.dispatch_horizon:
            return None  # the most urgent tier never waits for a dispatch
        return self.DISPATCH_HORIZON_STEPS * self._slo_step_s

    def compose_step(self, view: StepView) -> StepPlan:
        if not self.settings.step_budget:
            return compose_budget_step(view, self)
        fixed = view.costs.coefficients[0]
        cap = max(self._slo_step_s, 2 * fixed, view.costs.prefill_s(MIN_CHUNK_TOKENS, 0))
        return compose_slo_step(view, self, step_cap_s=cap, tpot_by_tier=self._tpots,
                                uncapped_tier=0)

    skips_blocked = True
    # A prefill step may take at most this fraction of the tightest TTFT target, so
    # an arrival of that tier waits at most one short step before it runs.
    STEP_FRACTION_OF_TTFT = 0.25

    def prefill_step_tokens(self, default: int) -> int:
        return min(default, self._slo_step_tokens)

    def prefill_step_seconds(self) -> float | None:
        return self._slo_step_s

    def _step_tokens_within(self, seconds: float) -> int:
        lo, hi = 256, 1 << 16
        if self.ctx.est.prefill_s(lo, 0) > seconds:
            return lo
        while hi - lo > 64:
            mid = (lo + hi) // 2
            if self.ctx.est.prefill_s(mid, 0) <= seconds:
                lo = mid
            else:
                hi = mid
        return lo

    def place_decode(self, req: Request, need_blocks: int, views: Sequence[DecodeView],
                     prefill: WorkerInfo) -> DecodeChoice | None:
        if not self.settings.placement:
            fits = [v for v in views if v.num_free_blocks >= need_blocks]
            best = max(fits, key=lambda v: v.num_free_blocks, default=None)
            return (None if best is None
                    else choose_decode(need_blocks, [best], prefill, self.ctx.costs, 0.0))
        # A request leaves free what the more urgent tiers' measured arrivals and the
        # running decodes' measured growth need (scheduler.reserves), nothing more.
        views_ok = [v for v in views
                    if v.num_free_blocks - need_blocks >= self.decode_reserve(req.tier, v)]
        return choose_decode(need_blocks, views_ok, prefill, self.ctx.costs, min_headroom=0.1)

    work_conserving = True

    def decode_reserve(self, tier: int, view: DecodeView) -> int:
        if not self.settings.placement:
            return 0
        return decode_reserve(tier, self.urgent, num_kv_blocks=view.info.num_kv_blocks,
                              release_blocks_per_s=view.release_blocks_per_s,
                              growth=(view.growth_blocks[tier]
                                      if tier < len(view.growth_blocks) else 0),
                              num_workers=view.num_workers,
                              min_window_s=self.tiers.control_interval_s)

    def _victims(self, need_blocks: int, candidates: Sequence[VictimView], now: float,
                 requester_tier: int) -> PreemptionPlan:
        return choose_victims(need_blocks, candidates, requester_tier=requester_tier, now=now,
                              tiers=self.tiers, costs=self.ctx.costs, est=self.ctx.est,
                              scorer=self.scorer, modes=self.modes)

    def preempt_for(self, req: Request, need_blocks: int, free_blocks: int,
                    candidates: Sequence[VictimView], now: float,
                    wait_s: float | None = None) -> PreemptionPlan | None:
        if (self.settings.preempt_when_late and wait_s is not None
                and req.tier > 0
                and slack_s(req, now, self.tiers, self.ctx.est) > self.WAIT_MARGIN * wait_s):
            # The memory comes back by itself before the request's deadline needs it: a
            # preemption now would only trade a victim's restore (and, for a recompute,
            # prefill work that competes with every first token) for time it can spare.
            # The most urgent tier preempts at once: the release is a guess, its miss is
            # not.
            return None
        plan = self._victims(max(need_blocks - free_blocks, 0), candidates, now, req.tier)
        threshold = self.tiers[req.tier].preempt_threshold
        if not plan.victims or not should_preempt_now(need_blocks, free_blocks, plan.num_freed,
                                                      threshold):
            return None
        return plan

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        # Only tiers after the most urgent grower's: evicting a more urgent request so a
        # less urgent one can grow would invert the tiers. Same-tier growth that finds no
        # victim falls back to the caller's stall or recompute of the last in order.
        return self._victims(need_blocks, candidates, now, requester_tier)

    def tick(self, now: float, waiting: Iterable[Request]) -> None:
        self.urgent = UrgentDemand.of(self.demand, now)
        if isinstance(self.ordering, WfqPolicy):  # only WFQ reads the boost marks
            self.watcher.tick(now, waiting)
        ratios = [self.tails.p99_ratio(t) for t in range(self.tiers.num_tiers)]
        new = self.fair.update(now, ratios)
        if new is not None:
            self.shares = new
            self.ordering.set_shares(new)
        self.ordering.deficit_tiers = self.ledger.deficit_tiers(self.shares, now)

    def record_demand(self, tier: int, tokens: int, now: float) -> None:
        self.ledger.record_demand(tier, tokens, now)
        self.demand.record(tier, -(-tokens // self.ctx.block_size), now)

    def record_served(self, tier: int, tokens: int, work_s: float, now: float) -> None:
        self.ledger.record_served(tier, tokens, now)
        self.ordering.on_served(tier, work_s)

    def observe_latency(self, tier: int, latency_s: float, target_s: float) -> None:
        self.tails.observe(tier, latency_s, target_s)

    def protected_hashes(self, waiting: Iterable[Request]) -> Collection[int]:
        if not self.settings.reuse_eviction:
            return ()
        out: set[int] = set()
        for r in waiting:
            if r.tier <= 1:
                out.update(r.block_hashes)
        return out
