"""The prefill worker: applies its :class:`~scheduler.prefill_core.PrefillCore`'s decisions
to the engine (chunked prefill into paged KV), its KV producer and the decode workers.

A decode worker hands over a request with its ticket (its blocks are reserved there);
``KVProducer.begin`` opens the transfer and the request joins the core's planner queue.
Every step the policy picks the chunks (tier order and slack, within the step's token
and time budget) and the engine runs exactly those (``run_plan``, prefix-cache hits skip
shared blocks); the blocks each chunk finishes are pushed at once, so the send of chunk k
overlaps the compute of chunk k+1. The step that ends a prompt samples its first token
(one per sequence); one step's first tokens go to each decode worker as one
``PrefilledBatch``. Every turn of the loop keeps a waiting prompt's transfer alive (the
timeouts are for a hung worker, not a queue); a sent prompt's blocks go back once its
transfer is terminal. A step that fails on one request ends it alone (its decode worker
gets the error); MAX_STEP_FAILURES in a row end the step's requests. Reports (events,
prefix-cache block events, prompts still queued) go after a step with events, else every
control interval. The Ray actor around this class lives in ``cluster/worker_actors.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from engine.aio import Reporter, step_loop, wait_event
from engine.ports import EnginePort
from engine.service import (
    EngineThread,
    block_events,
    prefill_output,
    run_step,
    sampling_params,
)
from kvtransfer.ports import KVSender
from scheduler.messages import (
    HeldRequest,
    KVMemoryReport,
    PrefilledBatch,
    StartPrefill,
    WorkerReport,
)
from scheduler.policy import SchedulingPolicy
from scheduler.prefill_core import PrefillCore, PrefillStage
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerLimits, WorkerScheduler
from scheduler.topology import WorkerInfo
from scheduler.worker_core import kernel_request

log = logging.getLogger(__name__)

# Sends a report to the global scheduler; False (or raising): it did not get there, and its
# events go with the next one.
ReportFn = Callable[[WorkerReport], Awaitable[bool | None]]
NotifyFn = Callable[[str, PrefilledBatch], Awaitable[None]]
MAX_STEP_FAILURES = 3


class PrefillWorker:
    def __init__(self, info: WorkerInfo, engine: EnginePort, producer: KVSender,
                 policy: SchedulingPolicy, costs: StepCosts, limits: WorkerLimits,
                 report: ReportFn, notify_decode: NotifyFn, *,
                 control_interval_s: float = 0.1) -> None:
        self.info = info
        self.worker_id = info.worker_id
        self.engine = engine
        self.producer = producer
        self._notify = notify_decode
        self.control_interval_s = control_interval_s
        self.core = PrefillCore(info.worker_id,
                                WorkerScheduler.with_limits(info, policy, costs, limits))
        self._thread = EngineThread(f"prefill-{info.worker_id}")
        self._reporter = Reporter(f"prefill worker {info.worker_id}", self._build_report,
                                  report, self.core.delivered)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._notify_tasks: set[asyncio.Task[None]] = set()
        self._stepping: list[str] = []  # the requests of the step being run

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(step_loop(
            f"prefill worker {self.worker_id}", self._wake, self._turn,
            lambda: None if self.core.planner.has_work()
            else 0.005 if self.core.is_sending() else 0.25,
            self._give_up, max_failures=MAX_STEP_FAILURES)),
            loop.create_task(self._report_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._thread.shutdown()

    # -- control calls -------------------------------------------------------------------

    async def start_request(self, msg: StartPrefill) -> str | None:
        """Queue a prefill; None, or why the engine cannot take it (it never will)."""
        spec, rid = msg.spec, msg.spec.req_id
        prompt = list(spec.prompt_token_ids)
        try:
            params = sampling_params(spec)
        except ValueError as e:
            return f"invalid: {e}"
        if rid in self.core.jobs:
            return "invalid: duplicate request id"
        try:  # the ticket first: one it refuses leaves nothing in the engine
            self.producer.begin(msg.ticket)
        except ValueError as e:
            return f"invalid: {e}"
        self.core.start(spec, kernel_request(spec, msg.block_hashes), msg.decode_worker_id,
                        time.time())
        # The engine adds it after the step running now, ahead of any step planned after
        # this: the planner has it at once, so the next step can run its first chunk.
        added = self._thread.submit(self.engine.add_request, rid, prompt, params,
                                    prefill_only=True)
        self._wake.set()
        try:
            await added
        except ValueError as e:  # the engine refused it: it never ran (its chunk was refused)
            self.core.end(rid, "refused", time.time())
            self._stop_sending(rid)
            return f"invalid: {e}"
        return None

    def _stop_sending(self, rid: str) -> None:
        self.producer.abort(rid)
        self.producer.forget(rid)

    async def abort(self, req_id: str, error: str | None = None) -> None:
        if self.core.end(req_id, "abort", time.time()) is None:
            return
        self._stop_sending(req_id)
        await self._thread.call(self.engine.abort, req_id)

    def held_requests(self) -> tuple[HeldRequest, ...]:
        """The prefills this worker holds, for a scheduler that restarted (``WorkerHello``)."""
        return self.core.held()

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "num_free_blocks": self.engine.num_free_blocks,
                "num_total_blocks": self.engine.num_total_blocks,
                "num_requests": len(self.core.jobs), "num_steps": self.num_steps,
                "num_prefix_query_blocks": self.engine.num_prefix_query_blocks,
                "num_prefix_hit_blocks": self.engine.num_prefix_hit_blocks}

    # -- loops ---------------------------------------------------------------------------

    async def _turn(self) -> None:
        self._stepping = []
        if self.core.planner.has_work():
            await self._step()
        await self._tend_transfers()

    async def _give_up(self, n: int) -> None:
        """The step failed ``n`` times in a row: its requests end (an error each)."""
        for rid in self._stepping:
            await self._fail(rid, f"step_failed: the prefill worker's step failed {n} times")

    async def _fail(self, req_id: str, error: str) -> None:
        """End ``req_id`` here and tell its decode worker why (it tells the client)."""
        if (got := self.core.fail(req_id, error, time.time())) is None:
            return
        self._stop_sending(req_id)
        await self._thread.call(self.engine.abort, req_id)
        self._spawn_send(got[0], PrefilledBatch((got[1],)))

    def _spawn_send(self, decode_worker_id: str, batch: PrefilledBatch) -> None:
        task = asyncio.get_running_loop().create_task(self._send(decode_worker_id, batch))
        self._notify_tasks.add(task)
        task.add_done_callback(self._notify_tasks.discard)

    async def _step(self) -> None:
        core, now = self.core, time.time()
        plan = core.plan(now, self.engine.num_free_blocks)
        if not plan.chunks:
            await wait_event(self._wake, 0.01)
            return
        self._stepping = [rid for rid, _ in plan.chunks]
        core.began(plan, time.time())
        t0 = time.perf_counter()
        outs, refused, blocks, computed, _, events = await self._thread.call(
            run_step, self.engine, [], list(plan.chunks), core.protect())
        seconds = time.perf_counter() - t0
        core.block_events.extend(events)
        out = core.step_ran(plan, now, seconds=seconds, outputs=map(prefill_output, outs),
                            refused=refused, blocks=blocks, computed=computed, t=time.time())
        for rid in out.dropped:
            self._stop_sending(rid)
        for rid, ids in out.pushes:
            self.producer.push(rid, list(ids))
        for dwid, items in out.firsts.items():
            self._spawn_send(dwid, PrefilledBatch(tuple(items)))
        if core.events:
            self._reporter.soon()

    async def _send(self, decode_worker_id: str, batch: PrefilledBatch) -> None:
        try:
            await self._notify(decode_worker_id, batch)
        except Exception:  # decode worker gone: the scheduler sees it and the router retries
            log.warning("prefill worker %s: could not reach %s", self.worker_id,
                        decode_worker_id)
            for item in batch.items:
                await self.abort(item.req_id)

    async def _tend_transfers(self) -> None:
        """Every turn: a prompt still to prefill keeps its transfer alive (the turn itself
        says this worker is not hung); a sent prompt's blocks go back once its transfer
        ended."""
        for rid in self.core.ids(PrefillStage.PREFILLING):
            self.producer.keepalive(rid)
        for rid in self.core.ids(PrefillStage.SENDING):
            st = self.producer.poll(rid)
            if st is not None and not st.state.is_terminal:
                continue
            self.core.end(rid, "sent", time.time())
            self.producer.forget(rid)
            await self._thread.call(self.engine.release, rid)

    # -- reports -------------------------------------------------------------------------

    def _build_report(self) -> WorkerReport:
        self.producer.drain_stats()
        return self.core.report(self.engine.num_free_blocks, self.engine.num_total_blocks,
                                KVMemoryReport(0, 0, 0, self.engine.num_prefix_query_blocks,
                                               self.engine.num_prefix_hit_blocks))

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.control_interval_s)
            if self._reporter.busy:
                continue
            self.core.block_events.extend(block_events(
                await self._thread.call(self.engine.drain_events)))
            self._reporter.soon()
