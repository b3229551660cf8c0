"""The prefill worker: chunked prefill into paged KV, streaming blocks to the decode worker.

Life of a request on a prefill worker (STYLE.md item 7):

1. START: a decode worker hands over the request with its ticket (the decode worker's
   blocks are already reserved); ``KVProducer.begin`` opens the transfer (the pair's
   process group is built on first use). The request joins the worker's
   :class:`~scheduler.step_planner.WorkerScheduler` queue, ordered by the policy.
2. PREFILL: every step the policy picks the chunks (tier order and slack, within the
   step's token and time budget: a tier-0 arrival runs in the next step, ahead of a long
   lower-tier prompt) and the engine runs exactly those (``run_plan``, prefix-cache hits
   skip shared blocks). A prompt's first chunk admits it with all of its blocks; the
   planner is told them after every step, so its later chunks need no free block (a
   prompt paused between chunks keeps its blocks and resumes whenever the policy picks it
   again). The blocks each chunk finishes are pushed to the producer at once, so the
   send of chunk k overlaps the compute of chunk k+1. Cached blocks that prefix requests
   still waiting here (as the policy names them: tierserve's tiers 0 and 1) are evicted
   only after every other reusable block.
3. FIRST TOKEN: the step that ends a prompt samples its first token (one per sequence of
   an ``n > 1`` request, with their logprobs and the prompt's when asked); the first
   tokens of one step go to each decode worker as one ``PrefilledBatch`` (PREFILL_DONE is
   reported). A first token that is also the last ends a one-sequence request there.
   Until then every turn of the step loop keeps the request's transfer alive
   (``KVProducer.keepalive``), however long the policy keeps it waiting: the transfer's
   timeouts are for a hung worker, not for a queue.
4. RELEASE: once the transfer is terminal (DONE, FAILED or ABORTED) the request's blocks
   are released; full blocks stay in the prefix cache for later prompts.
5. ABORT: the cluster's abort or a failed transfer drops the request in any stage.
6. FAIL: a step that fails because of one request (the engine reruns a failed batch one
   request at a time) ends that request alone: its transfer is aborted and its decode
   worker gets a ``Prefilled`` with the error, which goes to its client. A step loop that
   fails MAX_STEP_FAILURES times in a row ends the requests of that step the same way.

Reports to the global scheduler (its PREFILL_DONE events, the prefix cache's block events,
the prompts still queued here) go right after a step that produced events, else every
control interval; a report that does not get there leaves its events for the next one.

:class:`PrefillWorker` is a plain class; the Ray actor around it lives in
``cluster/worker_actors.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine.aio import wait_event
from engine.service import EngineThread, block_events, sampling_params, token_delta
from scheduler.block_hashes import compute_block_hashes
from scheduler.messages import (
    BlockEvent,
    GenerationSpec,
    HeldRequest,
    HeldStage,
    KVMemoryReport,
    Prefilled,
    PrefilledBatch,
    ReqEvent,
    RunningReq,
    StartPrefill,
    WorkerEvent,
    WorkerReport,
)
from scheduler.policy import SchedulingPolicy
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerLimits, WorkerScheduler
from scheduler.topology import WorkerInfo

log = logging.getLogger(__name__)

# Sends a report to the global scheduler; False (or raising): it did not get there, and its
# events go with the next one.
ReportFn = Callable[[WorkerReport], Awaitable[bool | None]]
NotifyFn = Callable[[str, PrefilledBatch], Awaitable[None]]
MAX_STEP_FAILURES = 3
# Events kept for the scheduler while its reports fail (it is restarting, say): the oldest
# beyond this go (a restarted scheduler learns what this worker holds from its hello).
MAX_UNREPORTED = 10_000


@dataclass(slots=True)
class _Job:
    spec: GenerationSpec
    decode_worker_id: str
    kreq: Request
    received: float  # when it reached this worker
    started: float = 0.0  # when the step that ran its first chunk began
    prefill_done: bool = False


class PrefillWorker:
    def __init__(self, info: WorkerInfo, engine: Any, producer: Any, policy: SchedulingPolicy,
                 costs: StepCosts, limits: WorkerLimits, report: ReportFn, notify_decode: NotifyFn,
                 *, control_interval_s: float = 0.1) -> None:
        self.info = info
        self.worker_id = info.worker_id
        self.engine = engine
        self.producer = producer
        self.policy = policy
        self._report_fn = report
        self._notify = notify_decode
        self.control_interval_s = control_interval_s
        self.sched = WorkerScheduler.with_limits(info, policy, costs, limits)
        self._thread = EngineThread(f"prefill-{info.worker_id}")
        self._jobs: dict[str, _Job] = {}
        self._events: list[ReqEvent] = []
        self._block_events: list[BlockEvent] = []
        self._report_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._notify_tasks: set[asyncio.Task[None]] = set()
        self._stepping: list[str] = []  # the requests of the step being run
        self._protected: frozenset[int] = frozenset()
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

    async def start_request(self, msg: StartPrefill) -> str | None:
        """Queue a prefill; None, or why the engine cannot take it (it never will)."""
        spec = msg.spec
        rid = spec.req_id
        prompt = list(spec.prompt_token_ids)
        if rid in self._jobs:
            return "invalid: duplicate request id"
        try:
            params = sampling_params(spec)
        except ValueError as e:
            return f"invalid: {e}"
        # The engine adds it on its thread after the step running now, ahead of any step
        # planned after this: the planner takes it at once, so the next step can run its
        # first chunk. Awaiting the add first let the step loop plan that next step
        # without it (the add's answer came after the step's), so an urgent prompt waited
        # for two chunks of other prompts instead of one (issue 22, item 6).
        added = self._thread.submit(self.engine.add_request, rid, prompt, params,
                                    prefill_only=True)
        self.producer.begin(msg.ticket)
        kreq = Request(rid, spec.tier, spec.arrival_time, len(prompt), spec.sampling.max_tokens,
                       state=RequestState.PREFILLING,
                       block_hashes=tuple(compute_block_hashes(prompt, self.sched.block_size)))
        received = time.time()
        self._jobs[rid] = _Job(spec, msg.decode_worker_id, kreq, received)
        self.sched.add_prefill(kreq, len(prompt), received)
        self._wake.set()
        try:
            await added
        except ValueError as e:  # the engine refused it: it never ran (its chunk was refused)
            self._jobs.pop(rid, None)
            self.sched.remove(rid)
            self.producer.abort(rid)
            self.producer.forget(rid)
            return f"invalid: {e}"
        return None

    async def abort(self, req_id: str, error: str | None = None) -> None:
        job = self._jobs.pop(req_id, None)
        if job is None:
            return
        self.sched.remove(req_id)
        self.producer.abort(req_id)
        self.producer.forget(req_id)
        await self._thread.call(self.engine.abort, req_id)

    def held_requests(self) -> tuple[HeldRequest, ...]:
        """The prefills this worker holds, for a scheduler that restarted (``WorkerHello``):
        their decode workers keep the ones this worker still has."""
        return tuple(HeldRequest(j.spec, HeldStage.PREFILLING, 0, 0, self.worker_id,
                                 num_prefill_left=self.sched.local[rid].num_prefill_left
                                 if rid in self.sched.local else 0)
                     for rid, j in self._jobs.items())

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "num_free_blocks": self.engine.num_free_blocks,
                "num_total_blocks": self.engine.num_total_blocks, "num_requests": len(self._jobs),
                "num_steps": self.num_steps,
                "num_prefix_query_blocks": self.engine.num_prefix_query_blocks,
                "num_prefix_hit_blocks": self.engine.num_prefix_hit_blocks}

    # -- loops ---------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        failures = 0
        while True:
            sending = any(j.prefill_done for j in self._jobs.values())
            if not self.sched.has_work():
                await wait_event(self._wake, 0.005 if sending else 0.25)
            self._wake.clear()
            self._stepping = []
            try:
                if self.sched.has_work():
                    await self._step()
                await self._tend_transfers()
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving the other requests
                failures += 1
                log.exception("prefill worker %s: step failed (%d in a row)", self.worker_id,
                              failures)
                if failures >= MAX_STEP_FAILURES:  # a bound, never a retry forever
                    failures = 0
                    for rid in self._stepping:
                        await self._fail(rid, "step_failed: the prefill worker's step failed "
                                         f"{MAX_STEP_FAILURES} times")
                await asyncio.sleep(0.05)

    async def _fail(self, req_id: str, error: str) -> None:
        """End ``req_id`` here and tell its decode worker why (it tells the client)."""
        job = self._jobs.get(req_id)
        if job is None:
            return
        await self.abort(req_id)
        self._spawn_send(job.decode_worker_id, PrefilledBatch(
            (Prefilled(req_id, 0, None, time.time(), error),)))

    def _spawn_send(self, decode_worker_id: str, batch: PrefilledBatch) -> None:
        task = asyncio.get_running_loop().create_task(self._send(decode_worker_id, batch))
        self._notify_tasks.add(task)
        task.add_done_callback(self._notify_tasks.discard)

    async def _step(self) -> None:
        now = time.time()
        plan = self.sched.plan(now, self.engine.num_free_blocks)
        self._plan_was_empty = not plan.chunks
        if not plan.chunks:
            await wait_event(self._wake, 0.01)
            return
        self._stepping = [rid for rid, _ in plan.chunks]
        began = time.time()
        for rid in self._stepping:
            job = self._jobs.get(rid)
            if job is not None and not job.started:
                job.started = began
        t0 = time.perf_counter()
        outs, refused, blocks, computed, events = await self._thread.call(
            self._run, list(plan.chunks), self._protect())
        seconds: float | None = time.perf_counter() - t0
        if any(o.error is not None for o in outs):
            seconds = None  # the step ran twice (batched, then one by one): not a cost sample
        self._block_events.extend(events)
        # The blocks too: a started prompt holds all of its blocks (the engine admits it
        # with them), and a planner that is not told asks for them again before each of
        # its next chunks, which it then never gets while the prompt itself holds them.
        self.sched.commit(plan, now, seconds=seconds, refused=refused, blocks=blocks,
                          computed=computed, decodes_here=False)
        self.num_steps += 1
        firsts: dict[str, list[Prefilled]] = {}
        seqs: dict[str, list[Any]] = {}  # req_id -> its sequences' first-token outputs
        t = time.time()
        for out in outs:
            job = self._jobs.get(out.req_id)
            if job is None:
                continue
            if out.error is not None:  # it failed the step alone and left the engine
                self._jobs.pop(out.req_id, None)
                self.sched.remove(out.req_id)
                self.producer.abort(out.req_id)
                self.producer.forget(out.req_id)
                firsts.setdefault(job.decode_worker_id, []).append(
                    Prefilled(out.req_id, 0, None, t, f"step_failed: {out.error}"))
                continue
            if out.ready_block_ids:
                self.producer.push(out.req_id, list(out.ready_block_ids))
            if out.prefill_done:
                seqs.setdefault(out.req_id, []).append(out)
        for rid, done in seqs.items():
            job = self._jobs[rid]
            job.prefill_done = True
            self.sched.remove(rid)
            head = done[0]
            finish = None
            if head.finished and job.spec.sampling.n == 1:
                finish = head.finish_reason.value if head.finish_reason else "stop"
            firsts.setdefault(job.decode_worker_id, []).append(
                Prefilled(rid, int(head.new_token_ids[0]), finish, t,
                          deltas=tuple(token_delta(o) for o in done)))
            self._events.append(ReqEvent(rid, WorkerEvent.PREFILL_DONE, t,
                                         received=job.received, started=job.started))
        for dwid, items in firsts.items():
            self._spawn_send(dwid, PrefilledBatch(tuple(items)))
        if self._events:
            self._report_soon()

    def _protect(self) -> frozenset[int] | None:
        """The prefix hashes of the requests waiting here to start (as the policy names
        them), when they changed since the last step."""
        waiting = [r for r in self.sched.queue.requests() if r.num_computed_tokens == 0]
        hashes = frozenset(self.policy.protected_hashes(waiting))
        if hashes == self._protected:
            return None
        self._protected = hashes
        return hashes

    def _run(self, chunks: list[tuple[str, int]], protect: frozenset[int] | None = None
             ) -> tuple[list[Any], list[str], dict[str, int], dict[str, int], list[BlockEvent]]:
        """On the engine thread: the step, then each chunk's request as the planner tracks
        it (its blocks and its tokens with KV)."""
        if protect is not None:
            self.engine.protect_prefixes(protect)
        outs, refused = self.engine.run_plan([], chunks)
        blocks: dict[str, int] = {}
        computed: dict[str, int] = {}
        for rid, _ in chunks:
            if self.engine.request_state(rid) is not None:
                blocks[rid] = len(self.engine.block_ids(rid))
                computed[rid] = self.engine.num_computed_tokens(rid)
        return outs, refused, blocks, computed, block_events(self.engine.drain_events())

    async def _send(self, decode_worker_id: str, batch: PrefilledBatch) -> None:
        try:
            await self._notify(decode_worker_id, batch)
        except Exception:  # decode worker gone: the scheduler sees it and the router retries
            log.warning("prefill worker %s: could not reach %s", self.worker_id,
                        decode_worker_id)
            for item in batch.items:
                await self.abort(item.req_id)

    async def _tend_transfers(self) -> None:
        """Every turn of the step loop. A prompt still to prefill (queued, or paused between
        chunks: the policy may hold a lower tier back longer than the transfer's timeouts)
        keeps its transfer alive: the turn itself is the sign that this worker is not hung
        (a loop that stops, or a step that never ends, keeps nothing alive and the decode
        worker's consumer fails the transfer within its timeout). A finished prompt's blocks
        are released once its transfer ended."""
        for rid, job in list(self._jobs.items()):
            if not job.prefill_done:
                self.producer.keepalive(rid)
                continue
            st = self.producer.poll(rid)
            if st is not None and not st.state.is_terminal:
                continue
            self._jobs.pop(rid, None)
            self.producer.forget(rid)
            await self._thread.call(self.engine.release, rid)

    # -- reports -------------------------------------------------------------------------

    def _report_soon(self) -> None:
        if self._report_task is None or self._report_task.done():
            self._report_task = asyncio.get_running_loop().create_task(self._send_report())

    async def _send_report(self) -> None:
        self.producer.drain_stats()
        running = tuple(RunningReq(rid, 0, 0, self.sched.local[rid].num_prefill_left
                                   if rid in self.sched.local else 0)
                        for rid, j in self._jobs.items() if not j.prefill_done)
        events, blocks = tuple(self._events), tuple(self._block_events)
        rep = WorkerReport(self.worker_id, self.engine.num_free_blocks,
                           self.engine.num_total_blocks, events, blocks, (), running,
                           self.sched.costs.to_tuple(), self.num_steps,
                           is_busy=self.sched.has_work() and not self._plan_was_empty,
                           memory=KVMemoryReport(0, 0, 0, self.engine.num_prefix_query_blocks,
                                                 self.engine.num_prefix_hit_blocks))
        try:
            delivered = await self._report_fn(rep) is not False
        except asyncio.CancelledError:
            raise
        except Exception:  # the scheduler may be restarting: report next time
            log.exception("prefill worker %s: report failed", self.worker_id)
            delivered = False
        # The events stay until a report carried them (those that came meanwhile stay
        # either way): a PREFILL_DONE lost here would leave the prefill in the scheduler's
        # book of this worker's queued work.
        if delivered:
            del self._events[:len(events)], self._block_events[:len(blocks)]
        else:
            del self._events[:-MAX_UNREPORTED], self._block_events[:-MAX_UNREPORTED]

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.control_interval_s)
            if self._report_task is not None and not self._report_task.done():
                continue
            self._block_events.extend(block_events(
                await self._thread.call(self.engine.drain_events)))
            self._report_soon()
