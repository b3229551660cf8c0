"""The prefill worker: chunked prefill into paged KV, streaming blocks to the decode worker.

Life of a request on a prefill worker (STYLE.md item 7):

1. START: the global scheduler hands over the request with the decode worker's ticket
   (its blocks are already reserved there); ``KVProducer.begin`` opens the transfer
   (the pair's process group is built on first use). The request waits in the local queue.
2. ADMIT: each loop the scheduling policy orders the local queue and the head enters the
   engine as a ``prefill_only`` request (prefix-cache hits skip shared blocks).
3. PREFILL: ``engine.step()`` on the engine thread computes chunks; the blocks each chunk
   finishes (``ready_block_ids``) are pushed to the producer at once, so the send of chunk
   k overlaps the compute of chunk k+1.
4. FIRST TOKEN: the step that ends the prompt samples the first token; it goes to the
   decode worker as a control message (``prefilled``), reported as PREFILL_DONE. A first
   token that is also the last ends the request (the decode worker frees its slots).
5. RELEASE: once the transfer is terminal (DONE, FAILED or ABORTED) the request's blocks
   are released; full blocks stay in the prefix cache for later prompts.
6. ABORT: router abort or a failed transfer drops the request in any stage.

:class:`PrefillWorker` is a plain class; :class:`PrefillWorkerActor` the thin Ray actor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cluster.aio import wait_event
from cluster.config import ClusterConfig
from cluster.messages import WorkerEvent, pack, unpack
from cluster.topology import WorkerLocation
from cluster.worker_runtime import EngineThread, ReportBuffer, bytes_per_block, sampling_params
from router.backend import GenerationSpec
from scheduler.request import Request

log = logging.getLogger(__name__)

ReportFn = Callable[[dict[str, Any]], Awaitable[None]]
NotifyFn = Callable[[str, dict[str, Any]], Awaitable[None]]
# Requests handed to the engine ahead of time (the engine admits them FCFS).
ENGINE_QUEUE_DEPTH = 4


@dataclass(slots=True)
class _Job:
    spec: GenerationSpec
    decode_worker_id: str
    in_engine: bool = False
    prefill_done: bool = False


class PrefillWorker:
    def __init__(self, worker_id: str, cfg: ClusterConfig, engine: Any, producer: Any,
                 location: WorkerLocation, report: ReportFn, notify_decode: NotifyFn,
                 policy: Any) -> None:
        self.worker_id = worker_id
        self.cfg = cfg
        self.engine = engine
        self.producer = producer
        self.location = location
        self.policy = policy
        self._report = report
        self._notify = notify_decode
        self._thread = EngineThread(f"prefill-{worker_id}")
        self._buffer = ReportBuffer(worker_id, "prefill", location)
        self._jobs: dict[str, _Job] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._tokens_per_s: float | None = None
        self._notify_tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._step_loop()), loop.create_task(self._report_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._thread.shutdown()

    # -- control calls -------------------------------------------------------------------

    async def start_request(self, msg: dict[str, Any]) -> None:
        spec = GenerationSpec.from_dict(msg["spec"])
        self.producer.begin(msg["ticket"])
        self._jobs[spec.req_id] = _Job(spec, str(msg["decode_worker_id"]))
        self._wake.set()

    async def abort(self, req_id: str) -> None:
        job = self._jobs.pop(req_id, None)
        if job is None:
            return
        self.producer.abort(req_id)
        self.producer.forget(req_id)
        if job.in_engine:
            await self._thread.call(self.engine.abort, req_id)

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "num_free_blocks": self.engine.num_free_blocks,
                "num_total_blocks": self.engine.num_total_blocks, "num_requests": len(self._jobs)}

    # -- loops ---------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            active = any(j.in_engine and not j.prefill_done for j in self._jobs.values())
            pending = any(not j.in_engine for j in self._jobs.values())
            sending = any(j.prefill_done for j in self._jobs.values())
            if not active and not pending:
                await wait_event(self._wake, 0.005 if sending else 0.5)
            self._wake.clear()
            try:
                await self._admit()
                if self.engine.has_unfinished():
                    await self._step()
                await self._release_sent()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving the other requests
                log.exception("prefill worker %s: step failed", self.worker_id)
                await asyncio.sleep(0.05)

    async def _admit(self) -> None:
        waiting = [j for j in self._jobs.values() if not j.in_engine]
        if not waiting:
            return
        queued = sum(1 for j in self._jobs.values() if j.in_engine and not j.prefill_done)
        room = ENGINE_QUEUE_DEPTH - queued
        if room <= 0:
            return
        views = [Request(j.spec.req_id, j.spec.tier, j.spec.arrival_time,
                         len(j.spec.prompt_token_ids), j.spec.sampling.max_tokens)
                 for j in waiting]
        for req in self.policy.order(views, time.time())[:room]:
            job = self._jobs[req.req_id]
            try:
                await self._thread.call(self.engine.add_request, req.req_id,
                                        list(job.spec.prompt_token_ids),
                                        sampling_params(job.spec), prefill_only=True)
            except ValueError as e:  # PromptTooLong or bad params: the request cannot run
                log.warning("prefill of %s refused: %s", req.req_id, e)
                self._jobs.pop(req.req_id, None)
                self.producer.abort(req.req_id)
                self.producer.forget(req.req_id)
                self._buffer.add(req.req_id, WorkerEvent.ABORTED)
                continue
            job.in_engine = True

    async def _step(self) -> None:
        t0 = time.perf_counter()
        outs, events = await self._thread.call(self._step_once)
        dt = time.perf_counter() - t0
        self._buffer.add_block_events(events)
        num_tokens = 0
        for out in outs:
            job = self._jobs.get(out.req_id)
            if job is None:
                continue
            if out.ready_block_ids:
                self.producer.push(out.req_id, list(out.ready_block_ids))
            num_tokens = max(num_tokens, out.num_computed_tokens)
            if not out.prefill_done:
                continue
            job.prefill_done = True
            first = int(out.new_token_ids[0])
            finish = None
            if out.finished:
                # The first token is also the last: the decode worker drops the reservation
                # when it hears so; the transfer (all blocks already pushed) just completes.
                finish = out.finish_reason.value if out.finish_reason else "stop"
            self._buffer.add(out.req_id, WorkerEvent.PREFILL_DONE)
            msg = {"req_id": out.req_id, "first_token": first, "finish": finish}
            task = asyncio.get_running_loop().create_task(self._send(job.decode_worker_id, msg))
            self._notify_tasks.add(task)
            task.add_done_callback(self._notify_tasks.discard)
        if num_tokens and dt > 0:
            self._tokens_per_s = num_tokens / dt

    def _step_once(self) -> tuple[list[Any], list[Any]]:
        return self.engine.step(), self.engine.drain_events()

    async def _send(self, decode_worker_id: str, msg: dict[str, Any]) -> None:
        try:
            await self._notify(decode_worker_id, msg)
        except Exception:  # decode worker gone: the scheduler sees it and the router retries
            log.warning("prefill worker %s: could not reach %s", self.worker_id, decode_worker_id)
            await self.abort(str(msg["req_id"]))

    async def _release_sent(self) -> None:
        for rid, job in list(self._jobs.items()):
            if not job.prefill_done:
                continue
            st = self.producer.poll(rid)
            if st is not None and not st.state.is_terminal:
                continue
            self._jobs.pop(rid, None)
            self.producer.forget(rid)
            await self._thread.call(self.engine.release, rid)

    async def _report_loop(self) -> None:
        interval = self.cfg.scheduling.control_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                events = await self._thread.call(self.engine.drain_events)
                self._buffer.add_block_events(events)
                self.producer.drain_stats()
                backlog = sum(len(j.spec.prompt_token_ids) for j in self._jobs.values()
                              if not j.prefill_done)
                rep = self._buffer.take(
                    num_free_blocks=self.engine.num_free_blocks,
                    num_total_blocks=self.engine.num_total_blocks,
                    backlog_tokens=backlog, prefill_tokens_per_s=self._tokens_per_s)
                await self._report(rep)
            except asyncio.CancelledError:
                raise
            except Exception:  # the scheduler may be restarting: report next time
                log.exception("prefill worker %s: report failed", self.worker_id)


def _make_actor_class() -> Any:
    import ray

    @ray.remote
    class PrefillWorkerActor:
        """Thin Ray wrapper: msgpack bytes in and out."""

        def __init__(self, worker_id: str, index: int, cfg: dict[str, Any],
                     scheduler_name: str, namespace: str) -> None:
            self._worker_id = worker_id
            self._index = index
            self._cfg = ClusterConfig.from_dict(cfg)
            self._scheduler_name = scheduler_name
            self._namespace = namespace
            self._worker: PrefillWorker | None = None

        async def setup(self) -> bytes:
            from cluster.worker_setup import make_prefill_worker

            self._worker = await make_prefill_worker(
                self._worker_id, self._index, self._cfg, self._scheduler_name, self._namespace)
            w = self._worker
            return pack({"worker_id": self._worker_id, "role": "prefill",
                         "location": w.location.to_dict(),
                         "num_total_blocks": w.engine.num_total_blocks,
                         "num_free_blocks": w.engine.num_free_blocks,
                         "bytes_per_block": bytes_per_block(w.engine),
                    "max_model_len": int(w.engine.max_model_len),
                    "ray_node_id": ray.get_runtime_context().get_node_id()})

        async def start_request(self, msg: bytes) -> None:
            assert self._worker is not None
            await self._worker.start_request(unpack(msg))

        async def abort(self, req_id: str) -> None:
            assert self._worker is not None
            await self._worker.abort(req_id)

        async def status(self) -> bytes:
            assert self._worker is not None
            return pack(self._worker.status())

        async def ping(self) -> bool:
            return True

    return PrefillWorkerActor


_ACTOR: Any = None


def prefill_worker_actor() -> Any:
    """The Ray actor class (built on first use, so importing this module needs no Ray)."""
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _make_actor_class()
    return _ACTOR
