"""A small cluster moved by events, over the real kernel: the model both checkers explore.

A :class:`World` holds ``num_workers`` workers, each both a prefill worker (a
:class:`PrefixIndex`) and a decode worker (a :class:`KVBlockAccount`), the
requests, and one scheduling policy built by :func:`scheduler.policies.make_policy`.
Every decision is the policy's; the world only applies its plans, the way a
worker or the simulator does. Events (a clock of ``dt_s`` per tick):

1. ARRIVE(shape): a request arrives; ``policy.admit`` accepts, queues or
   rejects it; ``policy.place_prefill`` picks its prefill worker (prefix match
   from that worker's index, and backlog).
2. STEP(w): worker ``w``'s step: ``policy.make_queue()`` holds its waiting
   requests and ``take`` offers them in policy order; each offered request is
   placed (``policy.place_decode``), or else may preempt (``policy.preempt_for``),
   within a prefill token budget. A swapped-out request resumes by swap-in.
3. TICK: the clock advances; prefills finish (first token, TTFT observed),
   transfers land, decoding requests generate ``tokens_per_tick`` tokens and
   grow their KV, calling ``policy.on_kv_pressure`` when a worker runs out;
   migrations resume; ``policy.tick`` runs (deadline watcher, fair share).
   A tick is enabled only after every worker with waiting work has stepped
   since the last one (workers keep stepping: no adversarial idling).
4. STOP(r): a decoding request emits its stop token early (seen at the start
   of a tick, the decode iteration that produced it; several stops in one tick
   commute, so they are taken in request order).
5. FAIL(w): worker ``w`` dies and restarts empty; its prefills and transfers
   are retried by recompute, its decodes are aborted, swap copies are lost
   (at the start of a tick, or after its steps).

Preemptions are the policy's decisions inside steps and ticks, so they
interleave with everything else through those events.

After every event :meth:`World.check` runs the hard invariants of
:mod:`scheduler.invariants` and block ownership (every owned block belongs to
a live request on that worker; a request that ends holds no blocks). An
attempted illegal transition is caught and reported, never raised.
"""

from __future__ import annotations

import copy
import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from scheduler.admission import AdmissionKind, LoadSnapshot
from scheduler.deadlines import LinearEstimate, slack_s
from scheduler.invariants import (
    Invariant,
    Violation,
    check_anti_thrash,
    check_kv_budget,
    check_shares,
    check_starvation,
    check_transitions,
)
from scheduler.kv import KVBlockAccount
from scheduler.placement import DecodeView, PrefillView
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptionPlan, PreemptMode, VictimView
from scheduler.prefix_index import PrefixIndex
from scheduler.queues import Verdict
from scheduler.request import (
    Decision,
    DecisionRecord,
    IllegalTransition,
    Request,
    RequestState,
    transition,
)
from scheduler.testing import make_costs
from scheduler.tiers import TierConfig
from scheduler.topology import WorkerInfo, WorkerRole
from scheduler.verify.scope import Scope, Shape, scope_tiers
from scheduler.verify.snapshot import fingerprint, state_copy

PolicyFactory = Callable[[PolicyContext], SchedulingPolicy]
AccountFactory = Callable[[str, int], KVBlockAccount]

S = RequestState
# Tuples, not sets: membership by identity is much cheaper than Enum.__hash__.
_WAITING = (S.QUEUED, S.PREEMPTED)
_HOLDS_BLOCKS = (S.PREFILLING, S.TRANSFERRING, S.DECODING, S.PREEMPTING)
_DONE = (S.FINISHED_STOPPED, S.FINISHED_LENGTH, S.ABORTED, S.REJECTED)
_FAILURE_DECISIONS = (Decision.WORKER_FAILED, Decision.TRANSFER_FAILED)
_PREEMPT_DECISION = {PreemptMode.SWAP: Decision.PREEMPT_SWAP,
                     PreemptMode.RECOMPUTE: Decision.PREEMPT_RECOMPUTE,
                     PreemptMode.MIGRATE: Decision.PREEMPT_MIGRATE}




class EventKind(enum.Enum):
    ARRIVE = "arrive"
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
    """Mechanics the kernel does not own: where a request's work stands in the model."""

    ready_tick: int = 0
    swapped: bool = False  # PREEMPTED with its KV in host memory
    migrate_to: int = -1  # PREEMPTED, blocks reserved on this worker, resumes next tick
    pinned_on: int = -1  # prefill worker whose index pins its prompt hashes
    # Incremental checking: history records already checked, and the last
    # preemption the scheduler (not a failure) decided.
    num_checked: int = 0
    last_preempt: DecisionRecord | None = None

    def key(self) -> tuple:
        t = None if self.last_preempt is None else self.last_preempt.time
        return (self.ready_tick, self.swapped, self.migrate_to, self.pinned_on, t)


_WORKER_INDEX: dict[str, int] = {}


def _worker_id(i: int) -> str:
    wid = f"w{i}"
    _WORKER_INDEX[wid] = i
    return wid


@dataclass
class World:
    scope: Scope
    tiers: TierConfig
    ctx: PolicyContext
    policy: SchedulingPolicy
    infos: tuple[WorkerInfo, ...]
    account_factory: AccountFactory
    accounts: list[KVBlockAccount]
    prefix: list[PrefixIndex]
    reqs: list[Request] = field(default_factory=list)
    aux: list[Aux] = field(default_factory=list)
    tick: int = 0
    num_failures: int = 0
    stepped: list[bool] = field(default_factory=list)
    # No arrival or step yet in this tick (completions and failures may happen).
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
        return cls(scope=scope, tiers=tiers, ctx=ctx, policy=policy, infos=infos,
                   account_factory=acct,
                   accounts=[acct(i.worker_id, scope.blocks_per_worker) for i in infos],
                   prefix=[PrefixIndex(scope.blocks_per_worker) for _ in infos],
                   stepped=[False] * scope.num_workers,
                   ttfts=[[] for _ in range(scope.num_tiers)],
                   max_wait_s=[0.0] * scope.num_tiers)

    # -- state -------------------------------------------------------------

    @property
    def now(self) -> float:
        return self.tick * self.scope.dt_s

    def _cfg_ids(self) -> frozenset[int]:
        return frozenset(id(x) for x in (self.ctx, self.tiers, self.ctx.est, self.ctx.costs,
                                         self.scope, *self.infos))

    def clone(self) -> World:
        keep: dict[int, object] = {id(x): x for x in (self.ctx, self.tiers, self.ctx.est,
                                                       self.ctx.costs, self.scope, *self.infos)}
        new = copy.copy(self)
        new.policy = state_copy(self.policy, keep)  # type: ignore[assignment]
        new.accounts = [state_copy(a, keep) for a in self.accounts]  # type: ignore[misc]
        new.prefix = [state_copy(p, keep) for p in self.prefix]  # type: ignore[misc]
        new.reqs = [state_copy(r, keep) for r in self.reqs]  # type: ignore[misc]
        new.aux = [state_copy(a, keep) for a in self.aux]  # type: ignore[misc]
        new.stepped = list(self.stepped)
        new.ttfts = [list(x) for x in self.ttfts]
        new.max_wait_s = list(self.max_wait_s)
        new._violations = []
        return new

    def key(self) -> tuple:
        """Everything that decides the future, for state deduplication."""
        skip = self._cfg_ids()
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
        return (self.tick, self.num_failures, self.num_stops, tuple(self.stepped),
                self.at_tick_start,
                self.last_stop, reqs,
                tuple(fingerprint(a, skip) for a in self.accounts),
                tuple(fingerprint(p, skip) for p in self.prefix),
                fingerprint(self.policy, skip))

    def live(self) -> bool:
        return any(r.state not in _DONE for r in self.reqs)

    def failures_left(self) -> bool:
        return self.num_failures < self.scope.max_failures

    def can_stop(self, i: int) -> bool:
        """Request ``i`` may emit an early stop token now."""
        r = self.reqs[i]
        return r.state is S.DECODING and 0 < r.num_output_tokens < r.max_new_tokens

    def has_waiting(self, w: int) -> bool:
        return bool(self._waiting_on(w))

    def _waiting_on(self, w: int) -> list[int]:
        return [i for i, r in enumerate(self.reqs)
                if r.state in _WAITING and self.aux[i].migrate_to < 0
                and r.prefill_worker_id == self.infos[w].worker_id]

    # -- events ------------------------------------------------------------

    def enabled(self) -> list[Event]:
        """Every event that may happen next (exhaustive mode)."""
        sc = self.scope
        out: list[Event] = []
        if len(self.reqs) < sc.max_requests and self.tick < sc.arrival_ticks:
            out.extend(Event(EventKind.ARRIVE, shape=s) for s in sc.shapes)
        pending_steps = [w for w in range(sc.num_workers)
                         if not self.stepped[w] and self._waiting_on(w)]
        out.extend(Event(EventKind.STEP, worker=w) for w in pending_steps)
        # Completions are seen at the start of a tick (the decode iteration that
        # emitted the stop token), in request order (stops commute); failures at
        # the start of a tick or after its steps.
        if self.num_stops < sc.max_stops and self.at_tick_start:
            out.extend(Event(EventKind.STOP, req=i) for i in range(len(self.reqs))
                       if i > self.last_stop and self.can_stop(i))
        if self.failures_left() and (self.at_tick_start or not pending_steps):
            out.extend(Event(EventKind.FAIL, worker=w) for w in range(sc.num_workers)
                       if self.worker_busy(w))
        more_arrivals = len(self.reqs) < sc.max_requests and self.tick + 1 < sc.arrival_ticks
        if not pending_steps and self.tick < sc.max_ticks and (self.live() or more_arrivals):
            out.append(Event(EventKind.TICK))
        return out

    def describe(self, ev: Event) -> str:
        t = f"t={self.now:.3f}"
        if ev.kind is EventKind.ARRIVE:
            assert ev.shape is not None
            return f"{t} arrive r{len(self.reqs)} {ev.shape.label()}"
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
        if ev.kind in (EventKind.ARRIVE, EventKind.STEP):
            self.at_tick_start = False
        if ev.kind is EventKind.STOP:
            self.last_stop = ev.req
            self.num_stops += 1
        if ev.kind is EventKind.ARRIVE:
            assert ev.shape is not None
            self._arrive(ev.shape)
        elif ev.kind is EventKind.STEP:
            self._step(ev.worker)
        elif ev.kind is EventKind.TICK:
            self._tick()
        elif ev.kind is EventKind.STOP:
            self._stop(ev.req)
        else:
            self._fail(ev.worker)
        return self._violations + self.check(clock_moved=ev.kind is EventKind.TICK)

    # -- mechanics ---------------------------------------------------------

    def worker_busy(self, w: int) -> bool:
        wid = self.infos[w].worker_id
        if self.accounts[w].num_used or self.prefix[w].num_cached:
            return True
        return any(r.state in _HOLDS_BLOCKS and wid in (r.prefill_worker_id, r.decode_worker_id)
                   for r in self.reqs)

    def worker_index(self, worker_id: str | None) -> int:
        """The index of a worker by id (-1: none)."""
        return _WORKER_INDEX.get(worker_id, -1)  # type: ignore[arg-type]

    _index = worker_index

    def _move(self, i: int, to: RequestState, decision: Decision, by: str,
              blocking: str | None = None, hits: int = 0) -> bool:
        r = self.reqs[i]
        w = self._index(r.decode_worker_id)
        pressure = self.accounts[w].mem_pressure if w >= 0 else 0.0
        try:
            transition(r, to, decision=decision, triggered_by=by, now=self.now,
                       mem_pressure=pressure, slo_slack=slack_s(r, self.now, self.tiers,
                                                                 self.ctx.est),
                       kv_reuse_hit=hits, blocking_req_id=blocking)
        except IllegalTransition as e:
            self._violations.append(Violation(Invariant.LEGAL_TRANSITIONS, str(e)))
            return False
        return True

    def _decode_views(self) -> list[DecodeView]:
        running: dict[str | None, int] = {}
        for r in self.reqs:
            if r.state in _HOLDS_BLOCKS:
                running[r.decode_worker_id] = running.get(r.decode_worker_id, 0) + 1
        return [DecodeView(info, a.num_free + a.num_cached, running.get(info.worker_id, 0))
                for info, a in zip(self.infos, self.accounts, strict=True)]

    def _backlog_s(self, idx: Sequence[int]) -> float:
        est = self.ctx.est
        return sum(est.prefill_s(self.reqs[i].num_context_tokens, 0) for i in idx)

    def _arrive(self, shape: Shape) -> None:
        r = Request(req_id=f"r{len(self.reqs)}", tier=shape.tier, arrival_time=self.now,
                    prompt_len=shape.prompt_len, max_new_tokens=shape.max_new_tokens,
                    block_hashes=shape.block_hashes)
        self.reqs.append(r)
        self.aux.append(Aux())
        i = len(self.reqs) - 1
        pol = self.policy
        pol.record_demand(r.tier, r.prompt_len + r.max_new_tokens, self.now)
        waiting = [j for j, q in enumerate(self.reqs) if q.state in _WAITING and j != i]
        backlog = [self._backlog_s([j for j in waiting if self.reqs[j].tier == t])
                   for t in range(self.tiers.num_tiers)]
        need = r.num_blocks_needed(self.scope.block_size, 1)
        load = LoadSnapshot(backlog, self.scope.num_workers,
                            any(v.num_free_blocks >= need for v in self._decode_views()))
        decision = pol.admit(r, self.now, load)
        if decision.kind is AdmissionKind.REJECT:
            self._move(i, S.REJECTED, Decision.REJECT, "admission")
            return
        views = [PrefillView(info, self._backlog_s(self._waiting_on(w)),
                             self.prefix[w].match_len(r.block_hashes))
                 for w, info in enumerate(self.infos)]
        chosen = pol.place_prefill(r, views)
        if chosen is not None:
            r.prefill_worker_id = chosen.info.worker_id

    def _victim_views(self, w: int, exclude: int = -1) -> list[VictimView]:
        wid = self.infos[w].worker_id
        out = []
        for i, r in enumerate(self.reqs):
            if i == exclude or r.decode_worker_id != wid or r.state not in (
                    S.PREFILLING, S.TRANSFERRING, S.DECODING):
                continue
            n = self.accounts[w].blocks_of(r.req_id)
            peer = None
            for p, info in enumerate(self.infos):
                a = self.accounts[p]
                if p != w and a.num_free + a.num_cached >= n:
                    peer = info
                    break
            # Leading prompt blocks also cached on another worker survive preemption.
            shared = max((self.prefix[p].match_len(r.block_hashes)
                          for p in range(len(self.infos)) if p != w), default=0)
            out.append(VictimView(r, self.infos[w], n, min(shared, n), peer))
        return out

    def _apply_plan(self, plan: PreemptionPlan, blocking: str | None, by: str,
                    for_tier: int) -> None:
        ids = {r.req_id: i for i, r in enumerate(self.reqs)}
        for v in plan.victims:
            i = ids.get(v.req_id)
            if i is None:
                self._violations.append(Violation(
                    Invariant.LEGAL_TRANSITIONS, f"plan names unknown request {v.req_id}"))
                continue
            r, a = self.reqs[i], self.aux[i]
            w = self._index(r.decode_worker_id)
            was = r.state
            if was is S.DECODING:
                if not self._move(i, S.PREEMPTING, _PREEMPT_DECISION[v.mode], by, blocking):
                    continue
                self._move(i, S.PREEMPTED, Decision.PREEMPT_DONE, by, blocking)
            elif not self._move(i, S.PREEMPTED, Decision.PREEMPT_RECOMPUTE, by, blocking):
                continue
            self.num_preemptions += 1
            if r.tier < for_tier:
                self.num_inversions += 1
            n = self.accounts[w].release(r.req_id) if w >= 0 else 0
            self._unpin(i)
            mode = v.mode if was is S.DECODING else PreemptMode.RECOMPUTE
            if mode is PreemptMode.MIGRATE:
                p = self._index(v.peer_id)
                if p >= 0 and p != w and self.accounts[p].allocate(r.req_id, n):
                    r.decode_worker_id = self.infos[p].worker_id
                    a.migrate_to = p
                    continue
                mode = PreemptMode.RECOMPUTE
            if mode is PreemptMode.SWAP:
                a.swapped = True
            else:
                r.num_computed_tokens = 0
                a.swapped = False

    def _unpin(self, i: int) -> None:
        a = self.aux[i]
        if a.pinned_on >= 0:
            self.prefix[a.pinned_on].release(self.reqs[i].block_hashes)
            a.pinned_on = -1

    def _step(self, w: int) -> None:
        self.stepped[w] = True
        pol = self.policy
        sc = self.scope
        queue = pol.make_queue()
        waiting = self._waiting_on(w)
        for i in waiting:
            queue.push(self.reqs[i], self.now)
        ids = {self.reqs[i].req_id: i for i in waiting}
        protected = pol.protected_hashes(self.reqs[i] for i in waiting)
        budget = [sc.step_budget_tokens]
        blocked = Verdict.SKIP if pol.skips_blocked else Verdict.STOP

        def accept(req: Request) -> Verdict:
            if budget[0] <= 0:
                return Verdict.STOP
            i = ids[req.req_id]
            a = self.aux[i]
            resume = req.state is S.PREEMPTED and a.swapped
            need = req.num_blocks_needed(sc.block_size, 0 if resume else 1)
            choice = pol.place_decode(req, need, self._decode_views(), self.infos[w])
            if choice is None:
                views = self._decode_views()
                target = max(range(len(views)), key=lambda p: views[p].num_free_blocks)
                plan = pol.preempt_for(req, need, views[target].num_free_blocks,
                                       self._victim_views(target), self.now)
                if plan is not None and plan.victims:
                    self._apply_plan(plan, req.req_id, "preempt_for", req.tier)
                    choice = pol.place_decode(req, need, self._decode_views(), self.infos[w])
            if choice is None:
                return blocked
            d = self._index(choice.view.info.worker_id)
            hits = 0
            if not resume:
                got = self.prefix[w].acquire(req.block_hashes, protected)
                if got is None:
                    return blocked
                hits = got
            if not self.accounts[d].allocate(req.req_id, need):
                if not resume:
                    self.prefix[w].release(req.block_hashes)
                return blocked
            req.decode_worker_id = self.infos[d].worker_id
            if resume:
                a.swapped = False
                self._move(i, S.DECODING, Decision.RESUME_SWAP_IN, "step")
                return Verdict.TAKE
            if req.state is S.PREEMPTED:
                self._move(i, S.QUEUED, Decision.RESUME_RECOMPUTE, "step")
            a.pinned_on = w
            req.num_computed_tokens = 0
            new = max(req.num_context_tokens - hits * sc.block_size, 1)
            ticks = max(1, math.ceil(self.ctx.est.prefill_s(new, hits * sc.block_size)
                                     / sc.dt_s - 1e-9))
            a.ready_tick = self.tick + ticks
            budget[0] -= new
            self._move(i, S.PREFILLING, Decision.SCHEDULE_PREFILL, "step", hits=hits)
            return Verdict.TAKE

        queue.take(self.now, accept)

    def _finish(self, i: int, decision: Decision, to: RequestState) -> None:
        r = self.reqs[i]
        w = self._index(r.decode_worker_id)
        if self._move(i, to, decision, "tick"):
            if w >= 0:
                self.accounts[w].release(r.req_id, keep_cached=len(r.block_hashes))
            self._unpin(i)

    def _tick(self) -> None:
        sc = self.scope
        self.tick += 1
        now = self.now
        pol = self.policy
        phase = [r.state for r in self.reqs]
        for i, r in enumerate(self.reqs):
            a = self.aux[i]
            if phase[i] is S.PREFILLING and r.state is S.PREFILLING and a.ready_tick <= self.tick:
                self._unpin(i)
                r.num_computed_tokens = r.num_context_tokens
                r.num_output_tokens += 1
                if r.first_token_time is None:
                    r.first_token_time = now
                    spec = self.tiers[r.tier]
                    ttft = now - r.arrival_time
                    self.ttfts[r.tier].append(ttft)
                    pol.observe_latency(r.tier, ttft, spec.ttft_s or spec.deadline_s)
                pol.record_served(r.tier, 1, self.ctx.est.decode_token_s(), now)
                if r.num_output_tokens >= r.max_new_tokens:
                    self._finish(i, Decision.FINISH_LENGTH, S.FINISHED_LENGTH)
                elif r.decode_worker_id == r.prefill_worker_id:
                    self._move(i, S.DECODING, Decision.START_DECODE, "tick")
                else:
                    a.ready_tick = self.tick + 1
                    self._move(i, S.TRANSFERRING, Decision.START_TRANSFER, "tick")
            elif phase[i] is S.TRANSFERRING and r.state is S.TRANSFERRING \
                    and a.ready_tick <= self.tick:
                self._move(i, S.DECODING, Decision.START_DECODE, "tick")
            elif phase[i] is S.DECODING and r.state is S.DECODING:
                self._decode(i)
            elif r.state is S.PREEMPTED and a.migrate_to >= 0:
                a.migrate_to = -1
                self._move(i, S.DECODING, Decision.RESUME_MIGRATE, "tick")
        waiting = [r for r in self.reqs if r.state in _WAITING]
        pol.tick(now, waiting)
        self.stepped = [False] * sc.num_workers
        self.at_tick_start = True
        self.last_stop = -1

    def _decode(self, i: int) -> None:
        sc = self.scope
        r = self.reqs[i]
        w = self._index(r.decode_worker_id)
        acct = self.accounts[w]
        k = min(sc.tokens_per_tick, r.max_new_tokens - r.num_output_tokens)
        short = r.num_blocks_needed(sc.block_size, k) - acct.blocks_of(r.req_id)
        if short > 0 and not acct.allocate(r.req_id, short):
            lack = short - acct.num_free - acct.num_cached
            plan = self.policy.on_kv_pressure(lack, self._victim_views(w, exclude=i), self.now,
                                               r.tier)
            if plan.victims:
                self._apply_plan(plan, r.req_id, "kv_pressure", r.tier)
            if r.state is not S.DECODING or not acct.allocate(r.req_id, short):
                return  # stalled this tick: no blocks to grow into
        r.num_output_tokens += k
        r.num_computed_tokens = r.num_context_tokens - 1
        self.policy.record_served(r.tier, k, k * self.ctx.est.decode_token_s(), self.now)
        if r.num_output_tokens >= r.max_new_tokens:
            self._finish(i, Decision.FINISH_LENGTH, S.FINISHED_LENGTH)

    def _stop(self, i: int) -> None:
        self._finish(i, Decision.FINISH_STOP, S.FINISHED_STOPPED)

    def _fail(self, w: int) -> None:
        self.num_failures += 1
        wid = self.infos[w].worker_id
        for i, r in enumerate(self.reqs):
            a = self.aux[i]
            touches = wid in (r.prefill_worker_id, r.decode_worker_id)
            if r.state is S.PREFILLING and (a.pinned_on == w or r.decode_worker_id == wid):
                self._drop_for_retry(i, w, Decision.WORKER_FAILED)
            elif r.state is S.TRANSFERRING and touches:
                self._drop_for_retry(i, w, Decision.TRANSFER_FAILED)
            elif r.state in (S.DECODING, S.PREEMPTING) and r.decode_worker_id == wid:
                self._move(i, S.ABORTED, Decision.WORKER_FAILED, "worker_failure")
            elif r.state is S.PREEMPTED and (a.migrate_to == w or (
                    a.swapped and r.decode_worker_id == wid)):
                # The swap copy or the migration target is gone: recompute.
                if a.migrate_to == w:
                    a.migrate_to = -1
                a.swapped = False
                r.num_computed_tokens = 0
        self.accounts[w] = self.account_factory(wid, self.scope.blocks_per_worker)
        self.prefix[w] = PrefixIndex(self.scope.blocks_per_worker)

    def _drop_for_retry(self, i: int, failed: int, decision: Decision) -> None:
        r = self.reqs[i]
        d = self._index(r.decode_worker_id)
        if not self._move(i, S.PREEMPTED, decision, "worker_failure"):
            return
        if d >= 0 and d != failed:
            self.accounts[d].release(r.req_id)
        if self.aux[i].pinned_on != failed:
            self._unpin(i)
        self.aux[i].pinned_on = -1
        self.aux[i].swapped = False
        r.num_computed_tokens = 0

    # -- invariants --------------------------------------------------------

    def check(self, clock_moved: bool = True) -> list[Violation]:
        """Every hard invariant on the current state. Waits only grow when the clock
        moves (a request that starts waiting has waited 0), so ``clock_moved=False``
        skips the starvation bound."""
        out = check_kv_budget(self.accounts)
        out += self._check_ownership()
        out += check_shares(self.policy.shares)
        for r, a in zip(self.reqs, self.aux, strict=True):
            out += self._check_new_records(r, a)
        if not clock_moved:
            return out
        out += check_starvation(self.reqs, self.now, self.tiers)
        for r in self.reqs:
            if r.state in _WAITING:
                waited = self.now - (r.history[-1].time if r.history else r.arrival_time)
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
        by_id: dict[str, tuple[Request, Aux]] | None = None
        for w, acct in enumerate(self.accounts):
            wid = self.infos[w].worker_id
            for req_id, n in acct.owned.items():
                if by_id is None:
                    by_id = {r.req_id: (r, a) for r, a in zip(self.reqs, self.aux, strict=True)}
                entry = by_id.get(req_id)
                ok = entry is not None and entry[0].decode_worker_id == wid and (
                    entry[0].state in _HOLDS_BLOCKS or entry[1].migrate_to == w)
                if not ok or n <= 0:
                    state = entry[0].state.value if entry else "unknown"
                    out.append(Violation(Invariant.KV_BUDGET,
                                         f"{wid}: {n} blocks owned by {req_id} ({state})"))
        for r, a in zip(self.reqs, self.aux, strict=True):
            if r.state in _HOLDS_BLOCKS:
                d = self._index(r.decode_worker_id)
                if d < 0 or self.accounts[d].blocks_of(r.req_id) <= 0:
                    out.append(Violation(Invariant.KV_BUDGET,
                                         f"{r.req_id} is {r.state.value} but holds no blocks"))
            if a.pinned_on >= 0:
                idx = self.prefix[a.pinned_on]
                lost = [h for h in r.block_hashes if h not in idx]
                if lost:
                    out.append(Violation(Invariant.KV_BUDGET,
                                         f"w{a.pinned_on} prefix index evicted blocks {lost} "
                                         f"pinned by {r.req_id} ({r.state.value})"))
        for p, idx in enumerate(self.prefix):
            if idx.num_cached > idx.capacity or idx.num_evictable > idx.num_cached:
                out.append(Violation(Invariant.KV_BUDGET,
                                     f"w{p} prefix index: {idx.num_cached} entries, "
                                     f"{idx.num_evictable} evictable, capacity {idx.capacity}"))
        return out
