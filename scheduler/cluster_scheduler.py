"""The cluster's scheduler: one plain, synchronous object every driver steps (DESIGN §2).

Submissions, worker reports, RPC results and the time go in; a :class:`Plan` of
dispatches, preemptions and aborts comes out. No I/O, no clock of its own: the global
scheduler actor applies plans with concurrent RPCs, the simulator against its cost model
and clock, the model checker by exploring them, so the policy measured in the simulator
is the policy that serves. What each worker's engine runs step by step is decided by the
same policy in :mod:`scheduler.step_planner`.

Life of a request here (STYLE.md item 7):

1. ``submit``: admission by the policy (accept into the wait queue, or reject with a
   retry-after; a rejection whose work ahead alone misses the target sheds its tier for
   a short window, so the routers can shed before any RPC; no feasible request is shed).
2. ``plan``: the wait queue offers requests in policy order; each gets a route (a prefill
   worker and a decode worker, or, in ``aggregated``/``auto`` mode, a prefill on the
   decode worker itself) and its decode blocks, within the policy's dispatch horizon
   (how much queued prefill work a worker may hold). No decode room: the policy may
   preempt lower tiers there (``PreemptOrder``) and the request waits. An ``on_pick``
   callback hears each plan's selection: whom the queue offered, in order, and the answer.
3. ``on_dispatch_result``: the decode worker reserved the blocks (QUEUED -> PREFILLING)
   or did not (back in the queue).
4. ``on_report``: the workers' events move the request (TRANSFERRING, DECODING,
   preempted, resumed, finished, aborted); free blocks, running requests, prefill
   progress, prefix-cache events and fitted step costs refresh the view.
5. ``abort`` / ``remove_worker``: ``AbortOrder`` for every worker that holds it; a
   request the cluster gave up on carries an error its router reports or retries. A dead
   prefill worker ends nothing here by itself: whether a request it prefilled still needs
   it (KV not all arrived) only its decode worker knows, so the driver asks that worker
   and ends what it dropped (``abort`` with ``worker_failed``).
6. ``adopt``: a scheduler that restarted rebuilds its view from what the decode workers
   say they hold as they register again; ``drop_unclaimed`` then ends the adopted
   requests whose router no longer waits on them.

Every state change goes through :func:`scheduler.request.transition` and reaches the
optional observer (metrics, traces, "why was my request late").
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from operator import itemgetter
from typing import Protocol

from scheduler.admission import AdmissionKind, LoadSnapshot, kv_release_rate
from scheduler.backlog import PrefillBook
from scheduler.claims import Claims
from scheduler.links import LinkModel
from scheduler.messages import (
    RETRYABLE_ERRORS,
    BlockEvent,
    HeldRequest,
    HeldStage,
    KVMemoryReport,
    LinkKind,
    ReqEvent,
    SubmitOutcome,
    WorkerEvent,
    WorkerReport,
)
from scheduler.placement import DecodeView, PrefillView
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptMode, VictimView
from scheduler.prefix_index import BlockRemoved, BlockStored, PrefixMirror
from scheduler.queues import OnPick, Pick, PickSite, Verdict, recording, unconsidered
from scheduler.request import (
    Decision,
    DecisionRecord,
    IllegalTransition,
    Request,
    RequestState,
    transition,
)
from scheduler.reserves import growth_blocks
from scheduler.step_costs import CPU_PRIOR, StepCosts
from scheduler.tiers import TierConfig
from scheduler.topology import LinkCosts, TopologyClass, WorkerInfo, topology_class

S = RequestState
D = Decision
# Longest a rejection sheds its tier before admission looks again.
SHED_WINDOW_S = 0.5
# Weight of a report's measured decode pace in a worker's running average.
PACE_ALPHA = 0.2
# A preemption order neither reported nor answered within this is forgotten.
PREEMPT_ANSWER_S = 2.0
# An abort that arrives before its request's submission (they travel separately) is kept
# this long, so the late submission is refused instead of queued with nobody to read it.
ABORT_MEMORY_S = 60.0


class PoolMode(enum.Enum):
    """Where prefills run (DESIGN §1: disaggregation is a decision, not a dogma)."""

    DISAGGREGATED = "disaggregated"  # on prefill workers, KV streamed to the decode worker
    AGGREGATED = "aggregated"  # on the decode worker itself
    AUTO = "auto"  # per request, whichever predicts the earlier first token


@dataclass(frozen=True, slots=True)
class NewRequest:
    req_id: str
    tier: int
    arrival_time: float
    prompt_len: int
    max_new_tokens: int
    block_hashes: tuple[int, ...] = ()
    router_id: str = ""


@dataclass(frozen=True, slots=True)
class Admission:
    outcome: SubmitOutcome
    reason: str = ""
    retry_after_s: float | None = None

    @property
    def accepted(self) -> bool:
        return self.outcome is SubmitOutcome.ACCEPTED


@dataclass(frozen=True, slots=True)
class DispatchOrder:
    """Reserve ``num_blocks`` on the decode worker and prefill there
    (``prefill_worker_id`` None) or on the prefill worker, which streams the KV over."""

    req_id: str
    decode_worker_id: str
    prefill_worker_id: str | None
    num_blocks: int
    move_class: TopologyClass


@dataclass(frozen=True, slots=True)
class PreemptOrder:
    """Preempt ``req_id`` on ``worker_id`` for ``for_req_id`` (None: give its blocks up
    because a migration of it failed); MIGRATE: it moves to ``target_worker_id``, where
    its blocks are promised until the target's report shows them reserved."""

    req_id: str
    worker_id: str
    mode: PreemptMode
    for_req_id: str | None
    target_worker_id: str | None = None


@dataclass(frozen=True, slots=True)
class AbortOrder:
    """Drop ``req_id`` on ``worker_ids``; ``error`` set: the cluster gave up on it and its
    router (``router_id``) reports or retries it."""

    req_id: str
    worker_ids: tuple[str, ...]
    error: str | None = None
    router_id: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    dispatches: tuple[DispatchOrder, ...] = ()
    preempts: tuple[PreemptOrder, ...] = ()
    aborts: tuple[AbortOrder, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.dispatches or self.preempts or self.aborts)


class SchedulerObserver(Protocol):
    """Who hears about decisions (metrics, logs, traces); must not call back in."""

    def on_decision(self, rec: DecisionRecord, tier: int) -> None: ...

    def on_closed(self, req: Request) -> None: ...

    def on_prefix_lookup(self, num_blocks: int, num_hit: int) -> None: ...


@dataclass(slots=True)
class _Pace:
    """Tokens the decoding requests of one report gained, and how many there were."""

    tokens: int = 0
    num: int = 0

    def add(self, grew: int) -> None:
        self.tokens += grew
        self.num += 1


@dataclass(slots=True)
class WorkerSlot:
    """The scheduler's view of one worker."""

    info: WorkerInfo
    can_prefill: bool
    can_decode: bool
    costs: StepCosts
    num_free_blocks: int
    is_alive: bool = True
    # Decode side: request -> blocks it holds (or is promised) here.
    held: dict[str, int] = field(default_factory=dict)
    # Prefill side: request -> prompt tokens still to compute here (with sums per tier).
    prefill_left: PrefillBook = field(default_factory=lambda: PrefillBook(1, 1))
    # Blocks promised by dispatches whose answer is not in yet.
    num_promised: int = 0
    # Preemptions ordered here whose event is not in yet: request -> blocks they free.
    # Until then the victims still look like decodes, and another plan must not order
    # more victims for the same need.
    preempting: dict[str, int] = field(default_factory=dict)
    # When each of those was ordered: an order the worker could not carry out (its victim
    # had just finished, say) is answered by on_preempt_result, or forgotten after this.
    preempting_since: dict[str, float] = field(default_factory=dict)
    # Its swap space and prefix cache as last reported (None: nothing reported yet).
    memory: KVMemoryReport | None = None
    # Decode side: request -> its blocks another request there holds too (a shared prefix).
    shared: dict[str, int] = field(default_factory=dict)
    # Tokens a second each of its decoding requests gains, as its reports show (an EWMA;
    # None: not seen yet), and when its last report with decodes came.
    decode_tokens_per_s: float | None = None
    last_pace_time: float | None = None
    # ``info.worker_id``, read on every placement for every worker (a field, not a property).
    worker_id: str = field(init=False, default="")

    def __post_init__(self) -> None:
        self.worker_id = self.info.worker_id

    def observe_pace(self, pace: _Pace, now: float) -> None:
        """A report's decodes gained ``pace.tokens`` over ``pace.num`` requests since the
        last such report: the measured speed each decoding request grows at."""
        last, self.last_pace_time = self.last_pace_time, (now if pace.num else None)
        if not pace.num or last is None or now <= last:
            return
        rate = pace.tokens / pace.num / (now - last)
        m = self.decode_tokens_per_s
        self.decode_tokens_per_s = rate if m is None else m + PACE_ALPHA * (rate - m)

    @property
    def swap_room(self) -> int | None:
        """Free blocks of its host swap space (None: not reported, unbounded)."""
        m = self.memory
        if m is None or m.num_swap_blocks is None:
            return None
        return max(m.num_swap_blocks - m.num_swap_used, 0)

    @property
    def free_blocks(self) -> int:
        return self.num_free_blocks - self.num_promised

    def backlog_s(self) -> float:
        return self.prefill_left.backlog_s(self.costs)

    def backlog_by_tier(self) -> tuple[float, ...]:
        """Queued prefill work (s) here per tier: what runs before a request of each tier."""
        return self.prefill_left.by_tier_s(self.costs)


@dataclass(slots=True)
class _Entry:
    req: Request
    router_id: str
    is_dispatching: bool = False
    dispatched_at: float = 0.0  # when the last dispatch order for it was made (0: never)
    move_class: TopologyClass | None = None
    num_blocks: int = 0
    # Rebuilt from a worker's registration after a restart of the scheduler, and not yet
    # claimed by its router (drop_unclaimed ends it if the router does not claim it).
    is_adopted: bool = False
    # Migrating to this decode worker (its blocks there are held for it) until the target
    # says it decodes there; ``migrate_promised``: not yet reserved there as far as the
    # target's reports show (counted in its ``num_promised``).
    migrate_to: str | None = None
    migrate_blocks: int = 0
    migrate_promised: bool = False
    # Its migration's target died: the source was told to recompute it; a refusal (the
    # source no longer has it) ends it with worker_failed.
    is_recovering: bool = False


@dataclass(slots=True)
class _DecodeBooks:
    """What placement reads of one decode worker's held requests: its DecodeView (release
    rate, growth, running count; its free blocks as last read) and, per tier, the blocks
    its preempted requests need to come back (``ClusterScheduler._resuming_of``).

    A function of the worker's held requests (their states, output counts and migrations),
    its measured pace, the cluster's output-length and step-cost estimates and the live
    decode workers. Recomputing it for every decode worker on every plan was most of a
    placement's time, while between two plans most workers change nothing: it is kept
    until one of those inputs changes (``ClusterScheduler._stale``), then rebuilt from
    scratch (so it is exactly what a recomputation gives; ``stale_views`` checks that)."""

    view: DecodeView
    resuming: tuple[int, ...]


class OutputLengths:
    """How many tokens requests generate, learned from the ones that finished (an EWMA per
    tier, and one over all tiers for a tier with none yet). ``max_new_tokens`` is only the
    client's budget: predicting with it would have every request hold its blocks until
    its budget runs out, many times longer than requests do."""

    ALPHA = 0.05

    def __init__(self, num_tiers: int) -> None:
        self._by_tier: list[float | None] = [None] * num_tiers
        self._all: float | None = None

    def observe(self, tier: int, num_output_tokens: int) -> None:
        n = float(max(num_output_tokens, 1))
        m = self._by_tier[tier]
        self._by_tier[tier] = n if m is None else m + self.ALPHA * (n - m)
        self._all = n if self._all is None else self._all + self.ALPHA * (n - self._all)

    def expected(self, req: Request) -> int:
        """Tokens ``req`` is expected to generate in all (its budget until any finished)."""
        m = self._by_tier[req.tier]
        if m is None:
            m = self._all
        if m is None:
            return req.max_new_tokens
        return max(1, min(req.max_new_tokens, round(m)))


class ClusterEstimate:
    """ServiceEstimate over the live workers' fitted step costs (prefill: the workers
    that prefill; decode: those that decode): the mean of their predictions."""

    def __init__(self, sched: ClusterScheduler, prior: StepCosts) -> None:
        self._sched = sched
        self._prior = prior
        # The workers each estimate averages over, by role (prefill: True), and the mean
        # of the prefill workers' coefficients: rebuilt when a worker joins or leaves or
        # reports new step costs (``invalidate``), not on every prediction.
        self._by_role: dict[bool, list[StepCosts]] = {}
        self._mean: tuple[float, ...] | None = None
        self._decode_token_s: float | None = None

    def invalidate(self) -> None:
        """The live workers or their fitted step costs changed."""
        self._by_role = {}
        self._mean = None
        self._decode_token_s = None

    def _pick(self, prefill: bool) -> list[StepCosts]:
        out = self._by_role.get(prefill)
        if out is None:
            out = [w.costs for w in self._sched.workers.values()
                   if w.is_alive and (w.can_prefill if prefill else w.can_decode)]
            out = self._by_role[prefill] = out or [self._prior]
        return out

    @property
    def coefficients(self) -> tuple[float, ...]:
        """The prefill workers' mean coefficients. Each prediction is linear in its
        coefficients (and every worker's StepCosts chunks alike, the cluster's
        ``chunk_tokens``), so the mean prediction is the prediction with these."""
        m = self._mean
        if m is None:
            coefs = [c.coefficients for c in self._pick(True)]
            k = len(coefs)
            m = self._mean = tuple(sum(c[i] for c in coefs) / k for i in range(3))
        return m

    def prefill_s(self, num_new_tokens: int, num_context_tokens: int) -> float:
        m = self.coefficients
        n = max(num_new_tokens, 0)
        steps = max(1, -(-n // self._prior.chunk_tokens))
        return steps * m[0] + n * m[1] + m[2] * n * (num_context_tokens + n / 2)

    def decode_token_s(self) -> float:
        if self._decode_token_s is None:
            cs = self._pick(False)
            self._decode_token_s = sum(c.decode_token_s() for c in cs) / len(cs)
        return self._decode_token_s


class ClusterScheduler:
    def __init__(self, tiers: TierConfig, policy: str | SchedulingPolicy, block_size: int,
                 link_costs: LinkCosts, *, mode: PoolMode = PoolMode.DISAGGREGATED,
                 cost_prior: Sequence[float] = CPU_PRIOR, chunk_tokens: int = 256,
                 local_prefill_max_tokens: int = 1024,
                 observer: SchedulerObserver | None = None,
                 on_pick: OnPick | None = None, migration: bool = False) -> None:
        """``on_pick``: called with each ``plan``'s dispatch selection (who got a worker,
        who was passed over) before the plan is returned; None records nothing.
        ``migration``: the driver moves requests between decode workers (MIGRATE orders
        with a target); without it victims are only swapped or recomputed.
        ``link_costs`` are the priors of :attr:`links`, which the workers' measured moves
        refine (``WorkerReport.memory.link_samples``)."""
        self.tiers = tiers
        self.block_size = block_size
        self.mode = mode
        self.cost_prior = tuple(cost_prior)
        self.chunk_tokens = chunk_tokens
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.observer = observer
        self.on_pick = on_pick
        self.workers: dict[str, WorkerSlot] = {}
        self.est = ClusterEstimate(self, self.new_costs())
        self.outputs = OutputLengths(tiers.num_tiers)
        self.links = LinkModel(link_costs)
        self.migration = migration
        self.policy: SchedulingPolicy = (
            policy if isinstance(policy, SchedulingPolicy)
            else make_policy(policy, PolicyContext(tiers, self.est, self.links, block_size)))
        self.queue = self.policy.make_queue()
        self.live: dict[str, _Entry] = {}
        self.mirror = PrefixMirror()
        self._shed_until = [float("-inf")] * tiers.num_tiers
        self._aborts: list[AbortOrder] = []
        self._preempts: list[PreemptOrder] = []
        self._last_tick = float("-inf")
        self._early_aborts: dict[str, float] = {}
        self._backlogs: dict[str, tuple[float, tuple[float, ...]]] = {}
        # The prompts waiting in ``queue``, with their work and blocks per tier (admission
        # reads them on every arrival).
        self._queued = PrefillBook(tiers.num_tiers, chunk_tokens, block_size)
        self.num_preemptions = 0
        # Per decode worker, what placement reads of its held requests (_DecodeBooks): kept
        # across plans, dropped by whatever changes them (``_stale``).
        self._books: dict[str, _DecodeBooks] = {}
        # Per decode worker, its release rate and victims as one plan sees them: every
        # request that finds no room asks, and under overload hundreds do. Dropped with
        # any dispatch or preemption the plan orders (a peer's room changes the prices).
        self._vviews: dict[str, tuple[float | None, tuple[VictimView, ...]]] = {}
        # Per anchor worker, the workers in its NVLink domain (victims are looked for
        # there first); rebuilt when a worker joins.
        self._same_domain: dict[str, frozenset[str]] = {}
        # The live prefill-only and decode workers (None: rebuild; a worker joined or died).
        self._prefill_list: list[WorkerSlot] | None = None
        self._decode_list: list[WorkerSlot] | None = None
        self._site_ids: list[str] | None = None
        # Work conservation at run time (``work_conservation_s``): per tier, the seconds
        # counted so far, and when the open episode began (None: none open).
        self.unplaced_fit_s = [0.0] * tiers.num_tiers
        self._unplaced_since: list[float | None] = [None] * tiers.num_tiers
        self._last_watch = float("-inf")

    def new_costs(self) -> StepCosts:
        return StepCosts(self.cost_prior, chunk_tokens=self.chunk_tokens)

    # -- workers ---------------------------------------------------------------------

    def add_worker(self, info: WorkerInfo, num_free_blocks: int, *, can_prefill: bool,
                   can_decode: bool) -> WorkerSlot:
        slot = WorkerSlot(info, can_prefill, can_decode, self.new_costs(), num_free_blocks,
                          prefill_left=PrefillBook(self.tiers.num_tiers, self.chunk_tokens))
        self.workers[info.worker_id] = slot
        self.est.invalidate()
        self._books.clear()  # their count of decode workers
        self._same_domain.clear()
        self._prefill_list = self._decode_list = self._site_ids = None
        return slot

    def remove_worker(self, worker_id: str, now: float) -> list[str]:
        """A worker died: every request decoding (or prefilling for itself) there ends with
        ``worker_failed`` (its router retries it by recompute on the live workers). Returns
        those request ids. Requests a dead prefill-only worker prefilled for another decode
        worker are left to that worker (``remove_worker`` cannot know whether their KV has
        arrived; the driver asks the decode worker and aborts what it dropped); dispatches
        in flight are answered by their decode worker as usual."""
        w = self.workers.get(worker_id)
        if w is None or not w.is_alive:
            return []
        w.is_alive = False
        self.est.invalidate()
        self._books.clear()
        self._prefill_list = self._decode_list = self._site_ids = None
        self.mirror.drop_worker(worker_id)
        lost = [rid for rid, e in self.live.items() if e.req.decode_worker_id == worker_id]
        for rid in lost:
            self._end(rid, now, D.WORKER_FAILED, f"worker:{worker_id}", error="worker_failed",
                      skip_worker=worker_id)
        for rid, e in list(self.live.items()):
            if e.migrate_to == worker_id:
                # It died before it took the request over: the source still has it (its
                # transfer fails too) and recomputes it there (DESIGN §7: a retry, not a hang).
                self._cancel_migration(e)
                e.is_recovering = True
                src = e.req.decode_worker_id
                if src is not None:
                    self._preempts.append(PreemptOrder(rid, src, PreemptMode.RECOMPUTE, None))
        return lost

    def waiting_on(self, prefill_worker_id: str) -> dict[str, list[str]]:
        """Per decode worker, the live requests prefilled on ``prefill_worker_id`` whose
        decode has not started as far as this view knows (their KV may still be on its way)."""
        out: dict[str, list[str]] = {}
        for rid, e in self.live.items():
            r = e.req
            if (r.prefill_worker_id == prefill_worker_id and r.decode_worker_id is not None
                    and r.decode_worker_id != prefill_worker_id and not e.is_dispatching
                    and r.state in (S.PREFILLING, S.TRANSFERRING)):
                out.setdefault(r.decode_worker_id, []).append(rid)
        return out

    def adopt(self, worker_id: str, held: HeldRequest) -> bool:
        """Rebuild a request a decode worker holds (it registered with a scheduler that
        restarted and lost its view). False: the id is already live, or the worker is not
        a registered decode worker."""
        w = self.workers.get(worker_id)
        spec = held.spec
        if w is None or not w.is_alive or not w.can_decode or spec.req_id in self.live:
            return False
        if not 0 <= spec.tier < self.tiers.num_tiers:
            return False
        state = {HeldStage.DECODING: S.DECODING, HeldStage.SWAPPED: S.PREEMPTED,
                 HeldStage.PREFILLING: S.PREFILLING}.get(held.stage)
        prefill_id = worker_id
        if held.stage is HeldStage.RECEIVING:
            state = S.PREFILLING if held.first_token_time is None else S.TRANSFERRING
            prefill_id = held.prefill_worker_id or worker_id
        if held.stage is HeldStage.PREFILLING and held.num_output_tokens > 0:
            state = S.PREEMPTED  # recomputing after a preemption here
        req = Request(spec.req_id, spec.tier, spec.arrival_time, len(spec.prompt_token_ids),
                      spec.sampling.max_tokens, state=state or S.DECODING,
                      num_output_tokens=held.num_output_tokens,
                      first_token_time=held.first_token_time,
                      prefill_worker_id=prefill_id, decode_worker_id=worker_id)
        self.live[spec.req_id] = _Entry(req, spec.router_id, is_adopted=True,
                                        num_blocks=held.num_blocks)
        w.held[spec.req_id] = held.num_blocks
        if held.stage is HeldStage.PREFILLING and held.num_prefill_left > 0:
            w.prefill_left.put(spec.req_id, held.num_prefill_left, spec.tier)
        self.est.invalidate()  # the worker's backlog changed
        self._books.clear()
        return True

    def drop_unclaimed(self, router_id: str, claimed: Iterable[str], now: float) -> list[str]:
        """``router_id`` said which of its requests it still waits on: its adopted requests
        it did not name end (nobody reads them); the named ones are its again."""
        keep = set(claimed)
        dropped = []
        for rid, e in list(self.live.items()):
            if not e.is_adopted or e.router_id != router_id:
                continue
            if rid in keep:
                e.is_adopted = False
            else:
                self._end(rid, now, D.CLIENT_GONE, f"router:{router_id}:unclaimed")
                dropped.append(rid)
        return dropped

    def _prefill_slots(self) -> list[WorkerSlot]:
        """The live prefill-only workers (kept until a worker joins or dies; callers do
        not change the list)."""
        if self._prefill_list is None:
            self._prefill_list = [w for w in self.workers.values() if w.is_alive
                                  and w.can_prefill and not w.can_decode]
        return self._prefill_list

    def _decode_slots(self) -> list[WorkerSlot]:
        """The live decode workers (kept as ``_prefill_slots``)."""
        if self._decode_list is None:
            self._decode_list = [w for w in self.workers.values() if w.is_alive and w.can_decode]
        return self._decode_list

    def _prefill_site_ids(self) -> list[str]:
        """The workers whose prefix hits placement reads: the prefill workers when
        disaggregated (a decode worker never prefills then), else every live worker
        (kept as ``_prefill_slots``)."""
        if self._site_ids is None:
            self._site_ids = (
                [w.worker_id for w in self._prefill_slots()]
                if self.mode is PoolMode.DISAGGREGATED
                else [w.worker_id for w in self.workers.values() if w.is_alive])
        return self._site_ids

    # -- requests --------------------------------------------------------------------

    def submit(self, nr: NewRequest, now: float) -> Admission:
        if nr.req_id in self.live:
            return Admission(SubmitOutcome.INVALID, "duplicate request id")
        if self._early_aborts.pop(nr.req_id, None) is not None:
            return Admission(SubmitOutcome.INVALID, "aborted before it was submitted")
        if not 0 <= nr.tier < self.tiers.num_tiers:
            return Admission(SubmitOutcome.INVALID, f"tier {nr.tier} is not configured")
        if not self._decode_slots() or (self.mode is PoolMode.DISAGGREGATED
                                        and not self._prefill_slots()):
            return Admission(SubmitOutcome.UNAVAILABLE, "no live prefill or decode worker")
        req = Request(nr.req_id, nr.tier, nr.arrival_time, nr.prompt_len, nr.max_new_tokens,
                      block_hashes=nr.block_hashes)
        need = -(-(nr.prompt_len + 1) // self.block_size)
        largest = max(w.info.num_kv_blocks for w in self._decode_slots())
        if need > largest:
            return Admission(SubmitOutcome.INVALID,
                             f"the prompt needs {need} KV blocks; the largest decode worker "
                             f"holds {largest}")
        if now < self._shed_until[nr.tier]:
            return self._reject(req, now, "shed", self._shed_until[nr.tier] - now)
        decision = self.policy.admit(req, now, self._load(full=self.policy.reads_load))
        if decision.kind is AdmissionKind.REJECT:
            retry = decision.retry_after_s or 1.0
            if decision.sheds_tier:
                # The work ahead alone misses this tier's target: its next arrivals would
                # be rejected too, so the routers may answer them without asking. Only
                # this tier: a later tier's target is judged on its own.
                until = now + min(retry, SHED_WINDOW_S)
                self._shed_until[nr.tier] = max(self._shed_until[nr.tier], until)
            return self._reject(req, now, decision.reason.value, retry)
        self.policy.record_demand(req.tier, req.prompt_len + self.outputs.expected(req), now)
        self.live[req.req_id] = _Entry(req, nr.router_id)
        self._enqueue(req, now)
        return Admission(SubmitOutcome.ACCEPTED)

    def _enqueue(self, req: Request, now: float) -> None:
        self.queue.push(req, now)
        self._queued.put(req.req_id, max(req.num_context_tokens, 1), req.tier)

    def _reject(self, req: Request, now: float, reason: str, retry_s: float) -> Admission:
        rec = transition(req, S.REJECTED, decision=D.REJECT,
                         triggered_by=f"admission:{reason}", now=now)
        if self.observer is not None:
            self.observer.on_decision(rec, req.tier)
            self.observer.on_closed(req)
        return Admission(SubmitOutcome.REJECTED, reason, retry_s)

    def shed_s_by_tier(self, now: float) -> tuple[float, ...]:
        """Per tier: how long new arrivals are shed for (0: admitted as usual)."""
        return tuple(max(0.0, t - now) for t in self._shed_until)

    def abort(self, req_id: str, now: float, decision: Decision = D.CLIENT_GONE,
              by: str = "router:abort", error: str | None = None) -> None:
        """End the request everywhere: its queue slot, its workers' blocks, its books. An
        unknown id is remembered for a while: its submission may still be on its way."""
        if req_id in self.live:
            self._end(req_id, now, decision, by, error=error)
            return
        self._early_aborts[req_id] = now
        if len(self._early_aborts) > 4096:
            self._early_aborts = {k: t for k, t in self._early_aborts.items()
                                  if now - t < ABORT_MEMORY_S}

    def get(self, req_id: str) -> Request | None:
        e = self.live.get(req_id)
        return None if e is None else e.req

    def waiting(self) -> list[Request]:
        return self.queue.requests()

    # -- the plan --------------------------------------------------------------------

    def plan(self, now: float) -> Plan:
        if now - self._last_tick >= self.tiers.control_interval_s:
            self._last_tick = now
            self.policy.tick(now, self.queue.requests())
        dispatches: list[DispatchOrder] = []
        # Each worker's queued prefill work and decode view, computed once per plan (a
        # dispatch to the worker recomputes them), not once per request offered.
        self._fresh_views()
        if len(self.queue):
            # Per decode worker, the requests that found no room there, each with the
            # blocks it claims (its need, up to what was free for it): blocks released for
            # a more urgent request do not go to less urgent ones that fit sooner, or a
            # large prompt would wait forever; the other workers' free blocks still serve
            # every tier (work conservation).
            blocked = Claims(self.tiers.num_tiers)

            def accept(req: Request) -> Verdict:
                order = self._route(req, now, blocked)
                if order is None:
                    return Verdict.SKIP if self.policy.skips_blocked else Verdict.STOP
                dispatches.append(order)
                self._queued.pop(req.req_id)
                return Verdict.TAKE

            if self.on_pick is None:
                self.queue.take(now, accept)
            else:
                candidates = self.queue.requests()
                offers: list[tuple[Request, Verdict]] = []
                self.queue.take(now, recording(accept, offers))
                self.on_pick(Pick(PickSite.DISPATCH, "", now, tuple(offers),
                                  unconsidered(candidates, offers)))
            if blocked.passed and self.policy.work_conserving:
                self._fill(now, dispatches)
        self._watch_conservation(now)
        aborts, self._aborts = self._aborts, []
        preempts, self._preempts = self._preempts, []
        return Plan(tuple(dispatches), tuple(preempts), tuple(aborts))

    # -- work conservation -------------------------------------------------------------

    def unplaced_fits(self) -> list[tuple[Request, str]]:
        """Waiting requests that the current view says fit a decode worker (its free
        blocks, less the blocks its preempted decodes and more urgent waiting requests
        claim there (``_usable``), less the policy's ``decode_reserve``) with a prefill
        site within the policy's dispatch horizon, each with that worker: right after a
        plan of a work-conserving policy there must be none
        (``scheduler.invariants.check_work_conservation``).

        Independent of how ``plan`` walks its queue: requests are taken by (tier, need),
        and each that does not fit claims what is free for it on the worker with the most
        (as ``_route`` does for a request it cannot place)."""
        return [(r, w.worker_id) for r, w in self._fits(Claims(self.tiers.num_tiers))
                if w is not None]

    def _fill(self, now: float, dispatches: list[DispatchOrder]) -> None:
        """After a plan's walk in which a dispatch took blocks that a claim it passed (a
        less urgent tier's, or its own tier's for a larger need) had counted on: that claim
        may now hold a worker that has no room for it while another has, and block a
        request that fits. Place, one at a time, what the independent look
        (``unplaced_fits``) finds fitting, under the claims that look made before it."""
        for _ in range(len(self.queue)):
            claims = Claims(self.tiers.num_tiers)
            first = next(((r, w) for r, w in self._fits(claims) if w is not None), None)
            if first is None:
                return
            order = self._route(first[0], now, claims)
            if order is None:
                return
            dispatches.append(order)
            self._queued.pop(first[0].req_id)
            self.queue.remove(first[0].req_id)

    def _fits(self, claims: Claims) -> Iterator[tuple[Request, WorkerSlot | None]]:
        """The waiting requests by (tier, need), each with a decode worker it fits (None:
        none; it then claims what is free for it on the worker with the most, in
        ``claims``, before the next is looked at)."""
        self._fresh_views()
        waiting = [r for r in self.queue.requests() if r.state is S.QUEUED
                   and r.req_id in self.live and not self.live[r.req_id].is_dispatching]
        if not waiting:
            return
        decode = self._decode_slots()
        remote = self._prefill_slots() if self.mode is not PoolMode.AGGREGATED else []
        if not decode or (self.mode is PoolMode.DISAGGREGATED and not remote):
            return
        bs = self.block_size
        # A worker's reserve for a tier does not depend on its free blocks: once per walk.
        reserves: dict[tuple[str, int], int] = {}
        for r in sorted(waiting, key=lambda r: (r.tier, r.num_context_tokens)):
            need = -(-(r.num_context_tokens + 1) // bs)
            horizon = self.policy.dispatch_horizon_s(r)
            fits = None
            room = []
            for w in decode:
                free = self._usable(w, r.tier, need, claims)
                room.append((free, w))
                if fits is not None:
                    continue
                key = (w.worker_id, r.tier)
                reserve = reserves.get(key)
                if reserve is None:
                    reserve = reserves[key] = self.policy.decode_reserve(r.tier, self._dview(w))
                if free - need < reserve:
                    continue
                sites = remote if self.mode is PoolMode.DISAGGREGATED else [*remote, w]
                if horizon is None or any(self._backlog(p)[0] <= horizon for p in sites):
                    fits = w
            if fits is None:
                self._claim(r.tier, need, room, claims)
            yield r, fits

    def _watch_conservation(self, now: float) -> None:
        """The runtime side of the invariant: per tier, the seconds past one planning
        interval that a waiting request fitted a worker and was not placed. Looked at once
        per planning interval, not after every plan (a plan follows every report and RPC
        answer, and the look walks the whole queue): an episode is seen at most one
        interval late and closed at most one late, as its length is counted past one
        interval."""
        if not self.policy.work_conserving:
            return
        if now - self._last_watch < self.tiers.control_interval_s:
            return
        self._last_watch = now
        tiers = {r.tier for r, _ in self.unplaced_fits()}
        step = self.tiers.control_interval_s
        for t in range(self.tiers.num_tiers):
            since = self._unplaced_since[t]
            if t in tiers:
                if since is None:
                    self._unplaced_since[t] = now
            elif since is not None:
                self.unplaced_fit_s[t] += max(now - since - step, 0.0)
                self._unplaced_since[t] = None

    def decode_reserves(self, worker_id: str) -> tuple[int, ...]:
        """Per tier, the blocks a request of that tier leaves free on decode worker
        ``worker_id`` now (the policy's ``decode_reserve``; for stats and progress)."""
        w = self.workers.get(worker_id)
        if w is None or not w.can_decode:
            return ()
        self._fresh_views()
        view = self._dview(w)
        return tuple(self.policy.decode_reserve(t, view) for t in range(self.tiers.num_tiers))

    def work_conservation_s(self, now: float) -> tuple[float, ...]:
        """Per tier, the seconds past one planning interval that a waiting request fitted
        a decode worker (free blocks less the policy's reserve, a prefill site with room)
        and was not placed, including an episode still open at ``now``."""
        step = self.tiers.control_interval_s
        return tuple(s + (0.0 if since is None else max(now - since - step, 0.0))
                     for s, since in zip(self.unplaced_fit_s, self._unplaced_since,
                                         strict=True))

    def _fresh_views(self) -> None:
        """Drop the views kept for one plan (backlogs, victims): every reader that starts
        from the current books calls this first. The decode workers' books are kept
        across plans (``_stale`` drops them as they change)."""
        self._backlogs, self._vviews = {}, {}

    def _stale(self, w: WorkerSlot) -> None:
        """``w``'s held requests, or what its books are computed from, changed."""
        self._books.pop(w.worker_id, None)

    def _stale_holders(self, rid: str) -> None:
        """Request ``rid`` changed (its state, output count or migration): every decode
        worker that holds it (its decode worker, a migration's target, a source whose
        report has not dropped it yet) recomputes its books."""
        for w in self.workers.values():
            if rid in w.held:
                self._books.pop(w.worker_id, None)

    def stale_views(self) -> list[str]:
        """The decode workers whose kept books differ from a recomputation now (empty:
        every kept view is current). For tests and idle integrity checks."""
        return [wid for wid, b in self._books.items()
                if (w := self.workers.get(wid)) is None
                or replace(b.view, num_free_blocks=0)
                != replace(self._new_books(w).view, num_free_blocks=0)
                or b.resuming != self._new_books(w).resuming]

    def _book(self, w: WorkerSlot) -> _DecodeBooks:
        got = self._books.get(w.worker_id)
        if got is None:
            got = self._books[w.worker_id] = self._new_books(w)
        return got

    def _new_books(self, w: WorkerSlot) -> _DecodeBooks:
        return _DecodeBooks(
            DecodeView(w.info, w.free_blocks, len(w.held), self._release_rate(w),
                       self._growth(w), max(len(self._decode_slots()), 1)),
            self._resuming_of(w))

    def _usable(self, w: WorkerSlot, tier: int, need: int, claims: Claims) -> int:
        """``w``'s free blocks for a request of ``tier`` needing ``need``: less what the
        requests that go before it claim there: the decodes preempted there of its tier
        or a more urgent one, to come back (:meth:`_resuming_of`), and the waiting requests
        of a more urgent tier whatever their size, of its tier no larger."""
        return w.free_blocks - self._book(w).resuming[tier] - claims.held(w.worker_id, tier, need)

    def _resuming_of(self, w: WorkerSlot) -> tuple[int, ...]:
        """Per tier t, the blocks that the requests of tiers up to t preempted on ``w``
        (swapped out, or to recompute there) need to come back: a new dispatch reserves
        its blocks at once, so without this claim the memory their preemption and the
        worker's releases free goes to new requests first and a preempted decode waits
        for seconds behind arrivals of its own tier or a later one (vLLM puts preempted
        requests first in its waiting queue). Kept in ``w``'s books."""
        by_tier = [0] * self.tiers.num_tiers
        bs = self.block_size
        for rid, blocks in w.held.items():
            e = self.live.get(rid)
            if e is None or e.req.state is not S.PREEMPTED or e.migrate_to is not None:
                continue
            r = e.req
            by_tier[r.tier] += blocks if blocks > 0 else -(-(r.num_context_tokens + 1) // bs)
        out, total = [], 0
        for n in by_tier:
            total += n
            out.append(total)
        return tuple(out)

    def _claim(self, tier: int, need: int, room: Iterable[tuple[int, WorkerSlot]],
               claims: Claims) -> None:
        """A request of ``tier`` needing ``need`` found no room: it claims what is free
        for it on the worker with the most (``room``: each decode worker's usable blocks
        for it)."""
        free, w = max(room, key=itemgetter(0))
        claims.add(w.worker_id, tier, need, max(min(need, free), 0))

    def _room(self, req: Request, need: int, decode: list[WorkerSlot],
              claims: Claims) -> list[tuple[int, WorkerSlot]]:
        return [(self._usable(w, req.tier, need, claims), w) for w in decode]

    def _decode_room(self, tier: int, need: int, decode: list[WorkerSlot], claims: Claims
                     ) -> tuple[list[tuple[int, WorkerSlot]], list[DecodeView]]:
        """Each decode worker's usable blocks for a request of ``tier`` needing ``need``
        (:meth:`_usable`, as ``_room`` gives them) and its view with those as its free
        blocks (:meth:`_dview`): one pass over the workers, for every request offered."""
        room: list[tuple[int, WorkerSlot]] = []
        views: list[DecodeView] = []
        books = self._books
        for w in decode:
            b = books.get(w.worker_id) or self._book(w)
            view = b.view
            free = w.num_free_blocks - w.num_promised
            if free != view.num_free_blocks:
                view = b.view = replace(view, num_free_blocks=free)
            usable = free - b.resuming[tier] - claims.held(w.worker_id, tier, need)
            room.append((usable, w))
            views.append(view if usable == free else replace(view, num_free_blocks=usable))
        return room, views

    def _route(self, req: Request, now: float, blocked: Claims) -> DispatchOrder | None:
        need = -(-(req.num_context_tokens + 1) // self.block_size)
        decode = self._decode_slots()
        remote = self._prefill_slots() if self.mode is not PoolMode.AGGREGATED else []
        if not decode or (self.mode is PoolMode.DISAGGREGATED and not remote):
            self._end(req.req_id, now, D.ERROR, "placement:no_worker",
                      error="no live prefill or decode worker")
            return None
        horizon = self.policy.dispatch_horizon_s(req)
        if horizon is not None:
            sites = remote if self.mode is PoolMode.DISAGGREGATED else [*remote, *decode]
            if all(self._backlog(w)[0] > horizon for w in sites):
                # Every worker that could prefill it holds its horizon of work already: it
                # waits here, and orders no preemption for decode memory it cannot use yet.
                return None
        matches = (self.mirror.match_lens(req.block_hashes, self._prefill_site_ids())
                   if req.block_hashes else {})
        if not remote:
            # Aggregated: the decode worker prefills too; pick by its queued prefill and
            # prefix hits among the workers the policy's decode placement accepts.
            ok = [self._pview(w, matches) for w in decode
                  if (horizon is None or self._backlog(w)[0] <= horizon)
                  and self.policy.place_decode(
                      req, need, [self._dview(w, self._usable(w, req.tier, need, blocked))],
                      w.info) is not None]
            lp = self.policy.place_prefill(req, ok) if ok else None
            if lp is None:
                self._claim(req.tier, need, self._room(req, need, decode, blocked), blocked)
                self._maybe_preempt(req, need, decode, decode[0].info, now)
                return None
            dslot, prefill_slot = self.workers[lp.info.worker_id], None
        else:
            # Only prefill workers within the horizon: one past it would turn the request
            # away while another has room.
            views = [self._pview(w, matches) for w in remote
                     if horizon is None or self._backlog(w)[0] <= horizon]
            if not views and self.mode is PoolMode.AUTO:
                views = [self._pview(w, matches) for w in remote]  # it may prefill locally
            pv = self.policy.place_prefill(req, views)
            if pv is None:
                return None
            room, dviews = self._decode_room(req.tier, need, decode, blocked)
            choice = self.policy.place_decode(req, need, dviews, pv.info)
            if choice is None:
                self._claim(req.tier, need, room, blocked)
                self._maybe_preempt(req, need, decode, pv.info, now)
                return None
            dslot = self.workers[choice.view.info.worker_id]
            prefill_slot = self._choose_prefill_site(req, dslot, self.workers[pv.info.worker_id],
                                                     matches, horizon)
        target = prefill_slot or dslot
        if horizon is not None and self._backlog(target)[0] > horizon:
            return None
        blocked.note_dispatch(dslot.worker_id, req.tier, need)
        target.prefill_left.put(req.req_id, max(req.num_context_tokens, 1), req.tier)
        self._backlogs.pop(target.worker_id, None)
        self._stale(dslot)
        self._vviews.clear()
        dslot.held[req.req_id] = need
        dslot.num_promised += need
        entry = self.live[req.req_id]
        entry.is_dispatching = True
        entry.dispatched_at = now
        entry.num_blocks = need
        cls = (topology_class(prefill_slot.info, dslot.info) if prefill_slot is not None
               else TopologyClass.SAME_DEVICE)
        entry.move_class = cls
        req.prefill_worker_id = prefill_slot.worker_id if prefill_slot is not None else dslot.worker_id
        req.decode_worker_id = dslot.worker_id
        if self.observer is not None:
            hit = matches.get(target.worker_id, 0)
            self.observer.on_prefix_lookup(len(req.block_hashes), min(hit, len(req.block_hashes)))
        return DispatchOrder(req.req_id, dslot.worker_id,
                             prefill_slot.worker_id if prefill_slot is not None else None,
                             need, cls)

    def _backlog(self, w: WorkerSlot) -> tuple[float, tuple[float, ...]]:
        """``w``'s queued prefill work, in all and per tier (kept for the plan)."""
        got = self._backlogs.get(w.worker_id)
        if got is None:
            got = self._backlogs[w.worker_id] = (w.backlog_s(), w.backlog_by_tier())
        return got

    def _pview(self, w: WorkerSlot, matches: dict[str, int]) -> PrefillView:
        got = self._backlog(w)
        return PrefillView(w.info, got[0], matches.get(w.worker_id, 0), got[1])

    def _dview(self, w: WorkerSlot, free: int | None = None) -> DecodeView:
        """``w`` as placement sees it (``free``: its usable free blocks, default all),
        with its measured release rate and step time (kept in its books)."""
        b = self._book(w)
        got = b.view
        if free is None:
            free = w.free_blocks
            if free != got.num_free_blocks:
                got = b.view = replace(got, num_free_blocks=free)
            return got
        return got if free == got.num_free_blocks else replace(got, num_free_blocks=free)

    def _choose_prefill_site(self, req: Request, dslot: WorkerSlot, rslot: WorkerSlot,
                             matches: dict[str, int], horizon: float | None = None
                             ) -> WorkerSlot | None:
        """The prefill worker, or None (``auto``) for a prefill on the decode worker itself
        when that predicts the earlier first token (short prompts, busy prefill pool); a
        site past the dispatch ``horizon`` only where the other is past it too."""
        if self.mode is PoolMode.DISAGGREGATED:
            return rslot
        if horizon is not None:
            over_r = self._backlog(rslot)[0] > horizon
            over_l = self._backlog(dslot)[0] > horizon
            if over_r != over_l:
                return None if over_r else rslot
        bs = self.block_size
        todo = req.num_context_tokens
        hit_r = min(matches.get(rslot.worker_id, 0) * bs, max(todo - 1, 0))
        hit_l = min(matches.get(dslot.worker_id, 0) * bs, max(todo - 1, 0))
        if todo - hit_l > self.local_prefill_max_tokens:
            return rslot
        cls = topology_class(rslot.info, dslot.info)
        move = self.policy.ctx.costs.move_s(-(-todo // bs), cls)
        remote_t = rslot.backlog_s() + rslot.costs.prefill_s(todo - hit_r, hit_r) + move
        # A local prefill shares the decode worker's steps with its decodes.
        share = 2.0 if dslot.held else 1.0
        local_t = (dslot.backlog_s() + dslot.costs.prefill_s(todo - hit_l, hit_l)) * share
        return None if local_t <= remote_t else rslot

    def _maybe_preempt(self, req: Request, need: int, decode: list[WorkerSlot],
                       anchor: WorkerInfo, now: float) -> None:
        same = self._same_domain.get(anchor.worker_id)
        if same is None:
            same = self._same_domain[anchor.worker_id] = frozenset(
                wid for wid, x in self.workers.items()
                if topology_class(anchor, x.info) is TopologyClass.SAME_DOMAIN)
        # The anchor's NVLink domain first, each part in the given order.
        ordered = ([w for w in decode if w.worker_id in same]
                   + [w for w in decode if w.worker_id not in same])
        for w in ordered:
            if w.preempting_since:
                for rid in [r for r, t in w.preempting_since.items()
                            if now - t > PREEMPT_ANSWER_S]:
                    w.preempting.pop(rid, None)
                    del w.preempting_since[rid]
                    self._vviews.clear()
            soon_free = w.num_free_blocks - w.num_promised  # w.free_blocks
            if w.preempting:
                soon_free += sum(w.preempting.values())
            if w.preempting and soon_free >= need:
                return  # victims ordered here already free enough: wait for them
            if not w.held:
                continue  # nothing runs here: no victims
            got = self._vviews.get(w.worker_id)
            if got is None:
                release = self._book(w).view.release_blocks_per_s
                got = self._vviews[w.worker_id] = (
                    release, tuple(self._victim_views(w, decode, release)))
            release, cands = got
            if not cands:
                continue
            wait = max(need - soon_free, 0) / release if release else None
            plan = self.policy.preempt_for(req, need, soon_free, cands, now, wait_s=wait)
            if plan is None or not plan.victims:
                continue
            for v in plan.victims:
                target = self.workers.get(v.peer_id or "") if self.migration else None
                e = self.live[v.req_id]
                if v.mode is PreemptMode.MIGRATE and target is not None and target.is_alive:
                    n = w.held.get(v.req_id, v.num_blocks)
                    target.held[v.req_id] = n
                    target.num_promised += n
                    self._stale(target)
                    e.migrate_to, e.migrate_blocks, e.migrate_promised = target.worker_id, n, True
                    order = PreemptOrder(v.req_id, w.worker_id, v.mode, req.req_id,
                                         target.worker_id)
                else:
                    mode = PreemptMode.RECOMPUTE if v.mode is PreemptMode.MIGRATE else v.mode
                    order = PreemptOrder(v.req_id, w.worker_id, mode, req.req_id)
                self._preempts.append(order)
                self._vviews.clear()
                w.preempting[v.req_id] = v.num_blocks
                w.preempting_since[v.req_id] = now
                # Anti-thrash: the kernel reads last_preempt_time before the report.
                e.req.last_preempt_time = now
            return

    def _victim_views(self, w: WorkerSlot, decode: list[WorkerSlot],
                      release: float | None) -> list[VictimView]:
        """``w``'s decoding requests as victims, priced by where their blocks are: the
        prefix blocks another request there shares (not freed, not recomputed), the room
        of ``w``'s swap space, how long until ``w`` could take it back, and (with
        migration) the peer decode worker it could move to now (the policy's
        ``place_migration``: the cheapest move to a worker with room), with the blocks
        the peer already caches. ``release``: ``w``'s :meth:`_release_rate`."""
        rids = [rid for rid in w.held if rid in self.live
                and self.live[rid].req.state is S.DECODING and rid not in w.preempting
                and self.live[rid].migrate_to is None]
        if not rids:
            return []
        peers = ([p for p in decode if p is not w and p.is_alive and not p.preempting]
                 if self.migration else [])
        out = []
        for rid in rids:
            r = self.live[rid].req
            n = w.held[rid]
            shared = min(w.shared.get(rid, 0), n)
            peer, room, cached = self._peer_for(r, n, w, peers)
            # Back in place only once w releases its blocks again (the arrival first).
            wait = n / release if release else self.est.decode_token_s() * self.outputs.expected(r)
            out.append(VictimView(r, w.info, n, num_shared_blocks=shared, peer=peer,
                                  peer_room=room, num_peer_cached=cached,
                                  swap_room=w.swap_room, wait_s=wait))
        return out

    def _growth(self, w: WorkerSlot) -> tuple[int, ...]:
        """Per tier t, the blocks the requests of tiers up to t that ``w`` holds add within
        one anti-thrash window at the pace its reports show, each up to its token budget
        (scheduler.reserves.growth_blocks): the growth that a request of tier t placed
        there could be preempted for (a less urgent grower gives way to it instead)."""
        pace = w.decode_tokens_per_s  # measured from its reports; else its step costs
        if pace is None:
            pace = 1.0 / max(w.costs.decode_token_s(), 1e-6)
        tokens = int(self.tiers.anti_thrash_s * pace)
        by_tier: list[list[tuple[int, int, int]]] = [[] for _ in range(self.tiers.num_tiers)]
        for rid, blocks in w.held.items():
            e = self.live.get(rid)
            # Reserved, prefilling or on its way here: it decodes (and grows) next.
            if e is not None and e.req.state not in (S.PREEMPTING, S.PREEMPTED):
                r = e.req
                by_tier[r.tier].append((r.num_context_tokens, blocks,
                                        r.max_new_tokens - r.num_output_tokens))
        out, total = [], 0
        for decodes in by_tier:
            total += growth_blocks(decodes, tokens=tokens, block_size=self.block_size)
            out.append(total)
        return tuple(out)

    def _release_rate(self, w: WorkerSlot) -> float | None:
        """Blocks per second ``w``'s decodes give back as they finish (as admission
        reads it): each its blocks once its expected output is done."""
        pairs = []
        for rid, blocks in w.held.items():
            e = self.live.get(rid)
            if e is not None and e.req.state is S.DECODING:
                left = self.outputs.expected(e.req) - e.req.num_output_tokens
                pairs.append((blocks, max(left, 1)))
        return kv_release_rate(pairs, self.est.decode_token_s())

    def _peer_for(self, req: Request, num_blocks: int, w: WorkerSlot,
                  peers: list[WorkerSlot]) -> tuple[WorkerInfo | None, int, int]:
        """(peer, its free blocks, the request's blocks it caches) for a move of ``req``
        off ``w``; (None, 0, 0) when no peer would take it now."""
        choice = self.policy.place_migration(req, num_blocks, [self._dview(p) for p in peers],
                                             w.info)
        if choice is None:
            return None, 0, 0
        p = self.workers[choice.view.info.worker_id]
        cached = (self.mirror.match_lens(req.block_hashes, [p.worker_id]).get(p.worker_id, 0)
                  if req.block_hashes else 0)
        return p.info, p.free_blocks, min(cached, num_blocks)

    def _cancel_migration(self, e: _Entry) -> None:
        """The migration of ``e`` will not happen (refused, failed, its target died): its
        target forgets the blocks held for it."""
        target = self.workers.get(e.migrate_to or "")
        if target is not None:
            target.held.pop(e.req.req_id, None)
            self._stale(target)
            if e.migrate_promised:
                target.num_promised = max(0, target.num_promised - e.migrate_blocks)
        e.migrate_to, e.migrate_blocks, e.migrate_promised = None, 0, False

    # -- results and reports ---------------------------------------------------------

    def on_preempt_result(self, req_id: str, worker_id: str, ok: bool, now: float = 0.0
                          ) -> None:
        """The worker's answer to a PreemptOrder; a refusal (the victim was no longer
        decoding there, or a migration's target would not take it) frees the need it was
        counted against and the blocks held on the target. A refused recovery (the source
        of a migration whose target died no longer has the request) ends it with
        ``worker_failed``: its router retries it."""
        w = self.workers.get(worker_id)
        if w is not None and not ok:
            w.preempting.pop(req_id, None)
            w.preempting_since.pop(req_id, None)
        e = self.live.get(req_id)
        if e is None or ok or e.req.decode_worker_id != worker_id:
            return
        if e.migrate_to is not None:
            self._cancel_migration(e)
        if e.is_recovering:
            self._end(req_id, now, D.WORKER_FAILED, f"worker:{worker_id}",
                      error="worker_failed")

    def on_dispatch_result(self, req_id: str, ok: bool, now: float, *,
                           num_free_blocks: int | None = None, num_cached_blocks: int = 0,
                           reason: str = "", fatal: bool = False) -> None:
        """The decode worker's answer; ``fatal``: the request can never run (ended with
        ``reason``), else a refusal puts it back in the queue."""
        e = self.live.get(req_id)
        if e is None or not e.is_dispatching:
            return
        e.is_dispatching = False
        req = e.req
        dslot = self.workers.get(req.decode_worker_id or "")
        if dslot is not None:
            dslot.num_promised = max(0, dslot.num_promised - e.num_blocks)
            if num_free_blocks is not None:
                dslot.num_free_blocks = num_free_blocks
        if ok:
            if dslot is not None and num_free_blocks is None:
                dslot.num_free_blocks -= e.num_blocks
            mem = 0.0 if dslot is None else 1.0 - dslot.free_blocks / max(dslot.info.num_kv_blocks, 1)
            self._move(req_id, S.PREFILLING, D.SCHEDULE_PREFILL, now,
                       f"placement:{req.prefill_worker_id}->{req.decode_worker_id}",
                       mem=mem, kv_reuse_hit=num_cached_blocks)
            return
        if fatal:
            e.is_dispatching = False
            req.prefill_worker_id = req.decode_worker_id = None
            # worker_failed: the prefill worker was gone; the router retries the request
            decision = D.WORKER_FAILED if reason in RETRYABLE_ERRORS else D.ERROR
            self._end(req_id, now, decision, f"dispatch:{reason}", error=reason or "refused")
            return
        # Refused (a stale view of its free blocks, or the worker is going away): requeue.
        self._stale_holders(req_id)
        for w in self.workers.values():
            w.prefill_left.pop(req_id)
            w.held.pop(req_id, None)
        req.prefill_worker_id = req.decode_worker_id = None
        self._enqueue(req, now)

    def on_report(self, rep: WorkerReport, now: float) -> None:
        w = self.workers.get(rep.worker_id)
        if w is None or not w.is_alive:
            return
        w.num_free_blocks = rep.num_free_blocks
        if rep.step_costs:
            w.costs.load_tuple(rep.step_costs)
            self.est.invalidate()
            self._books.clear()
        if rep.memory is not None:
            w.memory = rep.memory
            self._learn_links(w, rep.memory)
        for be in rep.block_events:
            self._apply_block_event(w.worker_id, be)
        for ev in rep.events:
            self._on_event(w, ev, now)
        # Running requests as the worker holds them (dispatches in flight keep theirs).
        if rep.is_complete:
            seen = {r.req_id for r in rep.running}
            for book in (w.prefill_left, w.held, w.shared):
                for rid in [rid for rid in book if rid not in seen]:
                    e = self.live.get(rid)
                    if e is None or not (e.is_dispatching or e.migrate_to == w.worker_id):
                        book.pop(rid)  # the worker no longer holds it
        pace = _Pace()
        for r in rep.running:
            e = self.live.get(r.req_id)
            if e is None:
                continue
            if e.migrate_promised and e.migrate_to == w.worker_id:
                # Reserved there now: the report's free blocks count them.
                w.num_promised = max(0, w.num_promised - e.migrate_blocks)
                e.migrate_promised = False
            if w.can_decode and r.req_id in w.held:
                w.held[r.req_id] = r.num_blocks
                if r.num_shared_blocks:
                    w.shared[r.req_id] = r.num_shared_blocks
                else:
                    w.shared.pop(r.req_id, None)
                grew = r.num_output_tokens - e.req.num_output_tokens
                if e.req.state is S.DECODING:
                    pace.add(max(grew, 0))
                if grew > 0:
                    e.req.num_output_tokens = r.num_output_tokens
                    self.policy.record_served(e.req.tier, grew, grew * self.est.decode_token_s(),
                                              now)
            w.prefill_left.put(r.req_id, r.num_prefill_left, e.req.tier)
        w.observe_pace(pace, now)
        # Its held requests and pace changed, and so may the requests it reports wherever
        # else they are held (a migration's other end).
        self._stale(w)
        touched = {r.req_id for r in rep.running}
        touched.update(ev.req_id for ev in rep.events)
        for x in self.workers.values():
            if x is not w and not touched.isdisjoint(x.held):
                self._stale(x)

    def _learn_links(self, w: WorkerSlot, mem: KVMemoryReport) -> None:
        """The moves ``w`` timed refine the link model the victims are priced with."""
        for s in mem.link_samples:
            if s.kind is LinkKind.MOVE:
                peer = self.workers.get(s.peer_worker_id)
                if peer is not None:
                    self.links.observe_move(topology_class(w.info, peer.info), s.num_bytes,
                                            s.seconds)
            else:
                self.links.observe_swap(s.num_bytes, s.seconds)

    def _apply_block_event(self, wid: str, be: BlockEvent) -> None:
        if be.stored:
            self.mirror.apply(wid, BlockStored(list(be.block_hashes), be.parent_hash))
        else:
            self.mirror.apply(wid, BlockRemoved(list(be.block_hashes)))

    def _on_event(self, w: WorkerSlot, ev: ReqEvent, now: float) -> None:
        rid = ev.req_id
        w.preempting.pop(rid, None)  # whatever it says, an order for it is answered
        w.preempting_since.pop(rid, None)
        e = self.live.get(rid)
        if e is None:
            return
        by = f"{'decode' if w.can_decode else 'prefill'}:{w.worker_id}"
        mem = 1.0 - w.free_blocks / max(w.info.num_kv_blocks, 1)
        kind = ev.event
        req = e.req
        if kind is WorkerEvent.PREFILL_DONE:
            for slot in self.workers.values():
                slot.prefill_left.pop(rid)
            if req.first_token_time is None:
                req.first_token_time = ev.time
                self._served_first_token(req, ev.time)
            req.num_output_tokens = max(req.num_output_tokens, 1)
            local = req.prefill_worker_id == req.decode_worker_id
            if local:
                self._move(rid, S.DECODING, D.START_DECODE, ev.time, by, mem=mem)
            else:
                self._move(rid, S.TRANSFERRING, D.START_TRANSFER, ev.time, by, mem=mem)
        elif kind is WorkerEvent.DECODE_START:
            self._move(rid, S.DECODING, D.START_DECODE, ev.time, by, mem=mem)
        elif kind in (WorkerEvent.FINISHED_STOP, WorkerEvent.FINISHED_LENGTH):
            if req.state is S.PREFILLING:
                pass  # first token was the last: PREFILLING -> FINISHED is allowed
            d = D.FINISH_LENGTH if kind is WorkerEvent.FINISHED_LENGTH else D.FINISH_STOP
            to = S.FINISHED_LENGTH if kind is WorkerEvent.FINISHED_LENGTH else S.FINISHED_STOPPED
            if req.state is S.TRANSFERRING:
                self._move(rid, S.DECODING, D.START_DECODE, ev.time, by, mem=mem)
            # Its last report's count: the tokens of the final step may be missing.
            self.outputs.observe(req.tier, max(req.num_output_tokens, 1))
            self._books.clear()  # every release rate reads the expected output lengths
            spec = self.tiers[req.tier]
            if spec.ttft_s is None and spec.e2e_s is not None:  # its milestone is the end
                self.policy.observe_latency(req.tier, ev.time - req.arrival_time, spec.e2e_s)
            self._move(rid, to, d, ev.time, by, mem=mem)
            self._close(rid)
        elif kind is WorkerEvent.PREEMPTED_MIGRATE:
            # The source handed the request off (its blocks are free): the target owns it
            # now, even before it says it decodes (if it dies first, the request ends with
            # worker_failed and its router retries it).
            w.held.pop(rid, None)
            if req.decode_worker_id == w.worker_id:
                if req.state is S.DECODING:
                    self._migrated_off(e, w, ev, mem)
                target = self.workers.get(ev.peer_worker_id)
                if target is None or not target.is_alive:
                    self._end(rid, now, D.WORKER_FAILED, f"worker:{ev.peer_worker_id}",
                              error="worker_failed")
                    return
                req.decode_worker_id = target.worker_id
                e.migrate_to = target.worker_id
        elif kind is WorkerEvent.RESUMED_MIGRATE:
            if req.state is not S.DECODING or req.decode_worker_id != w.worker_id:
                src = self.workers.get(req.decode_worker_id or "")
                if req.state is S.DECODING and src is not None:
                    self._migrated_off(e, src, ev, mem)  # the target's report came first
                self._cancel_promise(e, w)
                req.decode_worker_id = w.worker_id
                e.migrate_to, e.is_recovering = None, False
                self._move(rid, S.DECODING, D.RESUME_MIGRATE, ev.time, by, mem=mem)
        elif kind in (WorkerEvent.PREEMPTED_SWAP, WorkerEvent.PREEMPTED_RECOMPUTE):
            swap = kind is WorkerEvent.PREEMPTED_SWAP
            if e.migrate_to is not None and w.worker_id == req.decode_worker_id:
                self._cancel_migration(e)  # the source fell back: its migration failed
            e.is_recovering = False
            d = D.PREEMPT_SWAP if swap else D.PREEMPT_RECOMPUTE
            self.num_preemptions += 1
            blocker = ev.for_req_id
            why = f"{'preempt_for' if blocker else 'kv_pressure'}:{w.worker_id}"
            self._move(rid, S.PREEMPTING, d, ev.time, why, mem=mem, blocking=blocker)
            self._move(rid, S.PREEMPTED, D.PREEMPT_DONE, ev.time, why, mem=mem, blocking=blocker)
            w.held[rid] = 0 if not swap else w.held.get(rid, 0)
        elif kind is WorkerEvent.RESUMED_SWAP:
            self._move(rid, S.DECODING, D.RESUME_SWAP_IN, ev.time, by, mem=mem)
        elif kind is WorkerEvent.RESUMED_RECOMPUTE:
            if req.state is S.PREEMPTED:
                self._move(rid, S.DECODING, D.RESUME_RECOMPUTE, ev.time, by, mem=mem)
        elif kind is WorkerEvent.TRANSFER_FAILED:
            self._end(rid, now, D.TRANSFER_FAILED, by, error="transfer_failed",
                      skip_worker=None)
        elif kind is WorkerEvent.ABORTED:
            client = ev.reason == "reader_gone"
            self._end(rid, now, D.CLIENT_GONE if client else D.ERROR, by,
                      error=None if client else (ev.reason or "aborted"))

    def _migrated_off(self, e: _Entry, src: WorkerSlot, ev: ReqEvent, mem: float) -> None:
        """DECODING -> PREEMPTING -> PREEMPTED by migration off ``src``."""
        rid = e.req.req_id
        blocker = ev.for_req_id
        why = f"{'preempt_for' if blocker else 'kv_pressure'}:{src.worker_id}"
        self.num_preemptions += 1
        self._move(rid, S.PREEMPTING, D.PREEMPT_MIGRATE, ev.time, why, mem=mem, blocking=blocker)
        self._move(rid, S.PREEMPTED, D.PREEMPT_DONE, ev.time, why, mem=mem, blocking=blocker)

    def _cancel_promise(self, e: _Entry, target: WorkerSlot) -> None:
        if e.migrate_promised and e.migrate_to == target.worker_id:
            target.num_promised = max(0, target.num_promised - e.migrate_blocks)
        e.migrate_promised = False

    def _served_first_token(self, req: Request, t: float) -> None:
        """Fair share's feedback (DESIGN §5): the tier's TTFT against its target, and the
        prompt as served work (output tokens count as the reports show them)."""
        spec = self.tiers[req.tier]
        if spec.ttft_s is not None:
            self.policy.observe_latency(req.tier, t - req.arrival_time, spec.ttft_s)
        self.policy.record_served(req.tier, req.prompt_len,
                                  self.est.prefill_s(max(req.prompt_len, 1), 0), t)

    def on_router_finish(self, req_id: str, outcome: str, now: float, *,
                         num_output_tokens: int) -> None:
        """The router saw the request end: close it if no worker event did yet."""
        e = self.live.get(req_id)
        if e is None:
            return
        e.req.num_output_tokens = max(e.req.num_output_tokens, num_output_tokens)
        self._stale_holders(req_id)
        if outcome in ("stop", "length"):
            if e.req.state in (S.PREFILLING, S.TRANSFERRING) and e.req.num_output_tokens > 1:
                self._move(req_id, S.DECODING, D.START_DECODE, now, "router:finish")
            to = S.FINISHED_LENGTH if outcome == "length" else S.FINISHED_STOPPED
            d = D.FINISH_LENGTH if outcome == "length" else D.FINISH_STOP
            if e.req.state in (S.QUEUED,):
                self._end(req_id, now, D.ERROR, "router:finish")
                return
            self._move(req_id, to, d, now, "router:finish")
            self._close(req_id)
        else:
            self._end(req_id, now, D.CLIENT_GONE if outcome == "client_gone" else D.ERROR,
                      f"router:{outcome}")

    # -- internals -------------------------------------------------------------------

    def _end(self, rid: str, now: float, decision: Decision, by: str, *,
             error: str | None = None, skip_worker: str | None = None) -> None:
        e = self.live.get(rid)
        if e is None:
            return
        self.queue.remove(rid)
        self._queued.pop(rid)
        holders = tuple(w for w in {e.req.prefill_worker_id, e.req.decode_worker_id,
                                    e.migrate_to}
                        if w is not None and w != skip_worker
                        and self.workers.get(w) is not None and self.workers[w].is_alive)
        if holders or error is not None:
            self._aborts.append(AbortOrder(rid, holders, error, e.router_id))
        self._move(rid, S.ABORTED, decision, now, by)
        self._close(rid)

    def _move(self, rid: str, to: RequestState, decision: Decision, now: float, by: str, *,
              mem: float = 0.0, kv_reuse_hit: int = 0, blocking: str | None = None) -> None:
        e = self.live.get(rid)
        if e is None or e.req.state is to or e.req.state.is_finished:
            return
        try:
            rec = transition(e.req, to, decision=decision, triggered_by=by, now=now,
                             mem_pressure=mem, kv_reuse_hit=kv_reuse_hit,
                             blocking_req_id=blocking)
        except IllegalTransition:
            return  # a late event for a state already left
        self._stale_holders(rid)
        if self.observer is not None:
            self.observer.on_decision(rec, e.req.tier)

    def _close(self, rid: str) -> None:
        e = self.live.pop(rid, None)
        if e is None:
            return
        self.queue.remove(rid)
        self._queued.pop(rid)
        for w in self.workers.values():
            w.prefill_left.pop(rid)
            w.preempting.pop(rid, None)
            w.shared.pop(rid, None)
            if rid in w.held:
                self._stale(w)
                n = w.held.pop(rid)
                if e.is_dispatching or (e.migrate_promised and e.migrate_to == w.worker_id):
                    w.num_promised = max(0, w.num_promised - n)
        if self.observer is not None:
            self.observer.on_closed(e.req)

    def entries(self) -> Iterable[tuple[Request, str, TopologyClass | None]]:
        for e in self.live.values():
            yield e.req, e.router_id, e.move_class

    def router_of(self, req_id: str) -> str:
        e = self.live.get(req_id)
        return "" if e is None else e.router_id

    def _load(self, *, full: bool = True) -> LoadSnapshot:
        """What admission reads; without ``full`` only whether there is room now (the
        per-tier backlog and decode memory stay empty, for policies that never read them)."""
        n = self.tiers.num_tiers
        if not full:
            prefillers = (self._prefill_slots() if self.mode is PoolMode.DISAGGREGATED
                          else [w for w in self.workers.values() if w.is_alive])
            decode = self._decode_slots()
            room = (any(w.free_blocks > 0 for w in decode)
                    and any(not w.prefill_left for w in prefillers) and not len(self.queue))
            return LoadSnapshot([0.0] * n, max(len(prefillers), 1), room, block_size=self.block_size)
        est = self.est
        backlog = list(self._queued.by_tier_s(est))
        queued = list(self._queued.blocks_by_tier())
        prefillers = (self._prefill_slots() if self.mode is PoolMode.DISAGGREGATED
                      else [w for w in self.workers.values() if w.is_alive])
        for w in prefillers:
            backlog = [a + b for a, b in zip(backlog, w.backlog_by_tier(), strict=True)]
        held = [0] * n
        pairs = []
        num_free = 0
        decode = self._decode_slots()
        for w in decode:
            free = w.num_free_blocks - w.num_promised
            if free > 0:
                num_free += free
            for rid, blocks in w.held.items():
                e = self.live.get(rid)
                if e is not None:
                    held[e.req.tier] += blocks
                    pairs.append((blocks, self.outputs.expected(e.req)))
        idle = any(not w.prefill_left for w in prefillers)
        return LoadSnapshot(backlog, max(len(prefillers), 1),
                            num_free > 0 and idle and not len(self.queue), queued, held,
                            num_free, kv_release_rate(pairs, est.decode_token_s()),
                            self.block_size)


def event_kind_for_preempt(mode: PreemptMode) -> WorkerEvent:
    return WorkerEvent.PREEMPTED_SWAP if mode is PreemptMode.SWAP else WorkerEvent.PREEMPTED_RECOMPUTE


__all__ = ["Admission", "AbortOrder", "ClusterScheduler", "DispatchOrder", "NewRequest",
           "OutputLengths", "Plan", "PoolMode", "PreemptOrder", "ReqEvent", "SchedulerObserver", "WorkerSlot",
           "event_kind_for_preempt"]
