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
   (SWAPPED, back when blocks free up) or recompute here (PREFILLING again).
6. ABORT: the router's client left, the cluster gave up on it, or a reader vanished:
   blocks freed (a reservation still receiving once its transfer has ended, so that no
   block lands in memory given to another request). A prefill worker that died takes
   with it the requests still RECEIVING from it whose KV has not all arrived
   (``release_waiting``: their routers retry them); those it had finished decode on.

Every lifecycle change is reported to the global scheduler as an event (one
``WorkerReport`` right after a step that produced events, else every control interval),
with the running requests, free blocks and the fitted step costs. :class:`DecodeWorker`
is a plain class; the Ray actor around it lives in ``cluster/worker_actors.py``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine.service import EngineThread, block_events, sampling_params, wait_event
from scheduler.messages import (
    BlockEvent,
    Dispatch,
    DispatchAnswer,
    GenerationSpec,
    HeldRequest,
    HeldStage,
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

ReportFn = Callable[[WorkerReport], Awaitable[None]]
# Returns None when the prefill worker took the request, else why it refused it.
StartPrefillFn = Callable[[str, StartPrefill], Awaitable[str | None]]
# A router that stays unsubscribed this long loses its requests (its clients are gone).
ROUTER_GRACE_S = 10.0
# Ids of aborted requests remembered so a dispatch that races its abort is refused.
TOMBSTONE_S = 60.0
# A step loop that fails this many times in a row ends the requests of the failing step
# (an error to each client) instead of retrying them forever.
MAX_STEP_FAILURES = 3


class Stage(enum.Enum):
    RECEIVING = "receiving"  # blocks reserved, KV arriving from a prefill worker
    PREFILLING = "prefilling"  # prefilled here: a local prefill, or a recompute
    DECODING = "decoding"
    SWAPPED = "swapped"


@dataclass(slots=True)
class _Req:
    spec: GenerationSpec
    stage: Stage
    kreq: Request  # this worker's kernel view (tier, progress) for the step planner
    block_ids: tuple[int, ...] = ()
    first_token: int | None = None
    first_token_time: float | None = None
    early_finish: str | None = None  # the prefill's first token was also its last
    num_streamed: int = 0  # output tokens sent to the router
    prefill_worker_id: str | None = None  # RECEIVING: whose KV it waits for

    @property
    def router_id(self) -> str:
        return self.spec.router_id


class DecodeWorker:
    def __init__(self, info: WorkerInfo, engine: Any, consumer: Any, policy: SchedulingPolicy,
                 costs: StepCosts, limits: WorkerLimits, report: ReportFn,
                 start_prefill: StartPrefillFn, *, control_interval_s: float = 0.1) -> None:
        self.info = info
        self.worker_id = info.worker_id
        self.engine = engine
        self.consumer = consumer
        self.policy = policy
        self.limits = limits
        self._report_fn = report
        self._start_prefill = start_prefill
        self.control_interval_s = control_interval_s
        self.sched = WorkerScheduler.with_limits(info, policy, costs, limits)
        self._thread = EngineThread(f"decode-{info.worker_id}")
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
            return await self._dispatch_local(spec, kreq)
        def reserve() -> tuple[list[int] | None, int]:
            blocks = self.engine.reserve(rid, len(prompt), prompt_token_ids=prompt)
            return blocks, (0 if blocks is None else self.engine.num_reserved_cached_blocks(rid))

        try:
            # One call: each call waits for the engine's running step, and a second one
            # would queue behind the step the step loop submits in between.
            blocks, num_cached = await self._thread.call(reserve)
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
            refusal, fatal = "prefill worker unreachable", False
        else:
            fatal = refusal is not None
        if refusal is not None:
            self._reqs.pop(rid, None)
            await self._end_transfer(rid)
            return DispatchAnswer(rid, False, self.engine.num_free_blocks, reason=refusal,
                                  fatal=fatal)
        self._wake.set()
        return DispatchAnswer(rid, True, self.engine.num_free_blocks, num_cached)

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
            if item.finish is None:
                # The first token does not depend on the transfer: send it now (TTFT).
                self._emit(r, (item.first_token,))
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
            await self._thread.call(self.engine.abort, req_id)
        if error is not None:
            self._emit(r, (), error=error)
            self._flush()

    async def preempt(self, req_id: str, mode: str, for_req_id: str | None) -> bool:
        """Swap out or recompute ``req_id`` for ``for_req_id`` (None: this worker's own KV
        pressure)."""
        r = self._reqs.get(req_id)
        if r is None or r.stage is not Stage.DECODING:
            return False
        free_before = self.engine.num_free_blocks
        if mode == PreemptMode.SWAP.value:
            ok = await self._thread.call(self.engine.swap_out, req_id)
            if ok:
                r.stage = Stage.SWAPPED
                self.sched.swap_out(req_id)
                self._event(req_id, WorkerEvent.PREEMPTED_SWAP, for_req_id=for_req_id)
        else:
            ok = await self._thread.call(self.engine.preempt_recompute, req_id)
            if ok:
                r.stage = Stage.PREFILLING
                self.sched.recompute(req_id, time.time())
                self._event(req_id, WorkerEvent.PREEMPTED_RECOMPUTE, for_req_id=for_req_id)
        r.kreq.last_preempt_time = time.time()
        if ok and for_req_id is not None:
            self.sched.hold_for(for_req_id, self.engine.num_free_blocks - free_before, time.time())
        self._wake.set()
        return bool(ok)

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
            if r.first_token is not None and st is not None and st.state.value == "done":
                continue  # everything arrived: it joins the decode batch next step
            dropped.append(rid)
            await self.abort(rid, error="worker_failed")  # the scheduler ends it in its view
        return dropped

    def held_requests(self) -> tuple[HeldRequest, ...]:
        """What this worker holds, for a scheduler that restarted (``WorkerHello``)."""
        out = []
        for rid, r in self._reqs.items():
            lr = self.sched.local.get(rid)
            stage = {Stage.RECEIVING: HeldStage.RECEIVING, Stage.PREFILLING: HeldStage.PREFILLING,
                     Stage.DECODING: HeldStage.DECODING, Stage.SWAPPED: HeldStage.SWAPPED}[r.stage]
            blocks = len(r.block_ids) if r.stage is Stage.RECEIVING or lr is None else lr.num_blocks
            out.append(HeldRequest(r.spec, stage, blocks, r.kreq.num_output_tokens,
                                   r.prefill_worker_id, r.kreq.first_token_time or
                                   r.first_token_time,
                                   lr.num_prefill_left if lr is not None else 0))
        return tuple(out)

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "num_free_blocks": self.engine.num_free_blocks,
                "num_total_blocks": self.engine.num_total_blocks, "num_requests": len(self._reqs),
                "num_steps": self.num_steps}

    # -- tokens to routers ---------------------------------------------------------------

    def _emit(self, r: _Req, tokens: tuple[int, ...], finish: str | None = None,
              error: str | None = None) -> None:
        r.num_streamed += len(tokens)
        self._outbox.setdefault(r.router_id, []).append(
            TokenDelta(r.spec.req_id, tokens, finish, error))

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
            waiting = self._draining or any(r.stage is Stage.RECEIVING for r in self._reqs.values())
            if not self.sched.has_work():
                await wait_event(self._wake, 0.005 if waiting else 0.25)
            self._wake.clear()
            self._stepping = []
            try:
                await self._free_drained()
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
        plan = self.sched.plan(now, self.engine.num_free_blocks)
        self._plan_was_empty = plan.is_empty
        if plan.is_empty:
            await wait_event(self._wake, 0.01)
            return
        for v in plan.preempt:
            await self.preempt(v.req_id, v.mode.value if v.mode is PreemptMode.SWAP
                               else PreemptMode.RECOMPUTE.value, None)
        for rid in plan.swap_in:
            await self._swap_in(rid)
        decodes = [rid for rid in plan.decodes if rid in self._reqs]
        self._stepping = [*decodes, *(rid for rid, _ in plan.chunks)]
        t0 = time.perf_counter()
        outs, refused, blocks, computed, events = await self._thread.call(
            self._run, decodes, list(plan.chunks))
        seconds: float | None = time.perf_counter() - t0
        if any(o.error is not None for o in outs):
            seconds = None  # the step ran twice (batched, then one by one): not a cost sample
        self._block_events.extend(events)
        done = set(self.sched.commit(plan, now, seconds=seconds, refused=refused, blocks=blocks,
                                     computed=computed))
        self.num_steps += 1
        self._postprocess(plan, outs, done)
        if self._events:
            self._report_soon()

    def _run(self, decodes: list[str], chunks: list[tuple[str, int]]
             ) -> tuple[list[Any], list[str], dict[str, int], dict[str, int], list[BlockEvent]]:
        """On the engine thread: the step, then the block counts the planner tracks."""
        outs, refused = self.engine.run_plan(decodes, chunks)
        blocks: dict[str, int] = {}
        computed: dict[str, int] = {}
        for rid in [*decodes, *(c for c, _ in chunks)]:
            if self.engine.request_state(rid) is not None:
                blocks[rid] = len(self.engine.block_ids(rid))
                computed[rid] = self.engine.num_computed_tokens(rid)
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
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            if out.finished and finish is None:
                finish = "stop"
            if out.new_token_ids or finish:
                self._emit(r, tuple(out.new_token_ids), finish)
            if out.finished:
                self._reqs.pop(out.req_id, None)
                self.sched.remove(out.req_id)
                self._event(out.req_id, WorkerEvent.FINISHED_LENGTH if finish == "length"
                            else WorkerEvent.FINISHED_STOP)

    async def _swap_in(self, rid: str) -> None:
        r = self._reqs.get(rid)
        if r is None or r.stage is not Stage.SWAPPED:
            return

        def swap_in() -> int | None:
            return len(self.engine.block_ids(rid)) if self.engine.swap_in(rid) else None

        if (n := await self._thread.call(swap_in)) is not None:
            r.stage = Stage.DECODING
            self.sched.swapped_in(rid, n)
            self._event(rid, WorkerEvent.RESUMED_SWAP)

    async def _join_transfers(self) -> None:
        for rid, r in list(self._reqs.items()):
            if r.stage is not Stage.RECEIVING:
                continue
            st = self.consumer.poll(rid)
            state = None if st is None else st.state.value
            if r.first_token is not None and r.early_finish is not None:
                # The first token was the last: no decode, the reserved slots go back.
                self._reqs.pop(rid, None)
                await self._end_transfer(rid)
                self._emit(r, (r.first_token,), r.early_finish)
                self._event(rid, WorkerEvent.FINISHED_LENGTH if r.early_finish == "length"
                            else WorkerEvent.FINISHED_STOP)
                continue
            if state in ("failed", "aborted"):
                log.warning("transfer of %s %s: %s", rid, state, "" if st is None else st.detail)
                await self.abort(rid, error="transfer_failed")
                self._event(rid, WorkerEvent.TRANSFER_FAILED)
                continue
            if r.first_token is None or state != "done":
                continue
            self.consumer.forget(rid)
            prompt = list(r.spec.prompt_token_ids)
            try:
                await self._thread.call(self.engine.add_prefilled_request, rid, prompt,
                                        r.first_token, sampling_params(r.spec),
                                        list(r.block_ids))
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
               reason: str = "") -> None:
        self._events.append(ReqEvent(req_id, kind, time.time(), for_req_id, reason))

    def _report_soon(self) -> None:
        if self._report_task is None or self._report_task.done():
            self._report_task = asyncio.get_running_loop().create_task(self._send_report())

    def _take_report(self) -> WorkerReport:
        running = tuple(RunningReq(rid, len(r.block_ids) if r.stage is Stage.RECEIVING else
                                   self.sched.local[rid].num_blocks if rid in self.sched.local
                                   else 0, r.kreq.num_output_tokens,
                                   self.sched.local[rid].num_prefill_left
                                   if rid in self.sched.local else 0)
                        for rid, r in self._reqs.items())
        rep = WorkerReport(self.worker_id, self.engine.num_free_blocks,
                           self.engine.num_total_blocks, tuple(self._events),
                           tuple(self._block_events), tuple(self._transfers), running,
                           self.sched.costs.to_tuple(), self.num_steps,
                           is_busy=self.sched.has_work() and not self._plan_was_empty)
        self._events, self._block_events, self._transfers = [], [], []
        return rep

    async def _send_report(self) -> None:
        for s in self.consumer.drain_stats():
            if s.state.value == "done":
                self._transfers.append(TransferStat(s.req_id, s.num_bytes, s.duration_s,
                                                    s.end_time, s.topology.value))
        try:
            await self._report_fn(self._take_report())
        except asyncio.CancelledError:
            raise
        except Exception:  # the scheduler may be restarting: report next time
            log.exception("decode worker %s: report failed", self.worker_id)

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
