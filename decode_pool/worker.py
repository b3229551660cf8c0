"""The decode worker: receives prefilled KV (or prefills itself), decodes in continuous
batches as the kernel plans each step, streams each step's tokens to the routers.

Life of a request on a decode worker (STYLE.md item 7), by the stage that holds it:

1. DISPATCH: the global scheduler sends a ``Dispatch``. With a prefill worker named, the
   prompt's blocks are reserved all or none (``engine.reserve``, prefix-cache hits
   reused), ``KVConsumer.expect`` turns them into a ticket and the prefill worker gets a
   ``StartPrefill``: stage RECEIVING. Without one (``pools.mode`` aggregated, or auto's
   choice) the request is admitted into this engine with all of its blocks: PREFILLING.
2. RECEIVING -> DECODING: the prefill worker's ``PrefilledBatch`` brings the first
   token, which goes out to the router at once (it does not depend on the transfer);
   transfer DONE and first token known -> ``engine.add_prefilled_request``. A failed
   transfer ends the request with ``transfer_failed`` (its router retries).
3. Every step, :class:`~scheduler.step_planner.WorkerScheduler` (the policy) composes the
   engine's step: the decode batch sized for the tiers' TPOT targets, local prefill
   chunks, KV-pressure victims (swap or recompute, lowest tier first), swap-ins; the
   engine runs exactly that (``run_plan``) on the engine thread.
4. The step's tokens go to each router as ONE ``TokenBatch`` (its subscription stream);
   finished requests leave and free their blocks.
5. PREEMPT (the global scheduler, for a more urgent arrival): swap to host memory
   (SWAPPED, back when blocks free up; only while the request fits the bounded swap space,
   else it is recomputed), recompute here (PREFILLING again), or migrate to another
   decode worker with its KV (MIGRATING until the handoff; ``decode_pool/kv_moves.py``
   has that life, in and out: a request migrated here waits as RECEIVING, then decodes).
6. ABORT: the router's client left, the cluster gave up on it, or a reader vanished:
   blocks freed (a reservation still receiving once its transfer has ended, so that no
   block lands in memory given to another request). A prefill worker that died takes
   with it the requests still RECEIVING from it whose KV has not all arrived
   (``release_waiting``: their routers retry them); those it had finished decode on.

Every lifecycle change is reported to the global scheduler as an event (one
``WorkerReport`` right after a step that produced events, else every control interval),
with the running requests, free blocks, the fitted step costs, and its KV memory (swap
space, prefix hits, the moves and restores it timed); a report that does not get there
leaves its events for the next one. Blocks that prefix requests waiting here for a prefill
are kept in the prefix cache ahead of plain LRU (the policy's ``protected_hashes``).
:class:`DecodeWorker` is a plain class; the Ray actor around it lives in
``cluster/worker_actors.py``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from decode_pool.kv_moves import (
    Inbound,
    MemoryLedger,
    MigrateFn,
    Outbound,
    shared_prefix_blocks,
)
from engine.aio import wait_event
from engine.service import (
    EngineThread,
    block_events,
    bytes_per_block,
    sampling_params,
    token_delta,
)
from kvtransfer.state import TransferState
from scheduler.block_hashes import compute_block_hashes
from scheduler.links import LinkModel
from scheduler.messages import (
    BlockEvent,
    Dispatch,
    DispatchAnswer,
    GenerationSpec,
    HeldRequest,
    HeldStage,
    LinkKind,
    MigrateAnswer,
    MigrateIn,
    PrefilledBatch,
    ReqEvent,
    RunningReq,
    StartPrefill,
    TokenBatch,
    TokenDelta,
    TransferStat,
    WorkerEvent,
    WorkerReport,
    encode,
)
from scheduler.policy import SchedulingPolicy
from scheduler.preemption import PreemptMode
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import StepPlan, WorkerLimits, WorkerScheduler
from scheduler.topology import WorkerInfo

log = logging.getLogger(__name__)

# Sends a report to the global scheduler; False (or raising): it did not get there, and its
# events go with the next one.
ReportFn = Callable[[WorkerReport], Awaitable[bool | None]]
# Returns None when the prefill worker took the request, else why it refused it.
StartPrefillFn = Callable[[str, StartPrefill], Awaitable[str | None]]
# A router that stays unsubscribed this long loses its requests (its clients are gone).
ROUTER_GRACE_S = 10.0
# Ids of aborted requests remembered so a dispatch that races its abort is refused.
TOMBSTONE_S = 60.0
# A step loop that fails this many times in a row ends the requests of the failing step
# (an error to each client) instead of retrying them forever.
MAX_STEP_FAILURES = 3
# Events kept for the scheduler while its reports fail (it is restarting, say): the oldest
# beyond this go (a restarted scheduler learns what this worker holds from its hello).
MAX_UNREPORTED = 10_000


class Stage(enum.Enum):
    RECEIVING = "receiving"  # blocks reserved, KV arriving (a prefill worker's, or a migration's)
    PREFILLING = "prefilling"  # prefilled here: a local prefill, or a recompute
    DECODING = "decoding"
    SWAPPED = "swapped"
    MIGRATING = "migrating"  # its KV is leaving for another decode worker


@dataclass(slots=True)
class _Req:
    spec: GenerationSpec
    stage: Stage
    kreq: Request  # this worker's kernel view (tier, progress) for the step planner
    block_ids: tuple[int, ...] = ()
    first_token: int | None = None
    first_token_time: float | None = None
    early_finish: str | None = None  # the prefill's first token was also its last
    # The prefill worker's first-token deltas, one per sequence (logprobs, cached tokens).
    first_deltas: tuple[TokenDelta, ...] = ()
    num_streamed: int = 0  # output tokens sent to the router
    prefill_worker_id: str | None = None  # RECEIVING: whose KV it waits for
    inbound: Inbound | None = None  # RECEIVING by migration
    outbound: Outbound | None = None  # MIGRATING
    # A recompute's first chunk started then (perf_counter): its restore time; and the
    # tokens of it the prefix cache still held.
    restore_t0: float | None = None
    restore_cached: int = 0

    @property
    def router_id(self) -> str:
        return self.spec.router_id


class DecodeWorker:
    def __init__(self, info: WorkerInfo, engine: Any, consumer: Any, policy: SchedulingPolicy,
                 costs: StepCosts, limits: WorkerLimits, report: ReportFn,
                 start_prefill: StartPrefillFn, *, control_interval_s: float = 0.1,
                 producer: Any = None, migrate: MigrateFn | None = None,
                 links: LinkModel | None = None) -> None:
        """``producer`` and ``migrate``: this worker can move requests out (a KVProducer
        for their blocks, and the call that asks a target to take one); without them a
        MIGRATE order is refused. ``links``: the link model its own policy prices swaps
        with (fed the swaps it times)."""
        self.info = info
        self.worker_id = info.worker_id
        self.engine = engine
        self.consumer = consumer
        self.policy = policy
        self.limits = limits
        self._report_fn = report
        self._start_prefill = start_prefill
        self.producer = producer
        self._migrate = migrate
        self.links = links
        self.ledger = MemoryLedger(bytes_per_block(engine))
        self._protected: frozenset[int] = frozenset()
        self._shared: dict[str, int] = {}  # request -> its leading blocks others hold too
        self._moved_to: dict[str, str] = {}  # migrated away -> its target (link samples)
        self.control_interval_s = control_interval_s
        self.sched = WorkerScheduler.with_limits(info, policy, costs, limits)
        self._thread = EngineThread(f"decode-{info.worker_id}", engine.books)
        self._reqs: dict[str, _Req] = {}
        self._draining: set[str] = set()  # reservations whose transfer is ending
        self._tombstones: dict[str, float] = {}
        # Token batches per router: subscribers' queues, and deltas not yet delivered.
        self._subs: dict[str, asyncio.Queue[bytes]] = {}
        self._outbox: dict[str, list[TokenDelta]] = {}
        self._unsubscribed_since: dict[str, float] = {}
        # Report contents gathered since the last report.
        self._events: list[ReqEvent] = []
        self._block_events: list[BlockEvent] = []
        self._transfers: list[TransferStat] = []
        self._report_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stepping: list[str] = []  # the requests of the step being run
        self.num_steps = 0
        # The last plan had nothing to run (waiting for room or a transfer): steps are not
        # due, so a still step count is no stall (WorkerReport.is_busy).
        self._plan_was_empty = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._step_loop()), loop.create_task(self._report_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._thread.shutdown()

    # -- control calls -------------------------------------------------------------------

    async def dispatch(self, msg: Dispatch) -> DispatchAnswer:
        spec = msg.spec
        rid = spec.req_id
        self.sched.release_hold(rid)  # room freed for it by a preemption is its now
        if rid in self._reqs or rid in self._tombstones:
            return DispatchAnswer(rid, False, self.engine.num_free_blocks, reason="known id")
        prompt = list(spec.prompt_token_ids)
        kreq = Request(rid, spec.tier, spec.arrival_time, len(prompt), spec.sampling.max_tokens,
                       state=RequestState.PREFILLING)
        if msg.prefill_worker_id is None:
            kreq.block_hashes = tuple(compute_block_hashes(prompt, self.limits.block_size))
            return await self._dispatch_local(spec, kreq)
        try:
            blocks, num_cached = self._reserve(rid, len(prompt), prompt)
        except ValueError as e:  # longer than the model's context or the whole pool
            return DispatchAnswer(rid, False, self.engine.num_free_blocks,
                                  reason=f"invalid: {e}", fatal=True)
        if blocks is None:
            return DispatchAnswer(rid, False, self.engine.num_free_blocks, reason="no room")
        ticket = self.consumer.expect(rid, blocks, present=tuple(range(num_cached)))
        self._reqs[rid] = _Req(spec, Stage.RECEIVING, kreq, tuple(blocks),
                               prefill_worker_id=msg.prefill_worker_id)
        self._watch_router(spec.router_id)
        try:
            refusal = await self._start_prefill(msg.prefill_worker_id,
                                                StartPrefill(spec, self.worker_id, ticket))
        except Exception as e:  # the prefill worker is gone: give the blocks back
            log.warning("start of %s on %s failed: %s", rid, msg.prefill_worker_id, e)
            # This attempt ends with a retryable error, as one its dead prefill worker was
            # still computing: the router retries it and bounds the retry's silence
            # (router.retry_resume_timeout_s), where a silent requeue could wait out a
            # replacement's start or a long prefill elsewhere.
            refusal, fatal = "worker_failed", True
        else:
            fatal = refusal is not None
        if refusal is not None:
            self._reqs.pop(rid, None)
            await self._end_transfer(rid)
            return DispatchAnswer(rid, False, self.engine.num_free_blocks, reason=refusal,
                                  fatal=fatal)
        self._wake.set()
        return DispatchAnswer(rid, True, self.engine.num_free_blocks, num_cached)

    def _reserve(self, rid: str, num_tokens: int, tokens: list[int]
                 ) -> tuple[list[int] | None, int]:
        """Blocks for ``num_tokens`` of incoming KV (the cached prefix of ``tokens`` first) and
        how many were cached, reserved here on the event loop under the engine's books: it
        waits for the books (a step's bookkeeping, a short control call), never for the
        model forward in flight, so a dispatch is answered within a few ms even while a
        long decode step runs (issue 22 item 6)."""
        with self.engine.books:
            blocks = self.engine.reserve(rid, num_tokens, prompt_token_ids=tokens)
            return blocks, (0 if blocks is None else self.engine.num_reserved_cached_blocks(rid))

    async def _dispatch_local(self, spec: GenerationSpec, kreq: Request) -> DispatchAnswer:
        rid = spec.req_id

        def add() -> tuple[str | None, int, int]:
            try:
                self.engine.add_request(rid, list(spec.prompt_token_ids), sampling_params(spec))
            except ValueError as e:  # the request can never run here
                return f"invalid: {e}", 0, 0
            if not self.engine.admit(rid):
                self.engine.abort(rid)
                return "no room", 0, 0
            return None, self.engine.num_computed_tokens(rid), len(self.engine.block_ids(rid))

        refusal, cached, nblocks = await self._thread.call(add)
        if refusal is not None:
            return DispatchAnswer(rid, False, self.engine.num_free_blocks, reason=refusal,
                                  fatal=refusal.startswith("invalid"))
        self._reqs[rid] = _Req(spec, Stage.PREFILLING, kreq)
        self._watch_router(spec.router_id)
        lr = self.sched.add_prefill(kreq, len(spec.prompt_token_ids) - cached, time.time(),
                                    num_computed=cached)
        lr.num_blocks = nblocks
        self._wake.set()
        return DispatchAnswer(rid, True, self.engine.num_free_blocks,
                              cached // self.limits.block_size)

    def _watch_router(self, router_id: str) -> None:
        """A request for ``router_id``: if that router has no token stream open here, its
        requests are aborted once it stays away for ROUTER_GRACE_S."""
        if router_id not in self._subs:
            self._unsubscribed_since.setdefault(router_id, time.monotonic())

    async def prefilled(self, batch: PrefilledBatch) -> None:
        for item in batch.items:
            r = self._reqs.get(item.req_id)
            if r is None or r.stage is not Stage.RECEIVING:
                continue
            if item.error is not None:  # its prefill failed on it alone: no KV will come
                self._event(item.req_id, WorkerEvent.ABORTED, reason="step_failed")
                await self.abort(item.req_id, error=item.error)
                continue
            r.first_token = item.first_token
            r.first_token_time = item.time or time.time()
            r.early_finish = item.finish
            r.first_deltas = item.deltas or (TokenDelta(item.req_id, (item.first_token,)),)
            if item.finish is None:
                # The first tokens do not depend on the transfer: send them now (TTFT).
                for d in r.first_deltas:
                    self._emit_delta(r, d)
        self._flush()
        self._wake.set()

    async def subscribe(self, router_id: str) -> AsyncIterator[bytes]:
        """One router's token stream: a ``TokenBatch`` per step that had tokens for it."""
        q: asyncio.Queue[bytes] = asyncio.Queue()
        old = self._subs.get(router_id)
        self._subs[router_id] = q
        self._unsubscribed_since.pop(router_id, None)
        if old is not None:
            old.put_nowait(b"")  # a re-subscription replaces the old stream: end it
        self._flush()
        try:
            while True:
                item = await q.get()
                if not item:
                    return
                yield item
        finally:
            if self._subs.get(router_id) is q:
                del self._subs[router_id]
                self._unsubscribed_since[router_id] = time.monotonic()

    async def abort(self, req_id: str, error: str | None = None) -> None:
        """Drop the request; ``error`` set: its router hears it (and may retry)."""
        self._tombstones[req_id] = time.monotonic()
        r = self._reqs.pop(req_id, None)
        if r is None:
            return
        self.sched.remove(req_id)
        if r.stage is Stage.RECEIVING:
            await self._end_transfer(req_id)
        else:
            if r.stage is Stage.MIGRATING and self.producer is not None:
                self.producer.abort(req_id)  # no new read of its blocks from here on
                self.producer.forget(req_id)
            await self._thread.call(self.engine.abort, req_id)
        if error is not None:
            self._emit(r, (), error=error)
            self._flush()

    async def preempt(self, req_id: str, mode: PreemptMode, for_req_id: str | None,
                      target_worker_id: str | None = None) -> bool:
        """Swap out, recompute or migrate (to ``target_worker_id``) ``req_id`` for
        ``for_req_id`` (None: this worker's own KV pressure). A swap that does not fit the
        swap space is never attempted: the request is recomputed instead. A recompute
        order for a request whose migration is under way (its target died) ends the
        migration and recomputes it here; for one recomputing here already it is True."""
        r = self._reqs.get(req_id)
        if r is not None and mode is PreemptMode.RECOMPUTE:
            if r.stage is Stage.MIGRATING:
                if self.producer is not None:
                    self.producer.abort(req_id)
                return await self._fall_back(r, "target_lost")
            if r.stage is Stage.PREFILLING and r.num_streamed > 0:
                return True
        if r is None or r.stage is not Stage.DECODING:
            return False
        if mode is PreemptMode.MIGRATE:
            return await self._migrate_out(r, for_req_id, target_worker_id)
        free_before = self.engine.num_free_blocks

        def swap_or_recompute() -> tuple[PreemptMode | None, int, float]:
            if self.engine.request_state(req_id) is None:
                return None, 0, 0.0  # it finished in the step that just ran
            n = len(self.engine.block_ids(req_id))
            forked = not self.engine.can_recompute(req_id)  # its sequences share blocks
            t0 = time.perf_counter()
            if (mode is PreemptMode.SWAP or forked) and self.engine.swap_out(req_id):
                return PreemptMode.SWAP, n, time.perf_counter() - t0
            if forked:
                return None, n, 0.0  # swap or nothing: a forked group is never recomputed
            return (PreemptMode.RECOMPUTE if self.engine.preempt_recompute(req_id) else None), n, 0.0

        done, n, seconds = await self._thread.call(swap_or_recompute)
        ok = done is not None
        if done is PreemptMode.SWAP:
            self.ledger.swapped(LinkKind.SWAP_OUT, n, seconds)
            self._learn_swap(n, seconds)
            r.stage = Stage.SWAPPED
            self.sched.swap_out(req_id)
            self._event(req_id, WorkerEvent.PREEMPTED_SWAP, for_req_id=for_req_id)
        elif done is PreemptMode.RECOMPUTE:
            r.stage = Stage.PREFILLING
            self.sched.recompute(req_id, time.time())
            self._event(req_id, WorkerEvent.PREEMPTED_RECOMPUTE, for_req_id=for_req_id)
        r.kreq.last_preempt_time = time.time()
        if ok and for_req_id is not None:
            self.sched.hold_for(for_req_id, self.engine.num_free_blocks - free_before, time.time())
        self._wake.set()
        return bool(ok)

    # -- migration (decode_pool/kv_moves.py) --------------------------------------------

    async def _migrate_out(self, r: _Req, for_req_id: str | None, target: str | None) -> bool:
        rid = r.spec.req_id
        if self.producer is None or self._migrate is None or not target:
            return False
        snap = await self._thread.call(self.engine.detach_for_migration, rid)
        if snap is None:
            return False
        r.stage = Stage.MIGRATING
        lr = self.sched.remove(rid)
        msg = MigrateIn(r.spec, snap.output_token_ids, snap.num_computed, self.worker_id,
                        r.kreq.first_token_time or r.first_token_time)
        try:
            ans: MigrateAnswer | None = await self._migrate(target, msg)
        except Exception as e:  # the target is gone: the request stays here
            log.warning("migration of %s to %s failed to start: %s", rid, target, e)
            ans = None
        if rid not in self._reqs:  # aborted meanwhile (abort freed its blocks)
            return False
        if ans is None or ans.ticket is None:
            await self._thread.call(self.engine.reattach, rid)
            r.stage = Stage.DECODING
            self.sched.add_decode(r.kreq, snap.num_computed,
                                  lr.num_blocks if lr is not None else len(snap.block_ids))
            self._wake.set()
            return False
        r.block_ids = snap.block_ids
        r.outbound = Outbound(target, for_req_id, snap)
        self._moved_to[rid] = target
        self.producer.begin(ans.ticket)
        self.producer.push(rid, list(snap.block_ids))
        r.kreq.last_preempt_time = time.time()
        self._wake.set()
        return True

    async def migrate_in(self, msg: MigrateIn) -> MigrateAnswer:
        """Take a request over from another decode worker: reserve its blocks (prefix-cache
        hits here are not sent) and answer the ticket its KV comes with."""
        spec = msg.spec
        rid = spec.req_id
        if rid in self._reqs or rid in self._tombstones:
            return MigrateAnswer(rid, None, "known id")
        if not msg.output_token_ids or msg.num_computed < 1:
            return MigrateAnswer(rid, None, "invalid: nothing decoded yet")
        inbound = Inbound(msg)
        tokens = list(inbound.token_ids)

        try:
            blocks, num_cached = self._reserve(rid, msg.num_computed, tokens)
        except ValueError as e:
            return MigrateAnswer(rid, None, f"invalid: {e}")
        if blocks is None:
            return MigrateAnswer(rid, None, "no room")
        ticket = self.consumer.expect(rid, blocks, present=tuple(range(num_cached)))
        outputs = msg.output_token_ids
        kreq = Request(rid, spec.tier, spec.arrival_time, len(spec.prompt_token_ids),
                       spec.sampling.max_tokens, state=RequestState.DECODING,
                       num_output_tokens=len(outputs), first_token_time=msg.first_token_time)
        self._reqs[rid] = _Req(spec, Stage.RECEIVING, kreq, tuple(blocks),
                               first_token=outputs[-1], first_token_time=msg.first_token_time,
                               num_streamed=len(outputs), prefill_worker_id=msg.from_worker_id,
                               inbound=inbound)
        self._watch_router(spec.router_id)
        self._wake.set()
        self._report_soon()  # the scheduler's view of this worker's blocks
        return MigrateAnswer(rid, ticket, num_cached_blocks=num_cached)

    async def _join_migration(self, rid: str, r: _Req, state: TransferState | None) -> None:
        """A request migrating here: decode it once its KV is all here; drop the
        reservation silently when the transfer ended otherwise (the source still owns
        it and recomputes it)."""
        assert r.inbound is not None
        if state in (TransferState.FAILED, TransferState.ABORTED):
            self._reqs.pop(rid, None)
            await self._end_transfer(rid)
            return
        if state is not TransferState.DONE:
            return
        self.consumer.forget(rid)
        msg = r.inbound.msg
        try:
            await self._thread.call(self.engine.add_migrated_request, rid,
                                    list(r.inbound.token_ids), len(msg.spec.prompt_token_ids),
                                    sampling_params(msg.spec), list(r.block_ids))
        except ValueError as e:  # cannot decode here: its router retries it by recompute
            log.warning("migrated request %s cannot decode here: %s", rid, e)
            self._event(rid, WorkerEvent.ABORTED, reason="worker_failed")
            await self.abort(rid, error="worker_failed")
            return
        r.stage = Stage.DECODING
        self.sched.add_decode(r.kreq, msg.num_computed, len(r.block_ids))
        self._event(rid, WorkerEvent.RESUMED_MIGRATE)
        self.ledger.restored(rid, PreemptMode.MIGRATE,
                             time.perf_counter() - r.inbound.reserved_at, msg.from_worker_id)
        # Everything streamed so far, again, from index 0: the router keeps only what the
        # source's stream has not brought it yet.
        self._outbox.setdefault(r.router_id, []).append(
            TokenDelta(rid, msg.output_token_ids, start=0))
        self._report_soon()

    async def _poll_migrations(self) -> None:
        """Requests whose KV is leaving: hand them off once it all arrived, else fall back."""
        for rid, r in list(self._reqs.items()):
            out = r.outbound
            if r.stage is not Stage.MIGRATING or out is None or self.producer is None:
                continue
            st = self.producer.poll(rid)
            if st is not None and not st.state.is_terminal:
                continue
            if st is not None:
                self.producer.forget(rid)
            if st is None or st.state is not TransferState.DONE:
                await self._fall_back(r, "transfer " + ("lost" if st is None else st.state.value))
                continue
            free_before = self.engine.num_free_blocks
            await self._thread.call(self.engine.abort, rid)
            self._reqs.pop(rid, None)
            self._event(rid, WorkerEvent.PREEMPTED_MIGRATE, for_req_id=out.for_req_id,
                        peer_worker_id=out.target_id)
            if out.for_req_id is not None:
                self.sched.hold_for(out.for_req_id, self.engine.num_free_blocks - free_before,
                                    time.time())
            self._report_soon()

    async def _fall_back(self, r: _Req, why: str) -> bool:
        """A migration that will not complete: recompute the request here (its blocks go
        back at once; the transfer is terminal or aborted, so nothing reads them)."""
        rid = r.spec.req_id
        out = r.outbound
        if out is not None and self.producer is not None:
            self.producer.forget(rid)
        self._moved_to.pop(rid, None)
        free_before = self.engine.num_free_blocks
        if not await self._thread.call(self.engine.preempt_recompute, rid):
            return False
        log.warning("migration of %s to %s did not complete (%s): recomputing it here", rid,
                    out.target_id if out else "?", why)
        num_computed = out.snapshot.num_computed if out is not None else r.kreq.num_context_tokens - 1
        r.stage, r.outbound, r.block_ids = Stage.PREFILLING, None, ()
        r.kreq.num_computed_tokens = 0
        self.sched.add_prefill(r.kreq, num_computed + 1, time.time())
        for_req = out.for_req_id if out is not None else None
        self._event(rid, WorkerEvent.PREEMPTED_RECOMPUTE, for_req_id=for_req, reason=why)
        if for_req is not None:
            self.sched.hold_for(for_req, self.engine.num_free_blocks - free_before, time.time())
        self._wake.set()
        return True

    def _learn_swap(self, num_blocks: int, seconds: float) -> None:
        if self.links is not None:
            self.links.observe_swap(num_blocks * self.ledger.bytes_per_block, seconds)

    async def release_waiting(self, prefill_worker_id: str,
                              req_ids: tuple[str, ...] | None = None) -> list[str]:
        """``prefill_worker_id`` died: drop the requests (all, or ``req_ids``) still
        receiving from it whose KV or first token has not arrived; their routers hear
        ``worker_failed`` and retry. Requests whose KV is all here stay. Returns the
        dropped ids."""
        dropped = []
        for rid, r in list(self._reqs.items()):
            if (r.stage is not Stage.RECEIVING or r.prefill_worker_id != prefill_worker_id
                    or (req_ids is not None and rid not in req_ids)):
                continue
            st = self.consumer.poll(rid)
            if r.first_token is not None and st is not None and st.state is TransferState.DONE:
                continue  # everything arrived: it joins the decode batch next step
            dropped.append(rid)
            await self.abort(rid, error="worker_failed")  # the scheduler ends it in its view
        return dropped

    def held_requests(self) -> tuple[HeldRequest, ...]:
        """What this worker holds, for a scheduler that restarted (``WorkerHello``)."""
        out = []
        for rid, r in self._reqs.items():
            lr = self.sched.local.get(rid)
            if r.inbound is not None and r.stage is Stage.RECEIVING:
                continue  # still its source's until the handoff
            stage = {Stage.RECEIVING: HeldStage.RECEIVING, Stage.PREFILLING: HeldStage.PREFILLING,
                     Stage.DECODING: HeldStage.DECODING, Stage.SWAPPED: HeldStage.SWAPPED,
                     Stage.MIGRATING: HeldStage.DECODING}[r.stage]
            blocks = (len(r.block_ids) if r.stage in (Stage.RECEIVING, Stage.MIGRATING)
                      or lr is None else lr.num_blocks)
            out.append(HeldRequest(r.spec, stage, blocks, r.kreq.num_output_tokens,
                                   r.prefill_worker_id, r.kreq.first_token_time or
                                   r.first_token_time,
                                   lr.num_prefill_left if lr is not None else 0))
        return tuple(out)

    def status(self) -> dict[str, Any]:
        swap = self.engine.swap
        return {"worker_id": self.worker_id, "num_free_blocks": self.engine.num_free_blocks,
                "num_total_blocks": self.engine.num_total_blocks, "num_requests": len(self._reqs),
                "num_steps": self.num_steps, "num_swap_used": swap.num_used,
                "num_swap_peak": swap.num_peak, "num_swap_blocks": swap.capacity,
                "num_prefix_query_blocks": self.engine.num_prefix_query_blocks,
                "num_prefix_hit_blocks": self.engine.num_prefix_hit_blocks}

    # -- tokens to routers ---------------------------------------------------------------

    def _emit(self, r: _Req, tokens: tuple[int, ...], finish: str | None = None,
              error: str | None = None) -> None:
        self._emit_delta(r, TokenDelta(r.spec.req_id, tokens, finish, error))

    def _emit_delta(self, r: _Req, delta: TokenDelta) -> None:
        if r.inbound is not None and delta.start is None:
            # A request that migrated here says where its tokens sit in the output (the
            # router may still be reading its source's last ones).
            delta = replace(delta, start=r.num_streamed)
        r.num_streamed += len(delta.token_ids)
        self._outbox.setdefault(r.router_id, []).append(delta)

    def _flush(self) -> None:
        for router_id in list(self._outbox):
            q = self._subs.get(router_id)
            if q is None:
                continue  # not subscribed (yet): kept until it is
            deltas = self._outbox.pop(router_id)
            if deltas:
                q.put_nowait(encode(TokenBatch(self.worker_id, tuple(deltas))))

    # -- loops ---------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        failures = 0
        while True:
            waiting = self._draining or any(r.stage in (Stage.RECEIVING, Stage.MIGRATING)
                                            for r in self._reqs.values())
            if not self.sched.has_work():
                await wait_event(self._wake, 0.005 if waiting else 0.25)
            self._wake.clear()
            self._stepping = []
            try:
                await self._free_drained()
                await self._poll_migrations()
                await self._join_transfers()
                if self.sched.has_work():
                    await self._step()
                self._flush()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving the other requests
                failures += 1
                log.exception("decode worker %s: step failed (%d in a row)", self.worker_id,
                              failures)
                if failures >= MAX_STEP_FAILURES:  # a bound, never a retry forever
                    failures = 0
                    await self._fail_requests(self._stepping, "step_failed: the worker's "
                                              f"step failed {MAX_STEP_FAILURES} times")
                await asyncio.sleep(0.05)

    async def _fail_requests(self, req_ids: list[str], error: str) -> None:
        for rid in req_ids:
            if rid in self._reqs:
                self._event(rid, WorkerEvent.ABORTED, reason="step_failed")
                await self.abort(rid, error=error)
        self._flush()

    async def _step(self) -> None:
        now = time.time()
        plan = self.sched.plan(now, self.engine.num_free_blocks,
                               num_free_swap_blocks=self.engine.swap.num_free)
        self._plan_was_empty = plan.is_empty
        if plan.is_empty:
            await wait_event(self._wake, 0.01)
            return
        for v in plan.preempt:
            await self.preempt(v.req_id, v.mode if v.mode is PreemptMode.SWAP
                               else PreemptMode.RECOMPUTE, None)
        for rid in plan.swap_in:
            await self._swap_in(rid)
        decodes = [rid for rid in plan.decodes if rid in self._reqs]
        self._stepping = [*decodes, *(rid for rid, _ in plan.chunks)]
        t0 = time.perf_counter()
        outs, refused, blocks, computed, events = await self._thread.call(
            self._run, decodes, list(plan.chunks), self._protect())
        seconds: float | None = time.perf_counter() - t0
        for rid, n in plan.chunks:
            r = self._reqs.get(rid)
            if (r is not None and r.num_streamed > 0 and r.restore_t0 is None
                    and rid not in refused):
                # A recompute's first chunk ran: its restore starts here; what the prefix
                # cache still held of it needed no computing.
                r.restore_t0 = t0
                r.restore_cached = max(computed.get(rid, n) - n, 0)
        if any(o.error is not None for o in outs):
            seconds = None  # the step ran twice (batched, then one by one): not a cost sample
        self._block_events.extend(events)
        done = set(self.sched.commit(plan, now, seconds=seconds, refused=refused, blocks=blocks,
                                     computed=computed))
        self.num_steps += 1
        self._postprocess(plan, outs, done)
        if self._events:
            self._report_soon()

    def _protect(self) -> frozenset[int] | None:
        """The prefix hashes to keep cached, when they changed: those of the requests
        waiting here for their (re)prefill, as the policy names them."""
        waiting = [r for r in self.sched.queue.requests()
                   if (lr := self.sched.local.get(r.req_id)) is not None and lr.num_blocks == 0]
        hashes = frozenset(self.policy.protected_hashes(waiting))
        if hashes == self._protected:
            return None
        self._protected = hashes
        return hashes

    def _run(self, decodes: list[str], chunks: list[tuple[str, int]],
             protect: frozenset[int] | None = None
             ) -> tuple[list[Any], list[str], dict[str, int], dict[str, int], list[BlockEvent]]:
        """On the engine thread: the step, then the block counts the planner tracks."""
        if protect is not None:
            self.engine.protect_prefixes(protect)
        outs, refused = self.engine.run_plan(decodes, chunks)
        blocks: dict[str, int] = {}
        computed: dict[str, int] = {}
        for rid in [*decodes, *(c for c, _ in chunks)]:
            if self.engine.request_state(rid) is not None:
                ids = self.engine.block_ids(rid)
                blocks[rid] = len(ids)
                computed[rid] = self.engine.num_computed_tokens(rid)
                self._shared[rid] = shared_prefix_blocks(self.engine, ids)
        return outs, refused, blocks, computed, block_events(self.engine.drain_events())

    def _postprocess(self, plan: StepPlan, outs: list[Any], done: set[str]) -> None:
        now = time.time()
        for out in outs:
            r = self._reqs.get(out.req_id)
            if r is None:
                continue
            if out.error is not None:  # the step failed on this request alone; it left the engine
                self._reqs.pop(out.req_id, None)
                self.sched.remove(out.req_id)
                self._emit(r, (), error=f"step_failed: {out.error}")
                self._event(out.req_id, WorkerEvent.ABORTED, reason="step_failed")
                continue
            if out.req_id in done and r.stage is Stage.PREFILLING:
                fresh = r.num_streamed == 0
                r.stage = Stage.DECODING
                if fresh:
                    r.kreq.first_token_time = r.kreq.first_token_time or now
                    self._event(out.req_id, WorkerEvent.PREFILL_DONE)
                else:
                    self._event(out.req_id, WorkerEvent.RESUMED_RECOMPUTE)
                    if r.restore_t0 is not None:
                        self.ledger.restored(out.req_id, PreemptMode.RECOMPUTE,
                                             time.perf_counter() - r.restore_t0,
                                             num_cached_tokens=r.restore_cached)
                    r.restore_t0 = None
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            if out.finished and finish is None:
                finish = "stop"
            if out.new_token_ids or finish:
                self._emit_delta(r, token_delta(out, finish))
            if out.request_finished:
                self._reqs.pop(out.req_id, None)
                self.sched.remove(out.req_id)
                self._event(out.req_id, WorkerEvent.FINISHED_LENGTH if finish == "length"
                            else WorkerEvent.FINISHED_STOP)

    async def _swap_in(self, rid: str) -> None:
        r = self._reqs.get(rid)
        if r is None or r.stage is not Stage.SWAPPED:
            return

        def swap_in() -> tuple[int, float] | None:
            t0 = time.perf_counter()
            if not self.engine.swap_in(rid):
                return None
            return len(self.engine.block_ids(rid)), time.perf_counter() - t0

        if (got := await self._thread.call(swap_in)) is not None:
            n, seconds = got
            r.stage = Stage.DECODING
            self.sched.swapped_in(rid, n)
            self._event(rid, WorkerEvent.RESUMED_SWAP)
            self.ledger.swapped(LinkKind.SWAP_IN, n, seconds)
            self.ledger.restored(rid, PreemptMode.SWAP, seconds)
            self._learn_swap(n, seconds)

    async def _join_transfers(self) -> None:
        for rid, r in list(self._reqs.items()):
            if r.stage is not Stage.RECEIVING:
                continue
            st = self.consumer.poll(rid)
            state = None if st is None else st.state
            if r.inbound is not None:
                await self._join_migration(rid, r, state)
                continue
            if r.first_token is not None and r.early_finish is not None:
                # The first token was the last: no decode, the reserved slots go back.
                self._reqs.pop(rid, None)
                await self._end_transfer(rid)
                self._emit_delta(r, replace(r.first_deltas[0], finish=r.early_finish))
                self._event(rid, WorkerEvent.FINISHED_LENGTH if r.early_finish == "length"
                            else WorkerEvent.FINISHED_STOP)
                continue
            if state in (TransferState.FAILED, TransferState.ABORTED):
                log.warning("transfer of %s %s: %s", rid, state.value,
                            "" if st is None else st.detail)
                await self.abort(rid, error="transfer_failed")
                self._event(rid, WorkerEvent.TRANSFER_FAILED)
                continue
            if r.first_token is None or state is not TransferState.DONE:
                continue
            self.consumer.forget(rid)
            prompt = list(r.spec.prompt_token_ids)
            try:
                firsts = ([d.token_ids[0] for d in r.first_deltas] if len(r.first_deltas) > 1
                          else r.first_token)
                await self._thread.call(self.engine.add_prefilled_request, rid, prompt,
                                        firsts, sampling_params(r.spec), list(r.block_ids))
            except ValueError as e:  # this request can never decode here: end it alone
                self._event(rid, WorkerEvent.ABORTED, reason="invalid")
                await self.abort(rid, error=f"invalid: {e}")
                continue
            r.stage = Stage.DECODING
            r.kreq.state = RequestState.DECODING
            r.kreq.first_token_time = r.first_token_time
            r.kreq.num_output_tokens = 1
            self.sched.add_decode(r.kreq, len(prompt), len(r.block_ids))
            self._event(rid, WorkerEvent.DECODE_START)
        self._flush()

    async def _end_transfer(self, req_id: str) -> None:
        """End the transfer into ``req_id``'s reserved slots and free them once nothing can
        land there any more: at once, or (receives still posted) from the step loop when
        the consumer reports the end (like vLLM's connectors delay freeing blocks that a
        transfer may still write)."""
        self.consumer.abort(req_id)
        status = self.consumer.poll(req_id)
        if status is not None and not status.state.is_terminal:
            self._draining.add(req_id)
            self._wake.set()
            return
        if status is not None:
            self.consumer.forget(req_id)
        await self._thread.call(self.engine.abort, req_id)

    async def _free_drained(self) -> None:
        for rid in list(self._draining):
            status = self.consumer.poll(rid)
            if status is None or status.state.is_terminal:
                self._draining.discard(rid)
                if status is not None:
                    self.consumer.forget(rid)
                await self._thread.call(self.engine.abort, rid)

    # -- reports -------------------------------------------------------------------------

    def _event(self, req_id: str, kind: WorkerEvent, *, for_req_id: str | None = None,
               reason: str = "", peer_worker_id: str = "") -> None:
        self._events.append(ReqEvent(req_id, kind, time.time(), for_req_id, reason,
                                     peer_worker_id))

    def _report_soon(self) -> None:
        if self._report_task is None or self._report_task.done():
            self._report_task = asyncio.get_running_loop().create_task(self._send_report())

    def _take_report(self) -> WorkerReport:
        """The report of now; its events, block events and transfers stay listed here until
        it is delivered (``_send_report``)."""
        moving = (Stage.RECEIVING, Stage.MIGRATING)
        running = tuple(RunningReq(rid, len(r.block_ids) if r.stage in moving else
                                   self.sched.local[rid].num_blocks if rid in self.sched.local
                                   else 0, r.kreq.num_output_tokens,
                                   self.sched.local[rid].num_prefill_left
                                   if rid in self.sched.local else 0,
                                   self._shared.get(rid, 0) if r.stage is Stage.DECODING else 0)
                        for rid, r in self._reqs.items())
        for rid in [rid for rid in self._shared if rid not in self._reqs]:
            del self._shared[rid]
        rep = WorkerReport(self.worker_id, self.engine.num_free_blocks,
                           self.engine.num_total_blocks, tuple(self._events),
                           tuple(self._block_events), tuple(self._transfers), running,
                           self.sched.costs.to_tuple(), self.num_steps,
                           is_busy=self.sched.has_work() and not self._plan_was_empty,
                           memory=self.ledger.report(self.engine))
        return rep

    async def _send_report(self) -> None:
        for s in self.consumer.drain_stats():
            if s.state is TransferState.DONE:
                self._transfers.append(TransferStat(s.req_id, s.num_bytes, s.duration_s,
                                                    s.end_time, s.topology))
        if self.producer is not None:  # migrations out: whole transfers, a link's pace
            for s in self.producer.drain_stats():
                if s.state is TransferState.DONE and s.num_bytes:
                    self.ledger.moved(s.num_bytes, s.duration_s, self._moved_to.pop(s.req_id, ""))
        rep = self._take_report()
        try:
            delivered = await self._report_fn(rep) is not False
        except asyncio.CancelledError:
            raise
        except Exception:  # the scheduler may be restarting: report next time
            log.exception("decode worker %s: report failed", self.worker_id)
            delivered = False
        # What it carried goes once delivered (what came meanwhile stays either way): an
        # event lost here (a finish, a failed transfer) would leave the request in the
        # scheduler's books of this worker.
        kept = (self._events, self._block_events, self._transfers)
        for book, sent in zip(kept, (rep.events, rep.block_events, rep.transfers), strict=True):
            del book[:len(sent) if delivered else -MAX_UNREPORTED]

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.control_interval_s)
            self._expire()
            if self._report_task is not None and not self._report_task.done():
                continue
            self._block_events.extend(block_events(
                await self._thread.call(self.engine.drain_events)))
            self._report_soon()

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, t in self._tombstones.items() if now - t > TOMBSTONE_S]:
            del self._tombstones[rid]
        for router_id, since in list(self._unsubscribed_since.items()):
            if now - since < ROUTER_GRACE_S:
                continue
            del self._unsubscribed_since[router_id]
            self._outbox.pop(router_id, None)
            for rid, r in list(self._reqs.items()):
                if r.router_id == router_id:
                    log.info("router %s is gone: aborting %s", router_id, rid)
                    self._event(rid, WorkerEvent.ABORTED, reason="reader_gone")
                    asyncio.get_running_loop().create_task(self.abort(rid))
