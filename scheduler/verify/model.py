"""A small cluster moved by events, over the real drivers: the model both checkers explore.

A :class:`World` is a serving cluster in miniature, decided by the objects that serve:
one :class:`~scheduler.cluster_scheduler.ClusterScheduler` (the global scheduler actor's
object, in ``PoolMode.AGGREGATED``: each of ``num_workers`` workers prefills and decodes)
and one :class:`~scheduler.worker_core.DecodeCore` per worker (the live decode worker's:
its request table and stages, its :class:`~scheduler.step_planner.WorkerScheduler`, what
a preemption comes to, who ends), over its own copy of each request, all on one
scheduling policy (``scheduler.policies.make_policy`` or an injected one). Every decision
is theirs; the world only does what the actor and the workers' engines do with them: it
answers dispatches (the blocks reserved in a :class:`KVBlockAccount`, the prompt's cached
prefix pinned in a :class:`PrefixIndex`), runs each worker's step plan (releases its
victims' blocks, swaps in, allocates blocks for chunks and growth, commits), and reports
what happened as
typed :class:`~scheduler.messages.WorkerReport` s (events, free blocks, running requests,
prefix-cache events). Events, on a clock of ``dt_s`` per tick:

1. ARRIVE(shape): ``ClusterScheduler.submit``: admitted into its queue, or rejected.
2. PLAN: ``ClusterScheduler.plan``; its aborts, preemptions for an arrival and dispatches
   are applied on the workers (a preemption for a worker whose step is running waits
   for the step to end) and the dispatch answers fed back. Due after anything that may
   change the plan (an admission, a tick or a stop with requests waiting, a failure),
   until it runs.
3. STEP(w): worker ``w`` starts its engine step for this tick: ``WorkerScheduler.plan``
   (victims of KV pressure evicted and reported, blocks allocated for growth, swap-ins
   and recomputes); once per tick for each worker with work, in any order with the
   arrivals and plans (a request dispatched after its worker stepped waits a step).
4. TICK: every running step ends (committed: ``tokens_per_tick`` decode iterations a
   step, ``num_decode_steps``; finished requests release their blocks; the preemptions
   that waited are applied) and is reported, then the clock advances. It waits for every
   worker with work to have stepped and for a due plan (no adversarial idling).
5. STOP(r): a decoding request emits its stop token early (seen at the start of a tick,
   the decode iteration that produced it; several stops in one tick commute, so they
   are taken in request order).
6. FAIL(w): worker ``w`` dies and an empty one replaces it (``remove_worker`` ends the
   requests it held with ``worker_failed``; ``add_worker`` brings the replacement), at
   the start of a tick or once nothing is due before the tick (its running step is lost
   with it). With ``scope.retries`` the next plan's abort orders tell the routers, which
   retry each request as the cluster backend does: a new request ``<id>-r<n>`` with the
   original arrival time and tier, its prompt extended by the tokens already streamed,
   for the tokens left.

After every event :meth:`World.check` runs the hard invariants of
:mod:`scheduler.invariants`: KV budget and block ownership (every owned block belongs
to a live request on that worker, every request that holds blocks by its state has
them, pinned prefix entries stay), legal and chained transitions, shares, anti-thrash,
starvation (when the clock moved), work conservation after every plan (a policy that
claims ``work_conserving`` leaves no waiting request that fits a worker), and the tier
order of every selection the event's
decisions made (the drivers' ``on_pick``): a violation for a policy that
``keeps_tier_order``, counted in ``num_tier_inversions`` for one that does not.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.cluster_scheduler import (
    ClusterScheduler,
    DispatchOrder,
    NewRequest,
    Plan,
    PoolMode,
    PreemptOrder,
)
from scheduler.deadlines import LinearEstimate
from scheduler.invariants import (
    Invariant,
    Violation,
    check_anti_thrash,
    check_kv_budget,
    check_shares,
    check_starvation,
    check_tier_order,
    check_transitions,
    check_work_conservation,
)
from scheduler.kv import KVBlockAccount
from scheduler.kv_ledger import KVCounters
from scheduler.messages import BlockEvent, RunningReq, WorkerEvent, WorkerReport
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptMode
from scheduler.prefix_index import PrefixIndex
from scheduler.queues import Pick
from scheduler.request import Decision, DecisionRecord, Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import StepPlan, WorkerScheduler, decode_tokens
from scheduler.testing import make_costs
from scheduler.tiers import TierConfig
from scheduler.topology import WorkerInfo, WorkerRole
from scheduler.verify.scope import Scope, Shape, scope_tiers
from scheduler.verify.snapshot import fingerprint, state_copy
from scheduler.worker_core import DecodeCore, StepResult, eviction_order

PolicyFactory = Callable[[PolicyContext], SchedulingPolicy]
AccountFactory = Callable[[str, int], KVBlockAccount]

S = RequestState
E = WorkerEvent
# Tuples, not sets: membership by identity is much cheaper than Enum.__hash__.
_WAITING = (S.QUEUED, S.PREEMPTED)
_HOLDS_BLOCKS = (S.PREFILLING, S.TRANSFERRING, S.DECODING, S.PREEMPTING)
_DONE = (S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.ABORTED, S.REJECTED)
_FAILURE_DECISIONS = (Decision.WORKER_FAILED, Decision.TRANSFER_FAILED)
# Room for every request a scope can hold: the step budget, not a sequence cap, limits.
MAX_NUM_SEQS = 256
# Attempts a router makes per request (cluster.backend.MAX_ATTEMPTS).
MAX_ATTEMPTS = 3


class EventKind(enum.Enum):
    ARRIVE = "arrive"
    PLAN = "plan"
    STEP = "step"
    TICK = "tick"
    STOP = "stop"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Event:
    kind: EventKind
    worker: int = -1
    req: int = -1
    shape: Shape | None = None


@dataclass(slots=True)
class Aux:
    """Mechanics the drivers do not own, and what checking has seen of a request."""

    pinned_on: int = -1  # worker whose prefix index pins its prompt hashes
    # When it was submitted (a retry: later than its arrival), and whether an earlier
    # attempt already streamed its first token (then this one's is not a TTFT).
    submitted: float = 0.0
    streamed: bool = False
    num_attempts: int = 1
    # Incremental checking: history records already checked, and the last
    # preemption the scheduler (not a failure) decided.
    num_checked: int = 0
    last_preempt: DecisionRecord | None = None

    def key(self) -> tuple:
        t = None if self.last_preempt is None else self.last_preempt.time
        return (self.pinned_on, t, self.submitted, self.streamed, self.num_attempts)


class Sink:
    """What the drivers tell the world while they decide: the requests they close (a
    rejection's request exists nowhere else) and their picks, checked for tier order
    the moment they are made (before the plan is applied changes the requests)."""

    __slots__ = ("tiers", "est", "keeps_tier_order", "closed", "found", "num_inversions")

    def __init__(self, tiers: TierConfig, est: LinearEstimate, keeps_tier_order: bool) -> None:
        self.tiers = tiers
        self.est = est
        self.keeps_tier_order = keeps_tier_order
        self.closed: list[Request] = []
        self.found: list[Violation] = []
        self.num_inversions = 0

    def __call__(self, pick: Pick) -> None:  # on_pick
        got = check_tier_order(pick, self.tiers, self.est)
        if got:
            self.num_inversions += 1
            if self.keeps_tier_order:
                self.found.extend(got)

    def on_decision(self, rec: DecisionRecord, tier: int) -> None:
        pass

    def on_closed(self, req: Request) -> None:
        self.closed.append(req)

    def on_prefix_lookup(self, num_blocks: int, num_hit: int) -> None:
        pass


_WORKER_INDEX: dict[str, int] = {}


def _worker_id(i: int) -> str:
    wid = f"w{i}"
    _WORKER_INDEX[wid] = i
    return wid


def cost_prior(scope: Scope) -> tuple[float, ...]:
    """The step cost model equal to the scope's linear estimate (no fixed cost, no
    attention term): a prefill of n tokens costs n x prefill_per_token_s, a decode
    iteration decode_per_token_s per request."""
    return (0.0, scope.prefill_per_token_s, 0.0, scope.decode_per_token_s, 0.0)


@dataclass
class World:
    scope: Scope
    tiers: TierConfig
    ctx: PolicyContext
    policy: SchedulingPolicy
    infos: tuple[WorkerInfo, ...]
    account_factory: AccountFactory
    cs: ClusterScheduler
    ws: list[WorkerScheduler]  # each worker core's planner (``cores[w].planner``)
    accounts: list[KVBlockAccount]
    prefix: list[PrefixIndex]
    sink: Sink
    # Prefix hashes each worker has announced as stored (its mirror in the scheduler).
    announced: list[set[int]] = field(default_factory=list)
    reqs: list[Request] = field(default_factory=list)
    aux: list[Aux] = field(default_factory=list)
    index: dict[str, int] = field(default_factory=dict)  # request id -> position in reqs
    num_arrived: int = 0
    tick: int = 0
    num_failures: int = 0
    plan_due: bool = False
    # Per worker: its step of this tick (planned, not yet ended), and the preemptions
    # the scheduler ordered while it ran.
    running: list[StepPlan | None] = field(default_factory=list)
    stepped: list[bool] = field(default_factory=list)
    deferred: list[list[PreemptOrder]] = field(default_factory=list)
    # No arrival or plan yet in this tick (completions and failures may happen).
    at_tick_start: bool = True
    last_stop: int = -1
    num_stops: int = 0
    # Observations (not part of the state key).
    ttfts: list[list[float]] = field(default_factory=list)
    num_preemptions: int = 0
    # Preemptions whose victim is of a more urgent tier than the request it made room for.
    num_inversions: int = 0
    max_wait_s: list[float] = field(default_factory=list)
    _violations: list[Violation] = field(default_factory=list)
    # A prefix index changed in this event (only pinning evicts): check the pins.
    _prefix_changed: bool = False
    # Each worker's DecodeCore, the one a live decode worker runs: every decision about a
    # request on a worker is its (stage, events, what a preemption comes to, who ends).
    cores: list[DecodeCore] = field(default_factory=list)

    @property
    def max_model_len(self) -> int:
        """The longest sequence a worker serves: what its KV holds (the engine's rule)."""
        return self.scope.blocks_per_worker * self.scope.block_size

    @classmethod
    def initial(cls, scope: Scope, policy_factory: PolicyFactory | None = None,
                account_factory: AccountFactory | None = None) -> World:
        tiers = scope_tiers(scope.num_tiers, scope.starvation_s)
        est = LinearEstimate(scope.prefill_per_token_s, scope.decode_per_token_s)
        ctx = PolicyContext(tiers=tiers, est=est, costs=make_costs(), block_size=scope.block_size)
        policy = (policy_factory or (lambda c: make_policy(scope.policy, c)))(ctx)
        acct = account_factory or KVBlockAccount
        infos = tuple(
            WorkerInfo(_worker_id(i), WorkerRole.DECODE, "n0", f"cuda:{i}", f"nvl{i // 2}",
                       scope.blocks_per_worker)
            for i in range(scope.num_workers)
        )
        sink = Sink(tiers, est, policy.keeps_tier_order)
        cs = ClusterScheduler(tiers, policy, scope.block_size, ctx.costs, mode=PoolMode.AGGREGATED,
                              cost_prior=cost_prior(scope), chunk_tokens=scope.step_budget_tokens,
                              observer=sink, on_pick=sink)
        world = cls(scope=scope, tiers=tiers, ctx=ctx, policy=policy, infos=infos,
                    account_factory=acct, cs=cs, ws=[],
                    accounts=[acct(i.worker_id, scope.blocks_per_worker) for i in infos],
                    prefix=[PrefixIndex(scope.blocks_per_worker) for _ in infos], sink=sink,
                    announced=[set() for _ in infos], running=[None] * len(infos),
                    stepped=[False] * len(infos), deferred=[[] for _ in infos],
                    ttfts=[[] for _ in range(scope.num_tiers)],
                    max_wait_s=[0.0] * scope.num_tiers)
        for w, info in enumerate(infos):
            cs.add_worker(info, scope.blocks_per_worker, can_prefill=True, can_decode=True)
            world.cores.append(world._new_worker_core(w))
            world.ws.append(world.cores[w].planner)
        return world

    def _new_worker_core(self, w: int) -> DecodeCore:
        sc = self.scope
        ws = WorkerScheduler(self.infos[w], self.policy, StepCosts(cost_prior(sc)),
                             block_size=sc.block_size, max_num_seqs=MAX_NUM_SEQS,
                             max_num_batched_tokens=sc.step_budget_tokens,
                             chunk_tokens=sc.step_budget_tokens,
                             num_decode_steps=sc.tokens_per_tick, on_pick=self.sink)
        return DecodeCore(self.infos[w].worker_id, ws, history=False)

    # -- state -------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.tick * self.scope.dt_s

    def _cfg(self) -> tuple[object, ...]:
        return (self.ctx, self.tiers, self.ctx.est, self.ctx.costs, self.scope, *self.infos)

    def clone(self) -> World:
        keep: dict[int, object] = {id(x): x for x in self._cfg()}
        new = copy_shallow(self)
        (new.cs, new.ws, new.cores, new.accounts, new.prefix, new.sink, new.reqs, new.aux,
         new.announced, new.deferred) = state_copy(  # type: ignore[misc]
            (self.cs, self.ws, self.cores, self.accounts, self.prefix, self.sink, self.reqs,
             self.aux, self.announced, self.deferred), keep)
        new.index = dict(self.index)
        new.running = list(self.running)  # plans are frozen
        new.stepped = list(self.stepped)
        new.policy = new.cs.policy
        new.ttfts = [list(x) for x in self.ttfts]
        new.max_wait_s = list(self.max_wait_s)
        new._violations = []
        return new

    def key(self) -> tuple:
        """Everything that decides the future, for state deduplication."""
        skip = frozenset(id(x) for x in (*self._cfg(), self.sink,
                                         *(r for c in self.cores for r in c.records())))
        # A finished request is never read again (every decision and check here
        # filters by state), so only its state stays in the key.
        reqs = tuple(
            (r.state,) if r.state in _DONE else
            (r.tier, r.arrival_time, r.prompt_len, r.max_new_tokens, r.block_hashes, r.state,
             r.num_computed_tokens, r.num_output_tokens, r.first_token_time,
             r.last_preempt_time, r.prefill_worker_id, r.decode_worker_id,
             r.history[-1].time if r.history else None, a.key())
            for r, a in zip(self.reqs, self.aux, strict=True)
        )
        return (self.tick, self.num_failures, self.num_stops, self.num_arrived,
                self.plan_due, self.at_tick_start, self.last_stop, tuple(self.stepped), reqs,
                fingerprint((self.cs, self.cores, self.accounts, self.prefix, self.running,
                             self.deferred), skip))

    def live(self) -> bool:
        return any(r.state not in _DONE for r in self.reqs)

    def failures_left(self) -> bool:
        return self.num_failures < self.scope.max_failures

    def can_stop(self, i: int) -> bool:
        """Request ``i`` may emit an early stop token now."""
        r = self.reqs[i]
        return r.state is S.DECODING and 0 < r.num_output_tokens < r.max_new_tokens

    def has_waiting(self, w: int) -> bool:
        """Worker ``w`` has work and has not stepped in this tick."""
        return not self.stepped[w] and self.ws[w].has_work()

    def worker_busy(self, w: int) -> bool:
        return bool(self.accounts[w].num_used or self.prefix[w].num_cached
                    or self.ws[w].local)

    def worker_index(self, worker_id: str | None) -> int:
        """The index of a worker by id (-1: none)."""
        return _WORKER_INDEX.get(worker_id, -1)  # type: ignore[arg-type]

    _index = worker_index

    # -- events ------------------------------------------------------------

    def enabled(self) -> list[Event]:
        """Every event that may happen next (exhaustive mode)."""
        sc = self.scope
        out: list[Event] = []
        if self.num_arrived < sc.max_requests and self.tick < sc.arrival_ticks:
            out.extend(Event(EventKind.ARRIVE, shape=s) for s in sc.shapes)
        if self.plan_due:
            out.append(Event(EventKind.PLAN))
        pending_steps = [w for w in range(sc.num_workers) if self.has_waiting(w)]
        out.extend(Event(EventKind.STEP, worker=w) for w in pending_steps)
        idle = not self.plan_due and not pending_steps
        # Completions are seen at the start of a tick (the decode iteration that
        # emitted the stop token), in request order (stops commute); failures at
        # the start of a tick or once nothing is due before it.
        if self.num_stops < sc.max_stops and self.at_tick_start:
            out.extend(Event(EventKind.STOP, req=i) for i in range(len(self.reqs))
                       if i > self.last_stop and self.can_stop(i))
        if self.failures_left() and (self.at_tick_start or idle):
            out.extend(Event(EventKind.FAIL, worker=w) for w in range(sc.num_workers)
                       if self.worker_busy(w))
        more_arrivals = self.num_arrived < sc.max_requests and self.tick + 1 < sc.arrival_ticks
        if idle and self.tick < sc.max_ticks and (self.live() or more_arrivals):
            out.append(Event(EventKind.TICK))
        return out

    def describe(self, ev: Event) -> str:
        t = f"t={self.now:.3f}"
        if ev.kind is EventKind.ARRIVE:
            assert ev.shape is not None
            return f"{t} arrive r{self.num_arrived} {ev.shape.label()}"
        if ev.kind is EventKind.PLAN:
            return f"{t} plan"
        if ev.kind is EventKind.STEP:
            return f"{t} step w{ev.worker}"
        if ev.kind is EventKind.STOP:
            return f"{t} stop r{ev.req}"
        if ev.kind is EventKind.FAIL:
            return f"{t} fail w{ev.worker}"
        return f"{t} tick -> t={self.now + self.scope.dt_s:.3f}"

    def apply(self, ev: Event) -> list[Violation]:
        """Apply one event, then check the invariants; returns the violations."""
        self._violations = []
        if ev.kind in (EventKind.ARRIVE, EventKind.PLAN, EventKind.STEP):
            self.at_tick_start = False
        if ev.kind is EventKind.STOP:
            self.last_stop = ev.req
            self.num_stops += 1
        if ev.kind is EventKind.ARRIVE:
            assert ev.shape is not None
            self._arrive(ev.shape)
        elif ev.kind is EventKind.PLAN:
            self._plan()
        elif ev.kind is EventKind.STEP:
            self._step(ev.worker)
        elif ev.kind is EventKind.TICK:
            self._tick()
        elif ev.kind is EventKind.STOP:
            self._stop(ev.req)
        else:
            self._fail(ev.worker)
        found = self._violations + self.sink.found
        self.sink.found = []
        return found + self.check(clock_moved=ev.kind is EventKind.TICK)

    # -- the actor's side --------------------------------------------------

    def _arrive(self, shape: Shape) -> None:
        rid = f"r{self.num_arrived}"
        self.num_arrived += 1
        self._submit(NewRequest(rid, shape.tier, self.now, shape.prompt_len,
                                shape.max_new_tokens, shape.block_hashes), Aux(submitted=self.now))

    def _submit(self, nr: NewRequest, aux: Aux) -> None:
        adm = self.cs.submit(nr, self.now)
        req = self.cs.get(nr.req_id)
        if req is None and self.sink.closed:
            req = self.sink.closed[-1]  # rejected: closed at once
        self.sink.closed = []
        if req is None:  # refused before it became a request (no worker): never here
            self._violations.append(Violation(Invariant.LEGAL_TRANSITIONS,
                                              f"{nr.req_id}: {adm.outcome.value} ({adm.reason})"))
            req = Request(nr.req_id, nr.tier, nr.arrival_time, nr.prompt_len,
                          nr.max_new_tokens, nr.block_hashes, state=S.REJECTED)
        self.index[req.req_id] = len(self.reqs)
        self.reqs.append(req)
        self.aux.append(aux)
        if adm.accepted:
            self.plan_due = True

    def _retry(self, req_id: str) -> None:
        """The router retries a request the cluster gave up on (cluster.backend): the
        prompt plus the tokens it streamed, for the tokens left, same arrival and tier."""
        i = self.index[req_id]
        r, a = self.reqs[i], self.aux[i]
        produced = r.num_output_tokens
        left = r.max_new_tokens - produced
        if a.num_attempts >= MAX_ATTEMPTS or left <= 0:
            return
        base = req_id.split("-r")[0]
        nr = NewRequest(f"{base}-r{a.num_attempts}", r.tier, r.arrival_time,
                        r.prompt_len + produced, left, r.block_hashes)
        self._submit(nr, Aux(submitted=self.now, streamed=a.streamed or produced > 0,
                             num_attempts=a.num_attempts + 1))

    def _plan(self) -> None:
        now = self.now
        plan: Plan = self.cs.plan(now)
        self.plan_due = False
        if self.policy.work_conserving:
            self._violations += check_work_conservation(self.cs.unplaced_fits())
        touched: dict[int, list[BlockEvent]] = {}
        for a in plan.aborts:
            for wid in a.worker_ids:
                w = self._index(wid)
                self._drop(w, a.req_id)
                touched.setdefault(w, [])
        for p in plan.preempts:
            w = self._index(p.worker_id)
            if self.running[w] is not None:
                self.deferred[w].append(p)  # between steps, as an engine does
            else:
                self._evict(w, p.req_id, p.mode, now, p.for_req_id)
        for d in plan.dispatches:
            w, changes = self._dispatch(d, now)
            touched.setdefault(w, []).extend(changes)
        for w in sorted(touched):
            self._report(w, now, touched[w])
        if self.scope.retries:
            for a in plan.aborts:
                if a.error is not None:
                    self._retry(a.req_id)

    def _dispatch(self, d: DispatchOrder, now: float) -> tuple[int, list[BlockEvent]]:
        """The decode worker (which prefills it too) reserves the blocks, pins the cached
        prefix and queues the prefill; or refuses (no blocks, or no room to pin)."""
        w = self._index(d.decode_worker_id)
        acct, idx = self.accounts[w], self.prefix[w]
        req = self.cs.get(d.req_id)
        assert req is not None
        self.cores[w].planner.release_hold(req.req_id)
        hits: int | None = None
        if acct.allocate(req.req_id, d.num_blocks):
            hits = idx.acquire(req.block_hashes,
                               lambda: self.policy.protected_hashes(self.cs.waiting()))
            if hits is None:
                acct.release(req.req_id)
        ok = hits is not None
        self._prefix_changed = True
        self.cs.on_dispatch_result(req.req_id, ok, now,
                                   num_free_blocks=acct.num_free + acct.num_cached,
                                   num_cached_blocks=hits or 0)
        if hits is not None:
            self.aux[self._req_index(req.req_id)].pinned_on = w
            cached = min(hits * self.scope.block_size, req.num_context_tokens - 1)
            req.num_computed_tokens = cached
            # The worker's own copy of the request, built from what the dispatch carries.
            copy = Request(req.req_id, req.tier, req.arrival_time, req.prompt_len,
                           req.max_new_tokens, req.block_hashes, num_computed_tokens=cached)
            self.cores[w].prefill_here(copy, d.num_blocks, cached, now)
        return w, self._prefix_events(w, req.block_hashes if ok else ())

    def _prefix_events(self, w: int, pinned: tuple[int, ...]) -> list[BlockEvent]:
        """What worker ``w``'s prefix cache tells the mirror after pinning ``pinned``
        (inserted where missing, others evicted to make room)."""
        known, idx = self.announced[w], self.prefix[w]
        removed = tuple(h for h in known if h not in idx)
        stored = tuple(h for h in pinned if h not in known)
        out = []
        if removed:
            known.difference_update(removed)
            out.append(BlockEvent(False, removed))
        if stored:
            known.update(stored)
            out.append(BlockEvent(True, stored))
        return out

    # -- the workers' side -------------------------------------------------

    def _req_index(self, req_id: str) -> int:
        return self.index[req_id]

    def _step(self, w: int) -> None:
        """Worker ``w`` starts its step of this tick: the plan, and what happens before
        the forward (victims out, blocks for growth, swap-ins and recomputes)."""
        self.stepped[w] = True
        core, acct = self.cores[w], self.accounts[w]
        ws = core.planner
        now = self.now
        bs = self.scope.block_size
        k = ws.num_decode_steps
        growers = [lr.req.tier for lr in ws.decoding.values()
                   if -(-(lr.num_computed + decode_tokens(lr, k)) // bs) > lr.num_blocks]
        plan = core.plan(now, acct.num_free + acct.num_cached)
        self.running[w] = plan
        for rid, mode in core.victims(plan):
            self._evict(w, rid, mode, now, None, min(growers, default=None))
        short: list[str] = []
        for rid in plan.decodes:
            lr = ws.local[rid]
            need = -(-(lr.num_computed + decode_tokens(lr, k)) // bs) - acct.blocks_of(rid)
            if need > 0 and not acct.allocate(rid, need):
                short.append(rid)
        for rid in plan.swap_in:
            lr = ws.local[rid]
            if not acct.allocate(rid, lr.num_blocks):
                short.append(rid)
                continue
            core.swapped_in(rid, lr.num_blocks, 0.0, now)
        for rid, _ in plan.chunks:
            lr = ws.local[rid]
            if lr.num_blocks == 0:  # a recompute: all of its blocks when it starts
                need = -(-(lr.num_computed + lr.num_prefill_left + 1) // bs)
                if not acct.allocate(rid, need):
                    short.append(rid)
        if short:
            self._violations.append(Violation(
                Invariant.KV_BUDGET, f"w{w}: step at t={now:.3f} planned blocks the worker "
                                     f"does not have for {', '.join(short)}"))
        self._report(w, now)

    def _tick(self) -> None:
        end = self.now + self.scope.dt_s
        for w, plan in enumerate(self.running):
            if plan is not None:
                self._end_step(w, plan, end)
        n = self.scope.num_workers
        self.running = [None] * n
        self.stepped = [False] * n
        self.tick += 1
        self.at_tick_start = True
        self.last_stop = -1
        self.plan_due = len(self.cs.queue) > 0

    def _end_step(self, w: int, plan: StepPlan, end: float) -> None:
        """The step's forward ran: commit it, end what finished, apply the preemptions
        that waited for it, and report."""
        core, acct = self.cores[w], self.accounts[w]
        ws = core.planner
        first = {rid for rid, _ in plan.chunks
                 if (lr := ws.local.get(rid)) is not None and lr.req.first_token_time is None}
        blocks = {rid: acct.blocks_of(rid) for rid in (*(c[0] for c in plan.chunks),
                                                       *plan.decodes)}
        done = ws.commit(plan, end, seconds=None, blocks=blocks)
        for rid in done:
            req = ws.local[rid].req
            self._unpin(self._req_index(rid))
            if rid in first and not self.aux[self._req_index(rid)].streamed:
                self.ttfts[req.tier].append(end - req.arrival_time)
        core.outputs([StepResult(rid) for rid in done], set(done), end)
        ended = [(rid, len(lr.req.block_hashes)) for rid in dict.fromkeys((*done, *plan.decodes))
                 if (lr := ws.local.get(rid)) is not None
                 and lr.req.reached_length(self.max_model_len)]
        self._finish(w, ended, "length", end)
        self._report(w, end)
        orders, self.deferred[w] = self.deferred[w], []
        for p in orders:
            self._evict(w, p.req_id, p.mode, end, p.for_req_id)

    def _evict(self, w: int, rid: str, mode: PreemptMode, now: float, for_req: str | None,
               for_tier: int | None = None) -> None:
        """Preempt a decode here (a KV-pressure victim or a preemption for an arrival),
        as the worker core decides: swap its blocks out or drop them and queue it for
        recompute here; report it at once, so the scheduler's view of the request is
        current when it queues again."""
        core = self.cores[w]
        lr = core.planner.decoding.get(rid)
        if lr is None:
            return  # no longer decoding here (finished, or preempted already)
        # MIGRATE needs a peer, which a step's victims never have: a recompute here.
        mode = mode if mode is PreemptMode.SWAP else PreemptMode.RECOMPUTE
        if core.preempt_order(rid, mode, None).ok is not None:
            return
        req = lr.req
        n = self.accounts[w].release(rid)
        core.evicted(rid, eviction_order(mode, False)[0], for_req, now, num_blocks=n,
                     num_freed=n)
        if mode is PreemptMode.SWAP:
            lr.num_blocks = n
        self.num_preemptions += 1
        if for_req is not None:
            blocker = self.cs.get(for_req)
            for_tier = blocker.tier if blocker is not None else None
        if for_tier is not None and req.tier < for_tier:
            self.num_inversions += 1
        self._report(w, now)

    def _finish(self, w: int, ended: list[tuple[str, int]], finish: str, now: float) -> None:
        """Requests that reached their end (``finish``: "stop" or "length"), with the
        prompt blocks each leaves in the prefix cache: the core ends them, their blocks
        go back."""
        self.cores[w].outputs([StepResult(rid, finish=finish, request_finished=True)
                               for rid, _ in ended], set(), now)
        for rid, num_cached in ended:
            self.accounts[w].release(rid, keep_cached=num_cached)
            self._unpin(self._req_index(rid))

    def _drop(self, w: int, rid: str) -> None:
        """An abort order: the worker forgets the request and frees its blocks."""
        if w < 0:
            return
        self.cores[w].abort(rid, self.now)
        self.accounts[w].release(rid)
        self._unpin(self._req_index(rid))

    def _unpin(self, i: int) -> None:
        a = self.aux[i]
        if a.pinned_on >= 0:
            self.prefix[a.pinned_on].release(self.reqs[i].block_hashes)
            a.pinned_on = -1

    def _report(self, w: int, now: float, block_events: list[BlockEvent] | tuple[()] = ()
                ) -> None:
        """What worker ``w`` tells the scheduler after a step or an order: its core's
        events, free blocks, running requests and prefix-cache changes."""
        acct, core = self.accounts[w], self.cores[w]
        ws = core.planner
        events, core.events[:] = tuple(core.events), []
        core.ledger.report(KVCounters())  # its measurements: a live worker's report's
        running = tuple(RunningReq(rid, acct.blocks_of(rid), lr.req.num_output_tokens,
                                   lr.num_prefill_left)
                        for rid, lr in ws.local.items() if not lr.is_swapped)
        rep = WorkerReport(self.infos[w].worker_id, acct.num_free + acct.num_cached,
                           acct.num_total_blocks, events=events,
                           block_events=tuple(block_events), running=running)
        self.cs.on_report(rep, now)

    def _stop(self, i: int) -> None:
        r = self.reqs[i]
        w = self._index(r.decode_worker_id)
        lr = self.ws[w].local.get(r.req_id)
        if lr is not None:
            self._finish(w, [(r.req_id, len(lr.req.block_hashes))], "stop", self.now)
        self._report(w, self.now)
        self.plan_due = len(self.cs.queue) > 0

    def _fail(self, w: int) -> None:
        self.num_failures += 1
        info = self.infos[w]
        self.cs.remove_worker(info.worker_id, self.now)
        for a in self.aux:
            if a.pinned_on == w:
                a.pinned_on = -1
        blocks = self.scope.blocks_per_worker
        self.accounts[w] = self.account_factory(info.worker_id, blocks)
        self.prefix[w] = PrefixIndex(blocks)
        self._prefix_changed = True
        self.announced[w] = set()
        self.cores[w] = self._new_worker_core(w)
        self.ws[w] = self.cores[w].planner
        self.running[w] = None
        self.deferred[w] = []
        self.cs.add_worker(info, blocks, can_prefill=True, can_decode=True)
        self.plan_due = True

    # -- invariants --------------------------------------------------------

    def check(self, clock_moved: bool = True) -> list[Violation]:
        """Every hard invariant on the current state. Waits only grow when the clock
        moves (a request that starts waiting has waited 0), so ``clock_moved=False``
        skips the starvation bound."""
        out = check_kv_budget(self.accounts)
        out += self._check_ownership()
        out += check_shares(self.policy.shares)
        for r, a in zip(self.reqs, self.aux, strict=True):
            if len(r.history) > a.num_checked:
                out += self._check_new_records(r, a)
        if not clock_moved:
            return out
        submitted = {r.req_id: a.submitted for r, a in zip(self.reqs, self.aux, strict=True)
                     if a.num_attempts > 1}
        out += check_starvation(self.reqs, self.now, self.tiers, submitted)
        for r, a in zip(self.reqs, self.aux, strict=True):
            if r.state in _WAITING:
                since = r.history[-1].time if r.history else r.arrival_time
                waited = self.now - max(since, a.submitted)
                if waited > self.max_wait_s[r.tier]:
                    self.max_wait_s[r.tier] = waited
        return out

    def _check_new_records(self, r: Request, a: Aux) -> list[Violation]:
        """Transitions and anti-thrash over the records added since the last check."""
        h = r.history
        if len(h) <= a.num_checked:
            return []
        new = h[a.num_checked:]
        out = check_transitions(h[a.num_checked - 1:] if a.num_checked else new)
        preempts = [x for x in new if x.decision not in _FAILURE_DECISIONS and (
            x.to_state is S.PREEMPTING
            or (x.to_state is S.PREEMPTED and x.from_state is not S.PREEMPTING))]
        if preempts:
            prior = [] if a.last_preempt is None else [a.last_preempt]
            out += check_anti_thrash(prior + preempts, self.tiers.anti_thrash_s)
            a.last_preempt = preempts[-1]
        a.num_checked = len(h)
        return out

    def compact(self) -> None:
        """Keep only each request's last record (all earlier ones are checked and no
        decision reads them): fewer distinct states, cheaper copies."""
        for r, a in zip(self.reqs, self.aux, strict=True):
            if len(r.history) > 1:
                r.history = r.history[-1:]
                a.num_checked = min(a.num_checked, 1)

    def _check_ownership(self) -> list[Violation]:
        out = []
        for w, acct in enumerate(self.accounts):
            wid = self.infos[w].worker_id
            for req_id, n in acct.owned.items():
                r = self.reqs[self._req_index(req_id)]
                ok = (r.decode_worker_id == wid and r.state not in _DONE
                      and req_id in self.ws[w].local)
                if not ok or n <= 0:
                    out.append(Violation(Invariant.KV_BUDGET,
                                         f"{wid}: {n} blocks owned by {req_id} ({r.state.value})"))
        for r, a in zip(self.reqs, self.aux, strict=True):
            if r.state in _HOLDS_BLOCKS:
                d = self._index(r.decode_worker_id)
                if d < 0 or self.accounts[d].blocks_of(r.req_id) <= 0:
                    out.append(Violation(Invariant.KV_BUDGET,
                                         f"{r.req_id} is {r.state.value} but holds no blocks"))
            if a.pinned_on >= 0 and self._prefix_changed:
                idx = self.prefix[a.pinned_on]
                lost = [h for h in r.block_hashes if h not in idx]
                if lost:
                    out.append(Violation(Invariant.KV_BUDGET,
                                         f"w{a.pinned_on} prefix index evicted blocks {lost} "
                                         f"pinned by {r.req_id} ({r.state.value})"))
        self._prefix_changed = False
        for p, idx in enumerate(self.prefix):
            if idx.num_cached > idx.capacity or idx.num_evictable > idx.num_cached:
                out.append(Violation(Invariant.KV_BUDGET,
                                     f"w{p} prefix index: {idx.num_cached} entries, "
                                     f"{idx.num_evictable} evictable, capacity {idx.capacity}"))
        return out


def copy_shallow(world: World) -> World:
    new = object.__new__(World)
    new.__dict__.update(world.__dict__)
    return new
