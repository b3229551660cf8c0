"""One decode worker's requests, decided in one pure object that serves, simulates and is
checked (issue 23): :class:`DecodeCore`.

The cluster's decisions live in :class:`~scheduler.cluster_scheduler.ClusterScheduler`;
a worker's live here. The core owns the worker's request table, one :class:`Stage` per
request, every move through :meth:`DecodeCore._move` (which records why), and the
worker's step planner (:class:`~scheduler.step_planner.WorkerScheduler`). Events come in
as method calls with the time (a dispatch, a first token, a transfer's progress, a
step's outputs, a preempt or migrate order); what the mechanism must do comes out as
typed answers (:class:`Release`, :class:`KVVerdict`, :class:`PreemptVerdict`,
:class:`SendVerdict`, the step plan). No I/O, no threads, no torch: the live decode worker
(``decode_pool/worker.py``) applies the answers to its engine, kvtransfer and RPC; the
simulator's decode worker (``scheduler/sim/workers.py``) to its block account and cost
model.

Life of a request on a decode worker, by stage::

    dispatch ──▶ RECEIVING ──(KV all here, first token known)──▶ DECODING ──▶ (finished)
         │           │  └─(first token was the last)──▶ DRAINING ──▶ (freed)
         │           └─(transfer failed, abort)──────▶ DRAINING
         └─────▶ PREFILLING (prefilled here) ──(prompt done)──▶ DECODING
    DECODING ──swap──▶ SWAPPED ──swap-in──▶ DECODING
    DECODING ──recompute──▶ PREFILLING (again: prompt + output) ──▶ DECODING
    DECODING ──migrate──▶ MIGRATING ──(KV all there)──▶ (handed off)
                              └─(refused: reattach)──▶ DECODING
                              └─(transfer failed, target lost)──▶ PREFILLING (recompute)
    migrate in ──▶ RECEIVING ──(KV all here)──▶ DECODING

DRAINING: the request is gone, its reserved blocks wait for its transfer to end (a
receive still posted may land in them), then are freed. A request leaves the table
(finished, aborted, handed off, drained) and its id is remembered (a tombstone) so a
dispatch that races its abort is refused.

The kernel's ``Request`` a core entry holds is this worker's copy; its ``state`` follows
the stage (:func:`request_state`), never set elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from scheduler.kv_ledger import KVCounters, MemoryLedger
from scheduler.links import LinkModel
from scheduler.messages import (
    BlockEvent,
    GenerationSpec,
    HeldRequest,
    HeldStage,
    LinkKind,
    MigrateIn,
    Prefilled,
    ReqEvent,
    RunningReq,
    TokenDelta,
    TransferStat,
    WorkerEvent,
    WorkerReport,
)
from scheduler.preemption import PreemptMode
from scheduler.request import Request, RequestState
from scheduler.step_planner import StepPlan, WorkerScheduler

# A router that stays unsubscribed this long loses its requests (its clients are gone).
ROUTER_GRACE_S = 10.0
# Ids of ended requests remembered so a dispatch that races its abort is refused.
TOMBSTONE_S = 60.0
# Events kept for the scheduler while its reports fail (it is restarting, say): the oldest
# beyond this go (a restarted scheduler learns what this worker holds from its hello).
MAX_UNREPORTED = 10_000
# Moves kept per request (``Entry.history``): enough to explain a request's life here.
MAX_HISTORY = 32


class Stage(enum.Enum):
    RECEIVING = "receiving"  # blocks reserved, KV arriving (a prefill worker's, or a migration's)
    PREFILLING = "prefilling"  # prefilled here: a local prefill, or a recompute
    DECODING = "decoding"
    SWAPPED = "swapped"  # its KV in host memory
    MIGRATING = "migrating"  # its KV is leaving for another decode worker
    DRAINING = "draining"  # gone; its reserved blocks freed once its transfer ends
    ENDED = "ended"  # left the worker (finished, aborted, handed off, drained)


_MOVES: dict[Stage | None, frozenset[Stage]] = {
    None: frozenset({Stage.RECEIVING, Stage.PREFILLING}),
    Stage.RECEIVING: frozenset({Stage.DECODING, Stage.DRAINING, Stage.ENDED}),
    Stage.PREFILLING: frozenset({Stage.DECODING, Stage.ENDED}),
    Stage.DECODING: frozenset({Stage.SWAPPED, Stage.PREFILLING, Stage.MIGRATING, Stage.ENDED}),
    Stage.SWAPPED: frozenset({Stage.DECODING, Stage.PREFILLING, Stage.ENDED}),
    Stage.MIGRATING: frozenset({Stage.DECODING, Stage.PREFILLING, Stage.ENDED}),
    Stage.DRAINING: frozenset({Stage.ENDED}),
    Stage.ENDED: frozenset(),
}


class IllegalMove(Exception):
    """A stage change the table does not allow: a bug in the core's caller."""


@dataclass(frozen=True, slots=True)
class Move:
    """One stage change of one request here, and why."""

    time: float
    frm: Stage | None
    to: Stage
    why: str


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The prefill worker's first token(s) of a request receiving its KV here."""

    token: int
    time: float
    finish: str | None  # it was also the last ("stop" | "length")
    deltas: tuple[TokenDelta, ...]  # one per sequence, as the router gets them


@dataclass(frozen=True, slots=True)
class Outbound:
    """A request leaving by migration: its KV is on the wire to ``target_id``."""

    target_id: str
    for_req_id: str | None
    num_computed: int


@dataclass(slots=True)
class Entry:
    """One request this worker holds."""

    req: Request  # this worker's kernel view (tier, progress) for the step planner
    stage: Stage | None = None
    spec: GenerationSpec | None = None  # None in the simulator (no tokens there)
    block_ids: tuple[int, ...] = ()  # RECEIVING / MIGRATING: the blocks its KV fills/leaves
    num_reserved: int = 0  # RECEIVING / MIGRATING: how many (the simulator has no ids)
    source: str | None = None  # RECEIVING: whose KV it waits for
    first: FirstToken | None = None
    migrated_in: MigrateIn | None = None  # RECEIVING by migration
    reserved_at: float = 0.0
    out: Outbound | None = None  # MIGRATING
    num_kept_blocks: int = 0  # MIGRATING: its blocks, should the migration be refused
    num_streamed: int = 0  # output tokens sent to the router
    is_recompute: bool = False  # PREFILLING again after a preemption
    # A recompute's first chunk started then, and the tokens of it the prefix cache held.
    restore_t0: float | None = None
    restore_cached: int = 0
    history: list[Move] = field(default_factory=list)

    @property
    def req_id(self) -> str:
        return self.req.req_id

    @property
    def router_id(self) -> str:
        return self.spec.router_id if self.spec is not None else ""

    def first_tokens(self) -> int | list[int]:
        """What the engine takes as the first token(s) when the request joins."""
        assert self.first is not None
        if len(self.first.deltas) > 1:
            return [d.token_ids[0] for d in self.first.deltas]
        return self.first.token


def request_state(e: Entry) -> RequestState:
    """The kernel state a stage stands for (the planner's orderings read it)."""
    st = e.stage
    if st is Stage.RECEIVING:
        return (RequestState.TRANSFERRING if e.first is not None or e.migrated_in is not None
                else RequestState.PREFILLING)
    if st is Stage.PREFILLING:
        return RequestState.PREEMPTED if e.is_recompute else RequestState.PREFILLING
    return {Stage.DECODING: RequestState.DECODING, Stage.SWAPPED: RequestState.PREEMPTED,
            Stage.MIGRATING: RequestState.PREEMPTING}.get(st, e.req.state)  # type: ignore[arg-type]


class Release(enum.Enum):
    """What a request leaving holds, for the mechanism to give back."""

    NOTHING = "nothing"
    END_TRANSFER = "end_transfer"  # its KV may still arrive: end the receive, free once ended
    STOP_SENDING = "stop_sending"  # its KV is leaving: stop the send, then free its blocks
    FREE = "free"  # its blocks (or swap slots) in the engine


class KVVerdict(enum.Enum):
    """A receiving request, after its transfer's progress."""

    WAIT = "wait"
    JOIN = "join"  # KV all here, first token known: the engine takes it over
    ENDED = "ended"  # its first token was its last: done, the reservation drains
    FAILED = "failed"  # the transfer failed: abort it (its router retries)
    DROPPED = "dropped"  # a migration in that failed: its source recomputes it, drain


class PreemptAction(enum.Enum):
    NONE = "none"  # nothing to do: the verdict's ``ok`` is the order's answer
    EVICT = "evict"  # swap out or recompute here, in ``eviction_order``
    MIGRATE = "migrate"  # detach it and move it with its KV to the order's target
    FALL_BACK = "fall_back"  # its migration will not complete: end it, recompute here


@dataclass(frozen=True, slots=True)
class PreemptVerdict:
    """What a preempt order (or the planner's own victim) comes to."""

    ok: bool | None  # None: act (see ``action``); True/False: the order's answer, nothing to do
    action: PreemptAction = PreemptAction.NONE


class SendVerdict(enum.Enum):
    WAIT = "wait"
    HANDOFF = "handoff"  # its KV is all there: free it here
    FALL_BACK = "fall_back"  # the move failed: recompute it here


@dataclass(frozen=True, slots=True)
class StepResult:
    """One request's outcome of a step, as the engine (or the simulator) saw it."""

    req_id: str
    delta: TokenDelta | None = None  # tokens to stream (None: none)
    finish: str | None = None  # "stop" | "length" when the sequence ended
    request_finished: bool = False  # every sequence ended: it leaves the engine
    error: str | None = None  # the step failed on this request alone (it left the engine)


def kernel_request(spec: GenerationSpec, block_hashes: tuple[int, ...] = ()) -> Request:
    """A worker's kernel view of a request from the wire (tier, sizes, arrival, and the
    prompt's block hashes its dispatch carries)."""
    return Request(spec.req_id, spec.tier, spec.arrival_time, len(spec.prompt_token_ids),
                   spec.sampling.max_tokens, block_hashes)


def eviction_order(mode: PreemptMode, forked: bool) -> tuple[PreemptMode, ...]:
    """The evictions to try, in order: a swap that does not fit the swap space falls back
    to a recompute; a forked request (sequences sharing blocks) is swapped or kept."""
    if forked:
        return (PreemptMode.SWAP,)
    if mode is PreemptMode.SWAP:
        return (PreemptMode.SWAP, PreemptMode.RECOMPUTE)
    return (PreemptMode.RECOMPUTE,)


class DecodeCore:
    """A decode worker's request table, its step planner and what it reports."""

    def __init__(self, worker_id: str, planner: WorkerScheduler, *, bytes_per_block: int = 0,
                 links: LinkModel | None = None, can_migrate: bool = False,
                 history: bool = True) -> None:
        """``history``: keep each request's last moves (the checker, which merges states
        that differ only in how they came about, keeps none)."""
        self.worker_id = worker_id
        self.keeps_history = history
        self.planner = planner
        self.links = links
        self.can_migrate = can_migrate
        self.ledger = MemoryLedger(bytes_per_block)
        self.entries: dict[str, Entry] = {}
        self._tombstones: dict[str, float] = {}
        # Report contents gathered since the last report.
        self.events: list[ReqEvent] = []
        self.block_events: list[BlockEvent] = []
        self.transfers: list[TransferStat] = []
        self.report_due = False  # something the scheduler should hear before the interval
        # Token deltas per router not yet delivered, and the routers streaming from here.
        self.outbox: dict[str, list[TokenDelta]] = {}
        self.subscribed: set[str] = set()
        self._unsubscribed_since: dict[str, float] = {}
        self._shared: dict[str, int] = {}  # request -> its leading blocks others hold too
        self._moved_to: dict[str, str] = {}  # migrated away -> its target (link samples)
        self._protected: frozenset[int] = frozenset()
        self.num_steps = 0
        self.step_seconds = 0.0  # in steps since the process started (WorkerReport)
        # The last plan had nothing to run (waiting for room or a transfer): steps are not
        # due, so a still step count is no stall (WorkerReport.is_busy).
        self.plan_was_empty = False

    def records(self) -> tuple[object, ...]:
        """What the core keeps that no plan reads: the tombstones of ended ids and the
        ledger of measured moves (the checker leaves them out of a state's identity)."""
        return (self._tombstones, self.ledger)

    # -- the table -----------------------------------------------------------------------

    def _move(self, e: Entry, to: Stage, why: str, now: float) -> None:
        """The one place a request changes stage here."""
        if to not in _MOVES[e.stage]:
            raise IllegalMove(f"{e.req_id}: {e.stage} -> {to.value} ({why})")
        if self.keeps_history:
            e.history.append(Move(now, e.stage, to, why))
            if len(e.history) > MAX_HISTORY:
                del e.history[0]
        e.stage = to
        if to is Stage.ENDED:
            self.entries.pop(e.req_id, None)
            return
        self.entries[e.req_id] = e
        e.req.state = request_state(e)

    def get(self, req_id: str) -> Entry | None:
        e = self.entries.get(req_id)
        return None if e is None or e.stage is Stage.DRAINING else e

    def ids(self, stage: Stage) -> list[str]:
        return [rid for rid, e in self.entries.items() if e.stage is stage]

    def live(self) -> Iterator[Entry]:
        return (e for e in self.entries.values() if e.stage is not Stage.DRAINING)

    @property
    def num_requests(self) -> int:
        return sum(1 for _ in self.live())

    def is_waiting(self) -> bool:
        """Something here waits on a transfer (the step loop polls sooner)."""
        return any(e.stage in (Stage.RECEIVING, Stage.MIGRATING, Stage.DRAINING)
                   for e in self.entries.values())

    def has_work(self) -> bool:
        return self.planner.has_work()

    def _event(self, req_id: str, kind: WorkerEvent, now: float, *, for_req_id: str | None = None,
               reason: str = "", peer_worker_id: str = "") -> None:
        self.events.append(ReqEvent(req_id, kind, now, for_req_id, reason, peer_worker_id))

    # -- arrivals ------------------------------------------------------------------------

    def refusal(self, req_id: str) -> str | None:
        """Why a dispatch (or a migration in) of ``req_id`` is refused before anything is
        reserved; the room a preemption freed for it is its own from now on."""
        self.planner.release_hold(req_id)
        if req_id in self.entries or req_id in self._tombstones:
            return "known id"
        return None

    def receive(self, req: Request, block_ids: tuple[int, ...], source: str, now: float, *,
                spec: GenerationSpec | None = None, migrated_in: MigrateIn | None = None,
                num_blocks: int | None = None) -> Entry:
        """Blocks are reserved for ``req``'s KV (``block_ids``, or ``num_blocks`` of them),
        which comes from ``source`` (its prefill worker, or the decode worker it migrates
        from)."""
        e = Entry(req, spec=spec, block_ids=block_ids, source=source, migrated_in=migrated_in,
                  reserved_at=now,
                  num_reserved=len(block_ids) if num_blocks is None else num_blocks)
        if migrated_in is not None:
            outs = migrated_in.output_token_ids
            e.first = FirstToken(outs[-1], migrated_in.first_token_time or now, None, ())
            e.num_streamed = len(outs)
            req.num_output_tokens = len(outs)
            req.first_token_time = migrated_in.first_token_time
            self.report_due = True  # the scheduler's view of this worker's blocks
        self._move(e, Stage.RECEIVING, "migrated_in" if migrated_in else "dispatched", now)
        self._watch(e.router_id, now)
        return e

    def prefill_here(self, req: Request, num_blocks: int, num_cached_tokens: int, now: float, *,
                     spec: GenerationSpec | None = None) -> Entry:
        """``req`` is admitted to this worker's engine with ``num_blocks``; its prompt is
        prefilled here (``num_cached_tokens`` of it the prefix cache holds)."""
        e = Entry(req, spec=spec, reserved_at=now)
        self._move(e, Stage.PREFILLING, "prefill_here", now)
        self._watch(e.router_id, now)
        lr = self.planner.add_prefill(req, req.prompt_len - num_cached_tokens, now,
                                      num_computed=num_cached_tokens)
        lr.num_blocks = num_blocks
        return e

    @staticmethod
    def migration_refusal(msg: MigrateIn) -> str | None:
        if not msg.output_token_ids or msg.num_computed < 1:
            return "invalid: nothing decoded yet"
        return None

    # -- first tokens and transfers ------------------------------------------------------

    def first_token(self, item: Prefilled, now: float) -> bool:
        """The prefill worker's first token of a request receiving here; False: the prefill
        failed on it (``item.error``): the mechanism aborts it with that error."""
        e = self.get(item.req_id)
        if e is None or e.stage is not Stage.RECEIVING or e.migrated_in is not None:
            return True
        if item.error is not None:  # its prefill failed on it alone: no KV will come
            self._event(item.req_id, WorkerEvent.ABORTED, now, reason="step_failed")
            return False
        deltas = item.deltas or (TokenDelta(item.req_id, (item.first_token,)),)
        e.first = FirstToken(item.first_token, item.time or now, item.finish, deltas)
        e.req.state = request_state(e)
        e.req.first_token_time = e.first.time
        e.req.num_output_tokens = 1
        if item.finish is None:
            for d in deltas:  # the first tokens do not depend on the transfer: out now (TTFT)
                self.emit(e, d)
        return True

    def kv_progress(self, req_id: str, arrived: bool | None, now: float) -> KVVerdict:
        """A receiving request and its transfer: ``arrived`` None (in flight), True (all
        here) or False (failed or aborted)."""
        e = self.get(req_id)
        if e is None or e.stage is not Stage.RECEIVING:
            return KVVerdict.WAIT
        if e.migrated_in is not None:
            if arrived is False:  # its source still owns it and recomputes it
                self._move(e, Stage.DRAINING, "migration_failed", now)
                return KVVerdict.DROPPED
            return KVVerdict.JOIN if arrived else KVVerdict.WAIT
        if e.first is not None and e.first.finish is not None:
            # The first token was the last: no decode, the reserved slots go back.
            self._move(e, Stage.DRAINING, "first_token_was_last", now)
            self.emit(e, replace(e.first.deltas[0], finish=e.first.finish))
            self._event(req_id, WorkerEvent.FINISHED_LENGTH if e.first.finish == "length"
                        else WorkerEvent.FINISHED_STOP, now)
            return KVVerdict.ENDED
        if arrived is False:
            self._event(req_id, WorkerEvent.TRANSFER_FAILED, now)
            return KVVerdict.FAILED
        if e.first is None or not arrived:
            return KVVerdict.WAIT
        return KVVerdict.JOIN

    def joined(self, req_id: str, now: float) -> None:
        """The engine took over a request whose KV all arrived: it decodes from now on."""
        e = self.entries[req_id]
        msg = e.migrated_in
        self._move(e, Stage.DECODING, "kv_arrived", now)
        if msg is None:
            self.planner.add_decode(e.req, e.req.prompt_len, e.num_reserved)
            self._event(req_id, WorkerEvent.DECODE_START, now)
            return
        self.planner.add_decode(e.req, msg.num_computed, e.num_reserved)
        self._event(req_id, WorkerEvent.RESUMED_MIGRATE, now)
        self.ledger.restored(req_id, PreemptMode.MIGRATE, now - e.reserved_at, msg.from_worker_id)
        # Everything streamed so far, again, from index 0: the router keeps only what the
        # source's stream has not brought it yet.
        self.outbox.setdefault(e.router_id, []).append(
            TokenDelta(req_id, msg.output_token_ids, start=0))
        self.report_due = True

    def cannot_join(self, req_id: str, why: str, now: float) -> str:
        """The engine cannot take over a request whose KV arrived (it can never decode
        here): it ends alone; the error its router hears (it retries by recompute)."""
        e = self.entries[req_id]
        migrated = e.migrated_in is not None
        self._event(req_id, WorkerEvent.ABORTED, now,
                    reason="worker_failed" if migrated else "invalid")
        return "worker_failed" if migrated else f"invalid: {why}"

    def drained(self, req_id: str, now: float) -> None:
        """The transfer into a draining reservation ended: its blocks are free."""
        e = self.entries.get(req_id)
        if e is not None and e.stage is Stage.DRAINING:
            self._move(e, Stage.ENDED, "drained", now)

    def lost_source(self, source: str, req_ids: Iterable[str] | None,
                    arrived: Callable[[str], bool | None]) -> list[str]:
        """``source`` died: the requests (all, or ``req_ids``) still receiving from it whose
        KV or first token has not arrived (the mechanism aborts them, ``worker_failed``);
        those whose KV is all here join the decode batch next step."""
        wanted = None if req_ids is None else set(req_ids)
        out = []
        for e in list(self.live()):
            if (e.stage is not Stage.RECEIVING or e.source != source
                    or (wanted is not None and e.req_id not in wanted)):
                continue
            if e.first is not None and arrived(e.req_id) is True:
                continue
            out.append(e.req_id)
        return out

    # -- ends ----------------------------------------------------------------------------

    def abort(self, req_id: str, now: float, error: str | None = None) -> Release:
        """Drop the request; ``error`` set: its router hears it (and may retry)."""
        self._tombstones[req_id] = now
        e = self.get(req_id)
        if e is None:
            return Release.NOTHING
        self.planner.remove(req_id)
        release = {Stage.RECEIVING: Release.END_TRANSFER,
                   Stage.MIGRATING: Release.STOP_SENDING}.get(e.stage, Release.FREE)  # type: ignore[arg-type]
        self._move(e, Stage.DRAINING if release is Release.END_TRANSFER else Stage.ENDED,
                   "abort" if error is None else f"abort:{error}", now)
        if error is not None:
            self.emit(e, TokenDelta(req_id, (), error=error))
        return release

    def abandon(self, req_id: str, now: float) -> Release:
        """A dispatch that did not start (its prefill worker refused it or is gone): its
        reservation goes, no tombstone (the scheduler may place it again)."""
        e = self.get(req_id)
        if e is None:
            return Release.NOTHING
        self._move(e, Stage.DRAINING, "start_refused", now)
        return Release.END_TRANSFER

    def fail(self, req_id: str, reason: str, now: float) -> bool:
        """The request cannot go on here (``reason`` for the scheduler); True when it was
        here (the mechanism aborts it with its error)."""
        if self.get(req_id) is None:
            return False
        self._event(req_id, WorkerEvent.ABORTED, now, reason=reason)
        return True

    def expire(self, now: float) -> list[str]:
        """Forget old tombstones; the requests of a router gone for ROUTER_GRACE_S (the
        mechanism aborts them)."""
        for rid in [r for r, t in self._tombstones.items() if now - t > TOMBSTONE_S]:
            del self._tombstones[rid]
        gone = []
        for router_id, since in list(self._unsubscribed_since.items()):
            if now - since < ROUTER_GRACE_S:
                continue
            del self._unsubscribed_since[router_id]
            self.outbox.pop(router_id, None)
            for e in list(self.live()):
                if e.router_id == router_id:
                    self._event(e.req_id, WorkerEvent.ABORTED, now, reason="reader_gone")
                    gone.append(e.req_id)
        return gone

    # -- preemption ----------------------------------------------------------------------

    def preempt_order(self, req_id: str, mode: PreemptMode, target: str | None
                      ) -> PreemptVerdict:
        """A preempt order (the scheduler's, or this worker's own victim with no target):
        what the mechanism does. A recompute order for a request whose migration is under
        way (its target died) ends the migration and recomputes it here; for one
        recomputing here already it is done."""
        e = self.get(req_id)
        if e is not None and mode is PreemptMode.RECOMPUTE:
            if e.stage is Stage.MIGRATING:
                return PreemptVerdict(None, PreemptAction.FALL_BACK)
            if e.stage is Stage.PREFILLING and e.is_recompute:
                return PreemptVerdict(True)
        if e is None or e.stage is not Stage.DECODING:
            return PreemptVerdict(False)
        if mode is PreemptMode.MIGRATE:
            if not self.can_migrate or not target:
                return PreemptVerdict(False)
            return PreemptVerdict(None, PreemptAction.MIGRATE)
        return PreemptVerdict(None, PreemptAction.EVICT)

    def victims(self, plan: StepPlan) -> list[tuple[str, PreemptMode]]:
        """The planner's own victims, each with how it goes (swap, else recompute)."""
        return [(v.req_id, v.mode if v.mode is PreemptMode.SWAP else PreemptMode.RECOMPUTE)
                for v in plan.preempt]

    def evicted(self, req_id: str, done: PreemptMode | None, for_req_id: str | None, now: float,
                *, num_blocks: int = 0, seconds: float = 0.0, num_freed: int = 0) -> bool:
        """The mechanism evicted the request (``done``: how; None: it could not): its
        blocks are free; those freed for ``for_req_id`` are held for it."""
        e = self.get(req_id)
        if e is None:
            return False
        e.req.last_preempt_time = now
        if done is None:
            return False
        e.req.num_preemptions += 1
        why = f"preempt_for:{for_req_id}" if for_req_id else "kv_pressure"
        if done is PreemptMode.SWAP:
            self.ledger.swapped(LinkKind.SWAP_OUT, num_blocks, seconds)
            self._learn_swap(num_blocks, seconds)
            self._move(e, Stage.SWAPPED, why, now)
            self.planner.swap_out(req_id)
            self._event(req_id, WorkerEvent.PREEMPTED_SWAP, now, for_req_id=for_req_id)
        else:
            e.is_recompute = True
            self._move(e, Stage.PREFILLING, why, now)
            self.planner.recompute(req_id, now)
            self._event(req_id, WorkerEvent.PREEMPTED_RECOMPUTE, now, for_req_id=for_req_id)
        self._hold(for_req_id, num_freed, now)
        return True

    def swapped_in(self, req_id: str, num_blocks: int, seconds: float, now: float) -> None:
        e = self.entries[req_id]
        self._move(e, Stage.DECODING, "swap_in", now)
        self.planner.swapped_in(req_id, num_blocks)
        self._event(req_id, WorkerEvent.RESUMED_SWAP, now)
        self.ledger.swapped(LinkKind.SWAP_IN, num_blocks, seconds)
        self.ledger.restored(req_id, PreemptMode.SWAP, seconds)
        self._learn_swap(num_blocks, seconds)

    def _hold(self, for_req_id: str | None, num_freed: int, now: float) -> None:
        if for_req_id is not None:
            self.planner.hold_for(for_req_id, num_freed, now)

    def _learn_swap(self, num_blocks: int, seconds: float) -> None:
        if self.links is not None and num_blocks:
            self.links.observe_swap(num_blocks * self.ledger.bytes_per_block, seconds)

    # -- migration out -------------------------------------------------------------------

    def migrating(self, req_id: str, now: float) -> None:
        """The engine detached the request for a move: it leaves the step planner."""
        e = self.entries[req_id]
        lr = self.planner.remove(req_id)
        e.num_kept_blocks = e.num_reserved = lr.num_blocks if lr is not None else 0
        self._move(e, Stage.MIGRATING, "migrate", now)

    def migration_answered(self, req_id: str, target: str | None, for_req_id: str | None,
                           num_computed: int, block_ids: tuple[int, ...], now: float) -> bool:
        """The target answered (``target`` None: refused or unreachable). True: the KV goes
        out now (the mechanism begins the send); False: the request stays (the mechanism
        reattaches it, then :meth:`reattached`) or was aborted meanwhile."""
        e = self.get(req_id)
        if e is None or e.stage is not Stage.MIGRATING or target is None:
            return False
        e.block_ids, e.num_reserved = block_ids, len(block_ids)
        e.out = Outbound(target, for_req_id, num_computed)
        self._moved_to[req_id] = target
        e.req.last_preempt_time = now
        e.req.num_preemptions += 1
        return True

    def reattached(self, req_id: str, num_computed: int, num_blocks: int, now: float) -> None:
        e = self.entries[req_id]
        self._move(e, Stage.DECODING, "migration_refused", now)
        self.planner.add_decode(e.req, num_computed, e.num_kept_blocks or num_blocks)

    def send_progress(self, req_id: str, arrived: bool | None) -> SendVerdict:
        """A request whose KV is leaving: ``arrived`` None (in flight), True (all there),
        False (failed, aborted or lost)."""
        if arrived is None:
            return SendVerdict.WAIT
        return SendVerdict.HANDOFF if arrived else SendVerdict.FALL_BACK

    def handed_off(self, req_id: str, num_freed: int, now: float) -> None:
        """The target owns the request now; its blocks here are free."""
        e = self.entries[req_id]
        out = e.out
        self._move(e, Stage.ENDED, "handed_off", now)
        self._event(req_id, WorkerEvent.PREEMPTED_MIGRATE, now,
                    for_req_id=out.for_req_id if out else None,
                    peer_worker_id=out.target_id if out else "")
        self._hold(out.for_req_id if out else None, num_freed, now)
        self.report_due = True

    def fell_back(self, req_id: str, why: str, num_freed: int, now: float) -> None:
        """A migration that will not complete: the request is recomputed here (the
        mechanism dropped its blocks)."""
        e = self.entries[req_id]
        out = e.out
        self._moved_to.pop(req_id, None)
        num_computed = out.num_computed if out is not None else e.req.num_context_tokens - 1
        e.out, e.block_ids, e.num_reserved, e.is_recompute = None, (), 0, True
        e.req.num_computed_tokens = 0
        self._move(e, Stage.PREFILLING, f"fall_back:{why}", now)
        self.planner.add_prefill(e.req, num_computed + 1, now)
        for_req = out.for_req_id if out is not None else None
        self._event(req_id, WorkerEvent.PREEMPTED_RECOMPUTE, now, for_req_id=for_req, reason=why)
        self._hold(for_req, num_freed, now)

    def moved(self, req_id: str, num_bytes: int, seconds: float) -> None:
        """A migration out's measured transfer (its link's pace)."""
        self.ledger.moved(num_bytes, seconds, self._moved_to.pop(req_id, ""))

    # -- steps ---------------------------------------------------------------------------

    def plan(self, now: float, num_free_blocks: int, num_free_swap_blocks: int | None = None
             ) -> StepPlan:
        plan = self.planner.plan(now, num_free_blocks, num_free_swap_blocks=num_free_swap_blocks)
        self.plan_was_empty = plan.is_empty
        return plan

    def sending(self) -> list[str]:
        """Requests whose KV is on the wire to another decode worker."""
        return [rid for rid, e in self.entries.items()
                if e.stage is Stage.MIGRATING and e.out is not None]

    def swappable(self, req_id: str) -> bool:
        e = self.get(req_id)
        return e is not None and e.stage is Stage.SWAPPED

    def runnable(self, plan: StepPlan) -> list[str]:
        """The plan's decodes still here (a victim or an abort may have taken some)."""
        return [rid for rid in plan.decodes if self.get(rid) is not None]

    def protect(self) -> frozenset[int] | None:
        """The prefix hashes to keep cached, when they changed: those of the requests
        waiting here for their (re)prefill, as the policy names them."""
        local = self.planner.local
        waiting = [r for r in self.planner.queue.requests()
                   if (lr := local.get(r.req_id)) is not None and lr.num_blocks == 0]
        hashes = frozenset(self.planner.policy.protected_hashes(waiting))
        if hashes == self._protected:
            return None
        self._protected = hashes
        return hashes

    def step_ran(self, plan: StepPlan, now: float, *, began: float, ended: float,
                 seconds: float | None, results: list[StepResult], refused: list[str],
                 blocks: dict[str, int], computed: dict[str, int],
                 shared: dict[str, int] | None = None) -> None:
        """The engine ran ``plan`` (planned at ``now``; it began at ``began`` and its
        outputs were out at ``ended``, ``seconds`` of compute): advance every request it
        touched; what happened to each is reported at ``ended``."""
        for rid, n in plan.chunks:
            e = self.get(rid)
            if (e is not None and e.is_recompute and e.restore_t0 is None
                    and rid not in refused):
                # A recompute's first chunk ran: its restore starts here; what the prefix
                # cache still held of it needed no computing.
                e.restore_t0 = began
                e.restore_cached = max(computed.get(rid, n) - n, 0)
        if any(r.error is not None for r in results):
            seconds = None  # the step ran twice (batched, then one by one): not a cost sample
        done = set(self.planner.commit(plan, now, seconds=seconds, refused=refused,
                                       blocks=blocks, computed=computed))
        self.num_steps += 1
        self.step_seconds += max(ended - began, 0.0)
        if shared:
            self._shared.update(shared)
        self.outputs(results, done, ended)

    def outputs(self, results: Iterable[StepResult], done: set[str], now: float) -> list[str]:
        """A step's outcomes (``done``: prompts it finished); returns the requests that
        left the worker (their blocks are free)."""
        left = []
        for res in results:
            rid = res.req_id
            e = self.get(rid)
            if e is None:
                continue
            if res.error is not None:  # the step failed on it alone; it left the engine
                self.planner.remove(rid)
                self._move(e, Stage.ENDED, "step_failed", now)
                self.emit(e, TokenDelta(rid, (), error=f"step_failed: {res.error}"))
                self._event(rid, WorkerEvent.ABORTED, now, reason="step_failed")
                left.append(rid)
                continue
            if rid in done and e.stage is Stage.PREFILLING:
                self._prefilled(e, now)
            if res.delta is not None:
                self.emit(e, res.delta)
            if res.request_finished:
                self.planner.remove(rid)
                self._move(e, Stage.ENDED, res.finish or "stop", now)
                self._event(rid, WorkerEvent.FINISHED_LENGTH if res.finish == "length"
                            else WorkerEvent.FINISHED_STOP, now)
                left.append(rid)
        return left

    def _prefilled(self, e: Entry, now: float) -> None:
        rid = e.req_id
        recompute = e.is_recompute
        e.is_recompute = False
        self._move(e, Stage.DECODING, "prefill_done", now)
        if not recompute:
            e.req.first_token_time = e.req.first_token_time or now
            self._event(rid, WorkerEvent.PREFILL_DONE, now)
            return
        self._event(rid, WorkerEvent.RESUMED_RECOMPUTE, now)
        if e.restore_t0 is not None:
            self.ledger.restored(rid, PreemptMode.RECOMPUTE, now - e.restore_t0,
                                 num_cached_tokens=e.restore_cached)
        e.restore_t0 = None

    # -- tokens to routers ---------------------------------------------------------------

    def _watch(self, router_id: str, now: float) -> None:
        """A request for ``router_id``: if that router has no token stream open here, its
        requests are aborted once it stays away for ROUTER_GRACE_S."""
        if router_id and router_id not in self.subscribed:
            self._unsubscribed_since.setdefault(router_id, now)

    def router_joined(self, router_id: str) -> None:
        self.subscribed.add(router_id)
        self._unsubscribed_since.pop(router_id, None)

    def router_left(self, router_id: str, now: float) -> None:
        self.subscribed.discard(router_id)
        self._unsubscribed_since[router_id] = now

    def emit(self, e: Entry, delta: TokenDelta) -> None:
        if e.migrated_in is not None and delta.start is None:
            # A request that migrated here says where its tokens sit in the output (the
            # router may still be reading its source's last ones).
            delta = replace(delta, start=e.num_streamed)
        e.num_streamed += len(delta.token_ids)
        if e.spec is not None:
            self.outbox.setdefault(e.router_id, []).append(delta)

    def take_outbox(self) -> list[tuple[str, tuple[TokenDelta, ...]]]:
        """Each subscribed router's deltas, taken; the others' wait for their stream."""
        out = []
        for router_id in [r for r in self.outbox if r in self.subscribed]:
            deltas = self.outbox.pop(router_id)
            if deltas:
                out.append((router_id, tuple(deltas)))
        return out

    # -- reports -------------------------------------------------------------------------

    def held(self) -> tuple[HeldRequest, ...]:
        """What this worker holds, for a scheduler that restarted (``WorkerHello``)."""
        out = []
        local = self.planner.local
        for e in self.live():
            if e.spec is None or (e.migrated_in is not None and e.stage is Stage.RECEIVING):
                continue  # still its source's until the handoff
            lr = local.get(e.req_id)
            stage = {Stage.RECEIVING: HeldStage.RECEIVING, Stage.PREFILLING: HeldStage.PREFILLING,
                     Stage.DECODING: HeldStage.DECODING, Stage.SWAPPED: HeldStage.SWAPPED,
                     Stage.MIGRATING: HeldStage.DECODING}[e.stage]  # type: ignore[index]
            blocks = (e.num_reserved if e.stage in (Stage.RECEIVING, Stage.MIGRATING)
                      or lr is None else lr.num_blocks)
            out.append(HeldRequest(e.spec, stage, blocks, e.req.num_output_tokens, e.source,
                                   e.req.first_token_time,
                                   lr.num_prefill_left if lr is not None else 0))
        return tuple(out)

    def running(self) -> tuple[RunningReq, ...]:
        local = self.planner.local
        out = []
        for e in self.live():
            lr = local.get(e.req_id)
            moving = e.stage in (Stage.RECEIVING, Stage.MIGRATING)
            out.append(RunningReq(e.req_id, e.num_reserved if moving else
                                  lr.num_blocks if lr is not None else 0,
                                  e.req.num_output_tokens,
                                  lr.num_prefill_left if lr is not None else 0,
                                  self._shared.get(e.req_id, 0) if e.stage is Stage.DECODING
                                  else 0))
        for rid in [rid for rid in self._shared if self.get(rid) is None]:
            del self._shared[rid]
        return tuple(out)

    def report(self, num_free_blocks: int, num_total_blocks: int, counters: KVCounters
               ) -> WorkerReport:
        """The report of now; its events, block events and transfers stay listed here
        until it is delivered (:meth:`delivered`)."""
        self.report_due = False
        return WorkerReport(self.worker_id, num_free_blocks, num_total_blocks,
                            tuple(self.events), tuple(self.block_events), tuple(self.transfers),
                            self.running(), self.planner.costs.to_tuple(), self.num_steps,
                            is_busy=self.planner.has_work() and not self.plan_was_empty,
                            memory=self.ledger.report(counters),
                            step_seconds=self.step_seconds)

    def delivered(self, rep: WorkerReport, ok: bool) -> None:
        """What a report carried goes once delivered (what came meanwhile stays either
        way): an event lost here (a finish, a failed transfer) would leave the request in
        the scheduler's books of this worker."""
        books = (self.events, self.block_events, self.transfers)
        for book, sent in zip(books, (rep.events, rep.block_events, rep.transfers), strict=True):
            del book[:len(sent) if ok else -MAX_UNREPORTED]


__all__ = ["DecodeCore", "Entry", "FirstToken", "IllegalMove", "KVVerdict", "Move",
           "PreemptAction", "PreemptVerdict", "Release", "SendVerdict", "Stage", "StepResult",
           "eviction_order", "kernel_request", "request_state"]
