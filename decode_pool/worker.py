"""The decode worker: applies its :class:`~scheduler.worker_core.DecodeCore`'s decisions to
the engine (:class:`~engine.ports.EnginePort`), the KV plane (``kvtransfer.ports``) and the
RPCs; every decision about a request, and the life it follows, is the core's (see there).
What is left here is mechanism: which engine call, on which thread; which transfer to
poll, begin or end; which message to which worker; tokens to each router as one
``TokenBatch`` per step (its subscription stream); a ``WorkerReport`` after a step that
had events, else every control interval. The Ray actor around it: ``cluster/worker_actors.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from engine import service
from engine.aio import Reporter, Streams, step_loop, wait_event
from engine.ports import EnginePort
from kvtransfer.ports import KVReceiver, KVSender, arrived, done_transfers
from scheduler import worker_core as wc
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
    WorkerReport,
    encode,
)
from scheduler.policy import SchedulingPolicy
from scheduler.preemption import PreemptMode
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerLimits, WorkerScheduler
from scheduler.topology import WorkerInfo

log = logging.getLogger(__name__)

# The RPCs: a report to the global scheduler (False or raising: it did not get there); a
# prefill start (None: taken, else why not); a migration in (raises: target unreachable).
ReportFn = Callable[[WorkerReport], Awaitable[bool | None]]
StartPrefillFn = Callable[[str, StartPrefill], Awaitable[str | None]]
MigrateFn = Callable[[str, MigrateIn], Awaitable[MigrateAnswer]]
MAX_STEP_FAILURES = 3  # failed steps in a row that end the failing step's requests


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
        self._start_prefill = start_prefill
        self._migrate = migrate
        self.control_interval_s = control_interval_s
        self.core = wc.DecodeCore(info.worker_id, WorkerScheduler.with_limits(
            info, policy, costs, limits), bytes_per_block=service.bytes_per_block(engine),
            links=links, can_migrate=producer is not None and migrate is not None)
        self._thread = service.EngineThread(f"decode-{info.worker_id}", engine.books)
        self._streams = Streams(self.core.router_joined,
                                lambda router_id: self.core.router_left(router_id, time.time()))
        self._reporter = Reporter(f"decode worker {info.worker_id}", self._build_report,
                                  report, self.core.delivered)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stepping: list[str] = []  # the requests of the step being run

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(step_loop(
            f"decode worker {self.worker_id}", self._wake, self._turn,
            lambda: None if self.core.has_work() else 0.005 if self.core.is_waiting() else 0.25,
            self._give_up, max_failures=MAX_STEP_FAILURES)),
            loop.create_task(self._report_loop())]

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
        req = wc.kernel_request(spec, msg.block_hashes)
        if msg.prefill_worker_id is None:
            refusal, cached, nblocks = await self._thread.call(service.admit_here, self.engine,
                                                               rid, spec)
            if refusal is not None:
                return self._answer(rid, False, refusal, refusal.startswith("invalid"))
            core.prefill_here(req, nblocks, cached, time.time(), spec=spec)
            self._wake.set()
            return self._answer(rid, True, cached=cached // self.limits.block_size)
        refusal, blocks, num_cached, ticket = self._expect(rid, len(prompt), prompt)
        if refusal is not None:
            return self._answer(rid, False, refusal, refusal.startswith("invalid"))
        core.receive(req, blocks, msg.prefill_worker_id, time.time(), spec=spec)
        try:
            refusal = await self._start_prefill(msg.prefill_worker_id,
                                                StartPrefill(spec, self.worker_id, ticket,
                                                             msg.block_hashes))
        except Exception as e:  # the prefill worker is gone: a retryable error, bounded
            log.warning("start of %s on %s failed: %s", rid, msg.prefill_worker_id, e)
            refusal = "worker_failed"
        if refusal is not None:
            await self._release(rid, core.abandon(rid, time.time()))
            return self._answer(rid, False, refusal, True)
        self._wake.set()
        return self._answer(rid, True, cached=num_cached)

    def _expect(self, rid: str, num_tokens: int, tokens: list[int]
                ) -> tuple[str | None, tuple[int, ...], int, Any]:
        """Reserve blocks for incoming KV (cached prefix first) and the ticket its sender
        needs: (why not, or None; the blocks; how many were cached; the ticket)."""
        try:
            blocks, num_cached = service.reserve_kv(self.engine, rid, num_tokens, tokens)
        except ValueError as e:  # longer than the model's context or the whole pool
            return f"invalid: {e}", (), 0, None
        if blocks is None:
            return "no room", (), 0, None
        ticket = self.consumer.expect(rid, blocks, present=tuple(range(num_cached)))
        return None, tuple(blocks), num_cached, ticket

    async def prefilled(self, batch: PrefilledBatch) -> None:
        for item in batch.items:
            if not self.core.first_token(item, time.time()):
                await self.abort(item.req_id, error=item.error)
        self._flush()
        self._wake.set()

    def subscribe(self, router_id: str) -> AsyncIterator[bytes]:
        """One router's token stream: a ``TokenBatch`` per step that had tokens for it."""
        return self._streams.subscribe(router_id, self._flush)

    async def abort(self, req_id: str, error: str | None = None) -> None:
        """Drop the request; ``error`` set: its router hears it (and may retry)."""
        await self._release(req_id, self.core.abort(req_id, time.time(), error))
        self._flush()

    async def _release(self, rid: str, release: wc.Release) -> None:
        if release is wc.Release.END_TRANSFER:
            self.consumer.abort(rid)
            await self._drain(rid)
            return
        if release is wc.Release.STOP_SENDING and self.producer is not None:
            self.producer.abort(rid)  # no new read of its blocks from here on
            self.producer.forget(rid)
        if release is not wc.Release.NOTHING:
            self._free(rid)

    def _free(self, rid: str) -> None:
        """Its blocks go back after the step in flight; an abort is answered at once."""
        self._thread.post(self.engine.abort, rid)

    async def _drain(self, rid: str) -> None:
        """Free a draining reservation once nothing can land in it any more."""
        status = self.consumer.poll(rid)
        if status is not None and not status.state.is_terminal:
            self._wake.set()
            return
        if status is not None:
            self.consumer.forget(rid)
        self.core.drained(rid, time.time())
        self._free(rid)

    async def preempt(self, req_id: str, mode: PreemptMode, for_req_id: str | None,
                      target_worker_id: str | None = None) -> bool:
        """Swap out, recompute or migrate ``req_id`` for ``for_req_id`` (None: this
        worker's own KV pressure), as the core decides."""
        v = self.core.preempt_order(req_id, mode, target_worker_id)
        if v.ok is not None:
            return v.ok
        if v.action is wc.PreemptAction.FALL_BACK:
            if self.producer is not None:
                self.producer.abort(req_id)
            return await self._fall_back(req_id, "target_lost")
        if v.action is wc.PreemptAction.MIGRATE:
            return await self._migrate_out(req_id, for_req_id, target_worker_id or "")
        free_before = self.engine.num_free_blocks
        done, n, seconds = await self._thread.call(
            service.evict, self.engine, req_id, lambda forked: wc.eviction_order(mode, forked))
        ok = self.core.evicted(req_id, done, for_req_id, time.time(), num_blocks=n,
                               seconds=seconds, num_freed=self.engine.num_free_blocks - free_before)
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
        refusal, blocks, num_cached, ticket = self._expect(
            rid, msg.num_computed, list(spec.prompt_token_ids + msg.output_token_ids))
        if refusal is not None:
            return MigrateAnswer(rid, None, refusal)
        self.core.receive(wc.kernel_request(spec), blocks, msg.from_worker_id, time.time(),
                          spec=spec, migrated_in=msg)
        self._wake.set()
        self._reporter.soon()
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
                                        lambda rid: arrived(self.consumer.poll(rid)))
        for rid in dropped:
            await self.abort(rid, error="worker_failed")  # the scheduler ends it in its view
        return dropped

    def held_requests(self) -> tuple[HeldRequest, ...]:
        return self.core.held()

    def status(self) -> dict[str, Any]:
        swap = self.engine.swap
        kv = self.consumer.listener_stats()
        return {"worker_id": self.worker_id, **service.engine_status(self.engine),
                "num_requests": self.core.num_requests, "num_steps": self.core.num_steps,
                "num_swap_used": swap.num_used, "num_swap_peak": swap.num_peak,
                "num_swap_blocks": swap.capacity,
                # what the KV listener refused, by kind (kvtransfer.guard), and its health
                "kv_refused_accept": {r.value: n for r, n in kv.accept.items()},
                "kv_refused_pairs": {r.value: n for r, n in kv.pairs.items()},
                "kv_thread_restarts": kv.num_thread_restarts, "kv_healthy": kv.is_healthy}

    def _flush(self) -> None:
        for router_id, deltas in self.core.take_outbox():
            self._streams.put(router_id, encode(TokenBatch(self.worker_id, deltas)))

    # -- the step loop -------------------------------------------------------------------

    async def _turn(self) -> None:
        self._stepping = []
        num_events = len(self.core.events)
        await self._tend_transfers()
        if self.core.has_work():
            await self._step()
        self._flush()
        if len(self.core.events) > num_events or self.core.report_due:
            self._reporter.soon()

    async def _give_up(self, n: int) -> None:
        """The step failed ``n`` times in a row: its requests end (an error each)."""
        for rid in self._stepping:
            if self.core.fail(rid, "step_failed", time.time()):
                await self.abort(rid, error=f"step_failed: the worker's step failed {n} times")

    async def _tend_transfers(self) -> None:
        """Drained reservations freed, migrations out handed off (or recomputed), KV that
        arrived joined to the engine."""
        core = self.core
        for rid in core.ids(wc.Stage.DRAINING):
            await self._drain(rid)
        for rid in core.sending():
            assert self.producer is not None
            st = self.producer.poll(rid)
            verdict = core.send_progress(rid, arrived(st) if st is not None else False)
            if verdict is wc.SendVerdict.WAIT:
                continue
            if st is not None:
                self.producer.forget(rid)
            if verdict is wc.SendVerdict.FALL_BACK:
                await self._fall_back(rid, "transfer " + ("lost" if st is None else st.state.value))
                continue
            free_before = self.engine.num_free_blocks
            await self._thread.call(self.engine.abort, rid)
            core.handed_off(rid, self.engine.num_free_blocks - free_before, time.time())
        for rid in core.ids(wc.Stage.RECEIVING):
            st = self.consumer.poll(rid)
            verdict = core.kv_progress(rid, arrived(st), time.time())
            if verdict in (wc.KVVerdict.ENDED, wc.KVVerdict.DROPPED):
                await self._release(rid, wc.Release.END_TRANSFER)
            elif verdict is wc.KVVerdict.FAILED:
                log.warning("transfer of %s failed: %s", rid, "" if st is None else st.detail)
                await self.abort(rid, error="transfer_failed")
            elif verdict is wc.KVVerdict.JOIN:
                await self._join(rid)

    async def _join(self, rid: str) -> None:
        e, msg = self.core.entries[rid], self.core.entries[rid].migrated_in
        self.consumer.forget(rid)
        try:
            await self._thread.call(service.add_arrived, self.engine, rid, e.spec,
                                    list(e.block_ids), outputs=msg and msg.output_token_ids,
                                    first_tokens=None if msg else e.first_tokens())
        except ValueError as err:  # it can never decode here: it ends alone (retried)
            log.warning("request %s cannot decode here: %s", rid, err)
            await self.abort(rid, error=self.core.cannot_join(rid, str(err), time.time()))
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
        for rid in filter(core.swappable, plan.swap_in):
            if (got := await self._thread.call(service.swap_in, self.engine, rid)) is not None:
                core.swapped_in(rid, got[0], got[1], time.time())
        decodes = core.runnable(plan)
        self._stepping = [*decodes, *(rid for rid, _ in plan.chunks)]
        began, t0 = time.time(), time.perf_counter()
        outs, refused, blocks, computed, shared, events = await self._thread.call(
            service.run_step, self.engine, decodes, list(plan.chunks), core.protect(),
            shared=True)
        core.block_events.extend(events)
        core.step_ran(plan, now, began=began, ended=time.time(),
                      seconds=time.perf_counter() - t0,
                      results=[service.step_result(o) for o in outs], refused=refused,
                      blocks=blocks, computed=computed, shared=shared)

    # -- reports -------------------------------------------------------------------------

    def _build_report(self) -> WorkerReport:
        core = self.core
        core.transfers.extend(done_transfers(self.consumer))
        for t in done_transfers(self.producer) if self.producer is not None else ():
            if t.num_bytes:  # a migration out: a link's pace
                core.moved(t.req_id, t.num_bytes, t.duration_s)
        report = core.report(self.engine.num_free_blocks, self.engine.num_total_blocks,
                             service.kv_counters(self.engine))
        if not self.consumer.is_healthy():  # no new pair can open: the scheduler replaces us
            report = replace(report, is_healthy=False)
        return report

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.control_interval_s)
            for rid in self.core.expire(time.time()):
                log.info("the router of %s is gone: aborting it", rid)
                await self.abort(rid)
            if self._reporter.busy:
                continue
            self.core.block_events.extend(service.block_events(
                await self._thread.call(self.engine.drain_events)))
            self._reporter.soon()
