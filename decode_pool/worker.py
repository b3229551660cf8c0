"""The decode worker: applies its :class:`~scheduler.worker_core.DecodeCore`'s decisions to
the engine, the KV plane and the RPCs; every decision about a request is the core's.

A dispatch reserves the prompt's blocks (prefix-cache hits reused) and hands the prefill
worker a ticket for them (RECEIVING), or admits the request to this engine to prefill
here (PREFILLING). The first token goes to the router as soon as the prefill worker sends
it; once the KV is all here the engine takes the request over and it decodes in the
continuous batch the core's planner composes every step (TPOT-sized, local chunks,
KV-pressure victims, swap-ins). A preemption swaps it out (SWAPPED), recomputes it here
(PREFILLING again) or migrates it with its KV (MIGRATING: a ``MigrateIn`` to the target,
which reserves and answers a ticket; the KV goes over kvtransfer; DONE hands it off and
the target streams on from the output so far; a failed move recomputes it here). Tokens
go to each router as one ``TokenBatch`` per step (its subscription stream); events go to
the global scheduler in a ``WorkerReport`` after a step that had some, else every control
interval. Blocks that a transfer may still write are freed only once it ended
(DRAINING), like vLLM's connectors. The Ray actor around this class lives in
``cluster/worker_actors.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from engine.aio import wait_event
from engine.ports import EnginePort
from engine.service import (
    EngineThread,
    block_events,
    bytes_per_block,
    kv_counters,
    sampling_params,
    shared_prefix_blocks,
    step_result,
)
from kvtransfer.ports import KVReceiver, KVSender
from kvtransfer.state import TransferState
from scheduler.block_hashes import compute_block_hashes
from scheduler.links import LinkModel
from scheduler.messages import (
    Dispatch,
    DispatchAnswer,
    HeldRequest,
    MigrateAnswer,
    MigrateIn,
    PrefilledBatch,
    StartPrefill,
    TokenBatch,
    TransferStat,
    WorkerReport,
    encode,
)
from scheduler.policy import SchedulingPolicy
from scheduler.preemption import PreemptMode
from scheduler.request import Request
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerLimits, WorkerScheduler
from scheduler.topology import WorkerInfo
from scheduler.worker_core import (
    DecodeCore,
    KVVerdict,
    Release,
    SendVerdict,
    Stage,
    eviction_order,
)

log = logging.getLogger(__name__)

# Sends a report to the global scheduler; False (or raising): it did not get there.
ReportFn = Callable[[WorkerReport], Awaitable[bool | None]]
# Returns None when the prefill worker took the request, else why it refused it.
StartPrefillFn = Callable[[str, StartPrefill], Awaitable[str | None]]
# Asks a target decode worker to take a request over; raises when it is unreachable.
MigrateFn = Callable[[str, MigrateIn], Awaitable[MigrateAnswer]]
# A step loop that fails this many times in a row ends the requests of the failing step.
MAX_STEP_FAILURES = 3


def _arrived(status: Any) -> bool | None:
    """A transfer's status as the core reads it: in flight (None), all there, or not."""
    if status is None or not status.state.is_terminal:
        return None
    return status.state is TransferState.DONE


class DecodeWorker:
    def __init__(self, info: WorkerInfo, engine: EnginePort, consumer: KVReceiver,
                 policy: SchedulingPolicy, costs: StepCosts, limits: WorkerLimits,
                 report: ReportFn, start_prefill: StartPrefillFn, *,
                 control_interval_s: float = 0.1, producer: KVSender | None = None,
                 migrate: MigrateFn | None = None, links: LinkModel | None = None) -> None:
        """``producer`` and ``migrate``: this worker can move requests out; without them a
        MIGRATE order is refused. ``links``: the link model its policy prices swaps with."""
        self.info = info
        self.worker_id = info.worker_id
        self.engine = engine
        self.consumer = consumer
        self.producer = producer
        self.limits = limits
        self._report_fn = report
        self._start_prefill = start_prefill
        self._migrate = migrate
        self.control_interval_s = control_interval_s
        self.core = DecodeCore(info.worker_id, WorkerScheduler.with_limits(
            info, policy, costs, limits), bytes_per_block=bytes_per_block(engine), links=links,
            can_migrate=producer is not None and migrate is not None)
        self._thread = EngineThread(f"decode-{info.worker_id}", engine.books)
        self._subs: dict[str, asyncio.Queue[bytes]] = {}
        self._report_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stepping: list[str] = []  # the requests of the step being run

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._step_loop()), loop.create_task(self._report_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._thread.shutdown()

    def _answer(self, rid: str, ok: bool, reason: str = "", fatal: bool = False,
                cached: int = 0) -> DispatchAnswer:
        return DispatchAnswer(rid, ok, self.engine.num_free_blocks, cached, reason, fatal)

    # -- control calls -------------------------------------------------------------------

    async def dispatch(self, msg: Dispatch) -> DispatchAnswer:
        spec, rid, core = msg.spec, msg.spec.req_id, self.core
        if (why := core.refusal(rid)) is not None:
            return self._answer(rid, False, why)
        prompt = list(spec.prompt_token_ids)
        req = Request(rid, spec.tier, spec.arrival_time, len(prompt), spec.sampling.max_tokens)
        if msg.prefill_worker_id is None:
            req.block_hashes = tuple(compute_block_hashes(prompt, self.limits.block_size))
            refusal, cached, nblocks = await self._thread.call(self._admit, rid, spec)
            if refusal is not None:
                return self._answer(rid, False, refusal, refusal.startswith("invalid"))
            core.prefill_here(req, nblocks, cached, time.time(), spec=spec)
            self._wake.set()
            return self._answer(rid, True, cached=cached // self.limits.block_size)
        try:
            blocks, num_cached = self._reserve(rid, len(prompt), prompt)
        except ValueError as e:  # longer than the model's context or the whole pool
            return self._answer(rid, False, f"invalid: {e}", True)
        if blocks is None:
            return self._answer(rid, False, "no room")
        ticket = self.consumer.expect(rid, blocks, present=tuple(range(num_cached)))
        core.receive(req, tuple(blocks), msg.prefill_worker_id, time.time(), spec=spec)
        try:
            refusal = await self._start_prefill(msg.prefill_worker_id,
                                                StartPrefill(spec, self.worker_id, ticket))
        except Exception as e:  # the prefill worker is gone: a retryable error, bounded
            log.warning("start of %s on %s failed: %s", rid, msg.prefill_worker_id, e)
            refusal = "worker_failed"
        if refusal is not None:
            await self._release(rid, core.abandon(rid, time.time()))
            return self._answer(rid, False, refusal, True)
        self._wake.set()
        return self._answer(rid, True, cached=num_cached)

    def _admit(self, rid: str, spec: Any) -> tuple[str | None, int, int]:
        """On the engine thread: a request prefilled here, with all of its blocks."""
        try:
            self.engine.add_request(rid, list(spec.prompt_token_ids), sampling_params(spec))
        except ValueError as e:  # the request can never run here
            return f"invalid: {e}", 0, 0
        if not self.engine.admit(rid):
            self.engine.abort(rid)
            return "no room", 0, 0
        return None, self.engine.num_computed_tokens(rid), len(self.engine.block_ids(rid))

    def _reserve(self, rid: str, num_tokens: int, tokens: list[int]
                 ) -> tuple[list[int] | None, int]:
        """Blocks for incoming KV, reserved on the event loop under the engine's books: it
        never waits for a model forward, so a dispatch is answered within a few ms."""
        with self.engine.books:
            blocks = self.engine.reserve(rid, num_tokens, prompt_token_ids=tokens)
            return blocks, (0 if blocks is None else self.engine.num_reserved_cached_blocks(rid))

    async def prefilled(self, batch: PrefilledBatch) -> None:
        for item in batch.items:
            if not self.core.first_token(item, time.time()):
                await self.abort(item.req_id, error=item.error)
        self._flush()
        self._wake.set()

    async def subscribe(self, router_id: str) -> AsyncIterator[bytes]:
        """One router's token stream: a ``TokenBatch`` per step that had tokens for it."""
        q: asyncio.Queue[bytes] = asyncio.Queue()
        old = self._subs.get(router_id)
        self._subs[router_id] = q
        self.core.router_joined(router_id)
        if old is not None:
            old.put_nowait(b"")  # a re-subscription replaces the old stream: end it
        self._flush()
        try:
            while item := await q.get():
                yield item
        finally:
            if self._subs.get(router_id) is q:
                del self._subs[router_id]
                self.core.router_left(router_id, time.time())

    async def abort(self, req_id: str, error: str | None = None) -> None:
        """Drop the request; ``error`` set: its router hears it (and may retry)."""
        await self._release(req_id, self.core.abort(req_id, time.time(), error))
        self._flush()

    async def _release(self, rid: str, release: Release) -> None:
        if release is Release.END_TRANSFER:
            self.consumer.abort(rid)
            await self._drain(rid)
        elif release is Release.STOP_SENDING:
            if self.producer is not None:
                self.producer.abort(rid)  # no new read of its blocks from here on
                self.producer.forget(rid)
            await self._thread.call(self.engine.abort, rid)
        elif release is Release.FREE:
            await self._thread.call(self.engine.abort, rid)

    async def _drain(self, rid: str) -> None:
        """Free a draining reservation once nothing can land in it any more."""
        status = self.consumer.poll(rid)
        if status is not None and not status.state.is_terminal:
            self._wake.set()
            return
        if status is not None:
            self.consumer.forget(rid)
        self.core.drained(rid, time.time())
        await self._thread.call(self.engine.abort, rid)

    async def preempt(self, req_id: str, mode: PreemptMode, for_req_id: str | None,
                      target_worker_id: str | None = None) -> bool:
        """Swap out, recompute or migrate ``req_id`` for ``for_req_id`` (None: this
        worker's own KV pressure), as the core decides."""
        v = self.core.preempt_order(req_id, mode, target_worker_id)
        if v.ok is not None:
            return v.ok
        if v.action == "fall_back":
            if self.producer is not None:
                self.producer.abort(req_id)
            return await self._fall_back(req_id, "target_lost")
        if v.action == "migrate":
            return await self._migrate_out(req_id, for_req_id, target_worker_id or "")
        free_before = self.engine.num_free_blocks

        def evict() -> tuple[PreemptMode | None, int, float]:
            if self.engine.request_state(req_id) is None:
                return None, 0, 0.0  # it finished in the step that just ran
            n = len(self.engine.block_ids(req_id))
            for m in eviction_order(mode, not self.engine.can_recompute(req_id)):
                t0 = time.perf_counter()
                if m is PreemptMode.SWAP and self.engine.swap_out(req_id):
                    return m, n, time.perf_counter() - t0
                if m is PreemptMode.RECOMPUTE and self.engine.preempt_recompute(req_id):
                    return m, n, 0.0
            return None, n, 0.0

        done, n, seconds = await self._thread.call(evict)
        ok = self.core.evicted(req_id, done, for_req_id, time.time(), num_blocks=n,
                               seconds=seconds,
                               num_freed=self.engine.num_free_blocks - free_before)
        self._wake.set()
        return ok

    async def _migrate_out(self, rid: str, for_req_id: str | None, target: str) -> bool:
        assert self.producer is not None and self._migrate is not None
        snap = await self._thread.call(self.engine.detach_for_migration, rid)
        if snap is None:
            return False
        core = self.core
        core.migrating(rid, time.time())
        e = core.entries[rid]
        msg = MigrateIn(e.spec, snap.output_token_ids, snap.num_computed,  # type: ignore[arg-type]
                        self.worker_id, e.req.first_token_time)
        try:
            ans: MigrateAnswer | None = await self._migrate(target, msg)
        except Exception as err:  # the target is gone: the request stays here
            log.warning("migration of %s to %s failed to start: %s", rid, target, err)
            ans = None
        taken = ans is not None and ans.ticket is not None
        ok = core.migration_answered(rid, target if taken else None, for_req_id,
                                     snap.num_computed, tuple(snap.block_ids), time.time())
        if ok:
            self.producer.begin(ans.ticket)  # type: ignore[union-attr]
            self.producer.push(rid, list(snap.block_ids))
        elif core.get(rid) is not None:  # refused, not aborted meanwhile: it stays here
            await self._thread.call(self.engine.reattach, rid)
            core.reattached(rid, snap.num_computed, len(snap.block_ids), time.time())
        self._wake.set()
        return ok

    async def migrate_in(self, msg: MigrateIn) -> MigrateAnswer:
        """Take a request over from another decode worker: reserve its blocks (prefix-cache
        hits here are not sent) and answer the ticket its KV comes with."""
        spec, rid = msg.spec, msg.spec.req_id
        why = self.core.refusal(rid) or self.core.migration_refusal(msg)
        if why is not None:
            return MigrateAnswer(rid, None, why)
        tokens = list(spec.prompt_token_ids + msg.output_token_ids)
        try:
            blocks, num_cached = self._reserve(rid, msg.num_computed, tokens)
        except ValueError as e:
            return MigrateAnswer(rid, None, f"invalid: {e}")
        if blocks is None:
            return MigrateAnswer(rid, None, "no room")
        ticket = self.consumer.expect(rid, blocks, present=tuple(range(num_cached)))
        req = Request(rid, spec.tier, spec.arrival_time, len(spec.prompt_token_ids),
                      spec.sampling.max_tokens)
        self.core.receive(req, tuple(blocks), msg.from_worker_id, time.time(), spec=spec,
                          migrated_in=msg)
        self._wake.set()
        self._report_soon()
        return MigrateAnswer(rid, ticket, num_cached_blocks=num_cached)

    async def _fall_back(self, rid: str, why: str) -> bool:
        """A migration that will not complete: recompute the request here."""
        if self.producer is not None:
            self.producer.forget(rid)
        free_before = self.engine.num_free_blocks
        if not await self._thread.call(self.engine.preempt_recompute, rid):
            return False
        log.warning("migration of %s did not complete (%s): recomputing it here", rid, why)
        self.core.fell_back(rid, why, self.engine.num_free_blocks - free_before, time.time())
        self._wake.set()
        return True

    async def release_waiting(self, prefill_worker_id: str,
                              req_ids: tuple[str, ...] | None = None) -> list[str]:
        """``prefill_worker_id`` died: drop the requests still receiving from it whose KV or
        first token has not arrived (their routers hear ``worker_failed`` and retry)."""
        dropped = self.core.lost_source(prefill_worker_id, req_ids,
                                        lambda rid: _arrived(self.consumer.poll(rid)))
        for rid in dropped:
            await self.abort(rid, error="worker_failed")  # the scheduler ends it in its view
        return dropped

    def held_requests(self) -> tuple[HeldRequest, ...]:
        return self.core.held()

    def status(self) -> dict[str, Any]:
        swap = self.engine.swap
        return {"worker_id": self.worker_id, "num_free_blocks": self.engine.num_free_blocks,
                "num_total_blocks": self.engine.num_total_blocks,
                "num_requests": self.core.num_requests, "num_steps": self.num_steps,
                "num_swap_used": swap.num_used, "num_swap_peak": swap.num_peak,
                "num_swap_blocks": swap.capacity,
                "num_prefix_query_blocks": self.engine.num_prefix_query_blocks,
                "num_prefix_hit_blocks": self.engine.num_prefix_hit_blocks}

    def _flush(self) -> None:
        for router_id, deltas in self.core.take_outbox():
            self._subs[router_id].put_nowait(encode(TokenBatch(self.worker_id, deltas)))

    # -- the step loop -------------------------------------------------------------------

    async def _step_loop(self) -> None:
        failures = 0
        while True:
            if not self.core.has_work():
                await wait_event(self._wake, 0.005 if self.core.is_waiting() else 0.25)
            self._wake.clear()
            self._stepping = []
            num_events = len(self.core.events)
            try:
                await self._tend_transfers()
                if self.core.has_work():
                    await self._step()
                self._flush()
                if len(self.core.events) > num_events or self.core.report_due:
                    self._report_soon()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving the other requests
                failures += 1
                log.exception("decode worker %s: step failed (%d in a row)", self.worker_id,
                              failures)
                if failures >= MAX_STEP_FAILURES:  # a bound, never a retry forever
                    failures = 0
                    for rid in self._stepping:
                        if self.core.fail(rid, "step_failed", time.time()):
                            await self.abort(rid, error="step_failed: the worker's step "
                                             f"failed {MAX_STEP_FAILURES} times")
                await asyncio.sleep(0.05)

    async def _tend_transfers(self) -> None:
        """Drained reservations freed, migrations out handed off (or recomputed), KV that
        arrived joined to the engine."""
        core = self.core
        for rid in core.ids(Stage.DRAINING):
            await self._drain(rid)
        for rid in core.ids(Stage.MIGRATING):
            if self.producer is None or core.entries[rid].out is None:
                continue
            st = self.producer.poll(rid)
            verdict = core.send_progress(rid, _arrived(st) if st is not None else False)
            if verdict is SendVerdict.WAIT:
                continue
            if st is not None:
                self.producer.forget(rid)
            if verdict is SendVerdict.FALL_BACK:
                await self._fall_back(rid, "transfer " + ("lost" if st is None else st.state.value))
                continue
            free_before = self.engine.num_free_blocks
            await self._thread.call(self.engine.abort, rid)
            core.handed_off(rid, self.engine.num_free_blocks - free_before, time.time())
        for rid in core.ids(Stage.RECEIVING):
            st = self.consumer.poll(rid)
            verdict = core.kv_progress(rid, _arrived(st), time.time())
            if verdict in (KVVerdict.ENDED, KVVerdict.DROPPED):
                await self._release(rid, Release.END_TRANSFER)
            elif verdict is KVVerdict.FAILED:
                log.warning("transfer of %s failed: %s", rid, "" if st is None else st.detail)
                await self.abort(rid, error="transfer_failed")
            elif verdict is KVVerdict.JOIN:
                await self._join(rid)

    async def _join(self, rid: str) -> None:
        e = self.core.entries[rid]
        self.consumer.forget(rid)
        spec, msg = e.spec, e.migrated_in
        assert spec is not None
        try:
            if msg is not None:
                await self._thread.call(self.engine.add_migrated_request, rid,
                                        list(spec.prompt_token_ids + msg.output_token_ids),
                                        len(spec.prompt_token_ids), sampling_params(spec),
                                        list(e.block_ids))
            else:
                await self._thread.call(self.engine.add_prefilled_request, rid,
                                        list(spec.prompt_token_ids), e.first_tokens(),
                                        sampling_params(spec), list(e.block_ids))
        except ValueError as err:  # it can never decode here: it ends alone (retried)
            log.warning("request %s cannot decode here: %s", rid, err)
            reason = "worker_failed" if msg is not None else "invalid"
            self.core.fail(rid, reason, time.time())
            await self.abort(rid, error=reason if msg is not None else f"invalid: {err}")
            return
        self.core.joined(rid, time.time())

    async def _step(self) -> None:
        core, now = self.core, time.time()
        plan = core.plan(now, self.engine.num_free_blocks, self.engine.swap.num_free)
        if plan.is_empty:
            await wait_event(self._wake, 0.01)
            return
        for rid, mode in core.victims(plan):
            await self.preempt(rid, mode, None)
        for rid in plan.swap_in:
            await self._swap_in(rid)
        decodes = core.runnable(plan)
        self._stepping = [*decodes, *(rid for rid, _ in plan.chunks)]
        began, t0 = time.time(), time.perf_counter()
        outs, refused, blocks, computed, shared, events = await self._thread.call(
            self._run, decodes, list(plan.chunks), core.protect())
        core.block_events.extend(events)
        core.step_ran(plan, now, began=began, seconds=time.perf_counter() - t0,
                      results=[step_result(o) for o in outs], refused=refused, blocks=blocks,
                      computed=computed, shared=shared)

    def _run(self, decodes: list[str], chunks: list[tuple[str, int]],
             protect: frozenset[int] | None) -> tuple[Any, ...]:
        """On the engine thread: the step, then the block counts the planner tracks."""
        if protect is not None:
            self.engine.protect_prefixes(protect)
        outs, refused = self.engine.run_plan(decodes, chunks)
        blocks, computed, shared = {}, {}, {}
        for rid in [*decodes, *(c for c, _ in chunks)]:
            if self.engine.request_state(rid) is not None:
                ids = self.engine.block_ids(rid)
                blocks[rid] = len(ids)
                computed[rid] = self.engine.num_computed_tokens(rid)
                shared[rid] = shared_prefix_blocks(self.engine, ids)
        return outs, refused, blocks, computed, shared, block_events(self.engine.drain_events())

    async def _swap_in(self, rid: str) -> None:
        e = self.core.get(rid)
        if e is None or e.stage is not Stage.SWAPPED:
            return

        def swap_in() -> tuple[int, float] | None:
            t0 = time.perf_counter()
            if not self.engine.swap_in(rid):
                return None
            return len(self.engine.block_ids(rid)), time.perf_counter() - t0

        if (got := await self._thread.call(swap_in)) is not None:
            self.core.swapped_in(rid, got[0], got[1], time.time())

    # -- reports -------------------------------------------------------------------------

    def _report_soon(self) -> None:
        if self._report_task is None or self._report_task.done():
            self._report_task = asyncio.get_running_loop().create_task(self._send_report())

    async def _send_report(self) -> None:
        core = self.core
        for s in self.consumer.drain_stats():
            if s.state is TransferState.DONE:
                core.transfers.append(TransferStat(s.req_id, s.num_bytes, s.duration_s,
                                                   s.end_time, s.topology.value))
        if self.producer is not None:  # migrations out: whole transfers, a link's pace
            for s in self.producer.drain_stats():
                if s.state is TransferState.DONE and s.num_bytes:
                    core.moved(s.req_id, s.num_bytes, s.duration_s)
        rep = core.report(self.engine.num_free_blocks, self.engine.num_total_blocks,
                          kv_counters(self.engine))
        try:
            delivered = await self._report_fn(rep) is not False
        except asyncio.CancelledError:
            raise
        except Exception:  # the scheduler may be restarting: report next time
            log.exception("decode worker %s: report failed", self.worker_id)
            delivered = False
        core.delivered(rep, delivered)

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.control_interval_s)
            for rid in self.core.expire(time.time()):
                log.info("the router of %s is gone: aborting it", rid)
                await self.abort(rid)
            if self._report_task is not None and not self._report_task.done():
                continue
            self.core.block_events.extend(block_events(
                await self._thread.call(self.engine.drain_events)))
            self._report_soon()
