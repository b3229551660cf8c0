"""The decode worker: receives prefilled KV, decodes in continuous batches, streams tokens.

Life of a request on a decode worker (STYLE.md item 7):

1. RESERVE: the global scheduler asks for the prompt's blocks; ``engine.reserve`` takes
   them all or none (prefix-cache hits reused); ``KVConsumer.expect`` turns the slots into
   a ticket the prefill worker streams into. A token stream (queue) opens for the router.
2. RECEIVE: the prefill worker's blocks land in the reserved slots; its control message
   ``prefilled`` brings the first token, which goes out on the stream at once (it does
   not depend on the transfer).
3. JOIN: transfer DONE and first token known -> ``engine.add_prefilled_request``
   (DECODE_START). Transfer FAILED/ABORTED -> blocks
   released, the stream ends with an error the router retries.
4. DECODE: the step loop runs ``engine.step()`` on the engine thread; new tokens go to
   the streams; finished requests leave (their blocks freed by the engine).
5. PREEMPT / RESUME: the global scheduler may preempt a request for a higher tier (swap to
   host memory or recompute); swapped requests come back (``swap_in``) in the order the
   scheduling policy gives, as soon as blocks are free. The engine itself recomputes the
   newest request when a decode finds no block; both are reported as events.
6. ABORT: router abort (client gone), a reader that leaves the stream before its end, or a
   dead peer: blocks freed (a reservation still receiving once its transfer has ended, so
   that no block lands in memory given to another request), stream closed.

Every lifecycle change is reported to the global scheduler as an event (msgpack report,
every control interval). :class:`DecodeWorker` is a plain class; :class:`DecodeWorkerActor`
is the thin Ray actor around it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.aio import wait_event
from cluster.config import ClusterConfig
from cluster.messages import WorkerEvent, pack, unpack
from cluster.topology import WorkerLocation
from cluster.worker_runtime import EngineThread, ReportBuffer, bytes_per_block, sampling_params
from router.backend import GenerationSpec
from scheduler.preemption import PreemptMode, VictimView
from scheduler.request import Request, RequestState
from scheduler.topology import WorkerRole

log = logging.getLogger(__name__)

ReportFn = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(slots=True)
class _Req:
    spec: GenerationSpec
    stream: asyncio.Queue[dict[str, Any]]
    block_ids: list[int] = field(default_factory=list)
    first_token: int | None = None
    early_finish: str | None = None  # the prefill's first token was also its last
    is_joined: bool = False  # in the engine as a running request
    is_swapped: bool = False
    is_recomputing: bool = False
    num_blocks: int = 0
    num_output_tokens: int = 0
    last_preempt_time: float | None = None

    def kernel_view(self, state: RequestState) -> Request:
        return Request(self.spec.req_id, self.spec.tier, self.spec.arrival_time,
                       len(self.spec.prompt_token_ids), self.spec.sampling.max_tokens,
                       state=state, num_output_tokens=self.num_output_tokens,
                       last_preempt_time=self.last_preempt_time)


class DecodeWorker:
    def __init__(self, worker_id: str, cfg: ClusterConfig, engine: Any, consumer: Any,
                 location: WorkerLocation, report: ReportFn, policy: Any) -> None:
        self.worker_id = worker_id
        self.cfg = cfg
        self.engine = engine
        self.consumer = consumer
        self.location = location
        self.policy = policy
        self._report = report
        self._thread = EngineThread(f"decode-{worker_id}")
        self._buffer = ReportBuffer(worker_id, "decode", location)
        self._reqs: dict[str, _Req] = {}
        # Token queues by request id; retired ones (request gone) wait for their reader.
        self._streams: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self._retired: dict[str, float] = {}
        # Reservations whose transfer is ending: their slots are freed once it has ended.
        self._draining: set[str] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._step_s = 0.05
        self._num_free = engine.num_free_blocks
        self._info = location.to_worker_info(worker_id, WorkerRole.DECODE,
                                             engine.num_total_blocks)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._step_loop()), loop.create_task(self._report_loop())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._thread.shutdown()

    # -- control calls -------------------------------------------------------------------

    async def reserve(self, msg: dict[str, Any]) -> dict[str, Any]:
        spec = GenerationSpec.from_dict(msg["spec"])
        rid = spec.req_id
        prompt = list(spec.prompt_token_ids)
        blocks = await self._thread.call(self.engine.reserve, rid, len(prompt),
                                         prompt_token_ids=prompt)
        if blocks is None:
            return {"ok": False, "num_free_blocks": self.engine.num_free_blocks}
        num_cached = await self._thread.call(self.engine.num_reserved_cached_blocks, rid)
        ticket = self.consumer.expect(rid, blocks, present=tuple(range(num_cached)))
        self._reqs[rid] = _Req(spec, asyncio.Queue(), list(blocks), num_blocks=len(blocks))
        self._streams[rid] = self._reqs[rid].stream
        self._num_free = self.engine.num_free_blocks
        self._wake.set()
        return {"ok": True, "ticket": ticket, "num_cached_blocks": num_cached,
                "num_free_blocks": self._num_free}

    async def prefilled(self, msg: dict[str, Any]) -> None:
        r = self._reqs.get(str(msg["req_id"]))
        if r is None:
            return
        r.first_token = int(msg["first_token"])
        r.early_finish = msg.get("finish")
        if r.early_finish is None:
            # The first token does not depend on the transfer: send it now (TTFT).
            r.stream.put_nowait({"t": [r.first_token], "f": None, "e": None})
        self._wake.set()

    async def stream(self, req_id: str) -> AsyncIterator[dict[str, Any]]:
        """Token deltas ``{"t": [ids], "f": finish | None, "e": error | None}`` until the end.

        The queue outlives the request: a request may finish before the router opens its
        stream, and its tokens wait here until read (or until the retention time ends).
        """
        q = self._streams.get(req_id)
        if q is None:
            yield {"t": [], "f": None, "e": "unknown_request"}
            return
        ended = False
        try:
            while True:
                item = await q.get()
                yield item
                if item["f"] is not None or item["e"] is not None:
                    ended = True
                    return
        finally:
            self._streams.pop(req_id, None)
            self._retired.pop(req_id, None)
            if not ended and req_id in self._reqs:
                self._reader_gone(req_id)

    def _reader_gone(self, req_id: str) -> None:
        """The reader left mid-request (its client hung up). The router's abort may never
        come (Ray Serve cancels it with the request), so free the blocks here and tell the
        global scheduler, which ends the request everywhere else."""
        log.info("reader of %s left before the end: aborting it", req_id)
        self._buffer.add(req_id, WorkerEvent.ABORTED, reason="reader_gone")
        asyncio.get_running_loop().create_task(self.abort(req_id))

    async def abort(self, req_id: str, error: str | None = None) -> None:
        """Drop the request; ``error`` set: the stream ends with it (the router retries),
        unset: the router asked (its client left), nobody reads the stream any more."""
        r = self._reqs.get(req_id)
        if r is not None:
            self._retire(req_id)
            if r.is_joined:
                await self._thread.call(self.engine.abort, req_id)
            else:
                await self._end_transfer(req_id)
        q = self._streams.get(req_id)
        if q is not None:
            # A reader still waiting (if any) ends on this item.
            q.put_nowait({"t": [], "f": None, "e": error or "aborted"})
            if error is None:
                self._streams.pop(req_id, None)
                self._retired.pop(req_id, None)

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

    def _retire(self, req_id: str) -> None:
        """The request left the engine; its stream stays until read or expired."""
        if self._reqs.pop(req_id, None) is not None and req_id in self._streams:
            self._retired[req_id] = time.monotonic()

    def _expire_streams(self) -> None:
        limit = time.monotonic() - self.cfg.router.request_timeout_s
        for rid in [rid for rid, t in self._retired.items() if t < limit]:
            self._retired.pop(rid, None)
            self._streams.pop(rid, None)

    async def preempt(self, req_id: str, mode: str, for_req_id: str | None) -> bool:
        """Swap out or recompute ``req_id``; ``for_req_id``: the request it makes room for
        (None: this worker's own KV pressure)."""
        r = self._reqs.get(req_id)
        if r is None or not r.is_joined or r.is_swapped or r.is_recomputing:
            return False
        if mode == "swap":
            ok = await self._thread.call(self.engine.swap_out, req_id)
            if ok:
                r.is_swapped, r.last_preempt_time = True, time.time()
                self._buffer.add(req_id, WorkerEvent.PREEMPTED_SWAP, for_req_id=for_req_id)
        else:
            ok = await self._thread.call(self.engine.preempt_recompute, req_id)
            if ok:
                r.is_recomputing, r.last_preempt_time = True, time.time()
                self._buffer.add(req_id, WorkerEvent.PREEMPTED_RECOMPUTE, for_req_id=for_req_id)
        self._num_free = self.engine.num_free_blocks
        self._wake.set()
        return bool(ok)

    def status(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "num_free_blocks": self.engine.num_free_blocks,
                "num_total_blocks": self.engine.num_total_blocks, "num_requests": len(self._reqs)}

    # -- loops ---------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            busy = any(r.is_joined for r in self._reqs.values())
            waiting = self._draining or any(not r.is_joined for r in self._reqs.values())
            if not busy:
                await wait_event(self._wake, 0.01 if waiting else 0.5)
            self._wake.clear()
            try:
                await self._free_drained()
                await self._join_transfers()
                await self._swap_in()
                await self._relieve_pressure()
                if busy or self.engine.has_unfinished():
                    await self._step()
            except asyncio.CancelledError:
                raise
            except Exception:  # keep serving the other requests
                log.exception("decode worker %s: step failed", self.worker_id)
                await asyncio.sleep(0.05)

    async def _join_transfers(self) -> None:
        for rid, r in list(self._reqs.items()):
            if r.is_joined:
                continue
            st = self.consumer.poll(rid)
            state = None if st is None else st.state.value
            if r.first_token is not None and r.early_finish is not None:
                # The first token was the last: no decode, the reserved slots go back.
                self._retire(rid)
                await self._end_transfer(rid)
                r.stream.put_nowait({"t": [r.first_token], "f": r.early_finish, "e": None})
                continue
            if state in ("failed", "aborted"):
                detail = "" if st is None else st.detail
                log.warning("transfer of %s %s: %s", rid, state, detail)
                await self.abort(rid, error="transfer_failed")
                self._buffer.add(rid, WorkerEvent.TRANSFER_FAILED)
                continue
            if r.first_token is None:
                continue
            if state != "done":
                continue
            self.consumer.forget(rid)
            prompt = list(r.spec.prompt_token_ids)
            await self._thread.call(self.engine.add_prefilled_request, rid, prompt,
                                    r.first_token, sampling_params(r.spec), r.block_ids)
            r.is_joined = True
            r.num_output_tokens = 1
            r.num_blocks = len(r.block_ids)
            self._buffer.add(rid, WorkerEvent.DECODE_START)

    async def _swap_in(self) -> None:
        swapped = [(rid, r) for rid, r in self._reqs.items() if r.is_swapped]
        if not swapped:
            return
        now = time.time()
        views = {rid: r.kernel_view(RequestState.PREEMPTED) for rid, r in swapped}
        for req in self.policy.order(list(views.values()), now):
            if not await self._thread.call(self.engine.swap_in, req.req_id):
                break
            self._reqs[req.req_id].is_swapped = False
            self._buffer.add(req.req_id, WorkerEvent.RESUMED_SWAP)

    async def _relieve_pressure(self) -> None:
        """Free blocks for this step's decode growth by tier (the policy), not by age.

        A running request whose context fills its last block needs one more block
        this step; when the pool cannot give them all, the policy picks victims
        (lowest value first, swap or recompute by restore cost) before the engine
        would recompute its newest request whatever its tier.
        """
        bs = self.cfg.pools.block_size
        running = [r for r in self._reqs.values()
                   if r.is_joined and not r.is_swapped and not r.is_recomputing]
        growing = [r for r in running
                   if -(-(len(r.spec.prompt_token_ids) + r.num_output_tokens) // bs)
                   > r.num_blocks]
        need = len(growing) - self._num_free
        if need <= 0 or len(running) <= 1:
            return
        views = [VictimView(r.kernel_view(RequestState.DECODING), self._info, r.num_blocks)
                 for r in running]
        top = min(r.spec.tier for r in growing)
        plan = self.policy.on_kv_pressure(need, views, time.time(), top)
        for v in plan.victims:
            mode = "swap" if v.mode is PreemptMode.SWAP else "recompute"
            await self.preempt(v.req_id, mode, for_req_id=None)

    async def _step(self) -> None:
        t0 = time.perf_counter()
        watched = [rid for rid, r in self._reqs.items()
                   if r.is_joined and not r.is_swapped and not r.is_recomputing]
        outs, states, sizes, block_events = await self._thread.call(self._step_and_scan, watched)
        self._step_s = 0.8 * self._step_s + 0.2 * (time.perf_counter() - t0)
        self._buffer.add_block_events(block_events)
        self._num_free = self.engine.num_free_blocks
        for rid, n in sizes.items():
            r = self._reqs.get(rid)
            if r is not None:
                r.num_blocks = n
        for rid, state in states.items():
            r = self._reqs.get(rid)
            if r is not None and state == "waiting" and not r.is_recomputing:
                # The engine recomputes the newest request when a decode finds no block.
                r.is_recomputing = True
                self._buffer.add(rid, WorkerEvent.PREEMPTED_RECOMPUTE, for_req_id=None)
        for out in outs:
            r = self._reqs.get(out.req_id)
            if r is None:
                continue
            if out.new_token_ids and r.is_recomputing:
                r.is_recomputing = False
                self._buffer.add(out.req_id, WorkerEvent.RESUMED_RECOMPUTE)
            finish = out.finish_reason.value if out.finished and out.finish_reason else None
            if out.finished and finish is None:
                finish = "stop"
            r.num_output_tokens += len(out.new_token_ids)
            if out.new_token_ids or finish:
                r.stream.put_nowait({"t": list(out.new_token_ids), "f": finish, "e": None})
            if out.finished:
                self._retire(out.req_id)
                kind = (WorkerEvent.FINISHED_LENGTH if finish == "length"
                        else WorkerEvent.FINISHED_STOP)
                self._buffer.add(out.req_id, kind)

    def _step_and_scan(
        self, watched: list[str]
    ) -> tuple[list[Any], dict[str, str], dict[str, int], list[Any]]:
        """On the engine thread: one step, then the watched requests' states and sizes."""
        outs = self.engine.step()
        states: dict[str, str] = {}
        sizes: dict[str, int] = {}
        for rid in watched:
            state = self.engine.request_state(rid)
            if state is None:
                continue
            states[rid] = state.value
            sizes[rid] = len(self.engine.block_ids(rid))
        return outs, states, sizes, self.engine.drain_events()

    async def _report_loop(self) -> None:
        interval = self.cfg.scheduling.control_interval_s
        while True:
            await asyncio.sleep(interval)
            try:
                self._expire_streams()
                events = await self._thread.call(self.engine.drain_events)
                self._buffer.add_block_events(events)
                for s in self.consumer.drain_stats():
                    if s.state.value == "done":
                        self._buffer.transfers.append({
                            "req_id": s.req_id, "num_bytes": s.num_bytes,
                            "duration_s": s.duration_s, "end_time": s.end_time,
                            "topology": s.topology.value})
                running = [[rid, r.num_blocks] for rid, r in self._reqs.items()
                           if r.is_joined and not r.is_swapped and not r.is_recomputing]
                rep = self._buffer.take(
                    num_free_blocks=self.engine.num_free_blocks,
                    num_total_blocks=self.engine.num_total_blocks,
                    backlog_tokens=0, running=running, decode_step_s=self._step_s)
                await self._report(rep)
            except asyncio.CancelledError:
                raise
            except Exception:  # the scheduler may be restarting: report next time
                log.exception("decode worker %s: report failed", self.worker_id)


def _make_actor_class() -> Any:
    import ray

    @ray.remote
    class DecodeWorkerActor:
        """Thin Ray wrapper: msgpack bytes in and out, streaming tokens as a generator."""

        def __init__(self, worker_id: str, index: int, cfg: dict[str, Any],
                     scheduler_name: str, namespace: str) -> None:
            self._worker_id = worker_id
            self._index = index
            self._cfg = ClusterConfig.from_dict(cfg)
            self._scheduler_name = scheduler_name
            self._namespace = namespace
            self._worker: DecodeWorker | None = None

        async def setup(self) -> bytes:
            from cluster.worker_setup import make_decode_worker

            self._worker = await make_decode_worker(
                self._worker_id, self._index, self._cfg, self._scheduler_name, self._namespace)
            return pack(self._worker_info())

        def _worker_info(self) -> dict[str, Any]:
            w = self._worker
            assert w is not None
            return {"worker_id": self._worker_id, "role": "decode",
                    "location": w.location.to_dict(),
                    "num_total_blocks": w.engine.num_total_blocks,
                    "num_free_blocks": w.engine.num_free_blocks,
                    "bytes_per_block": bytes_per_block(w.engine),
                    "max_model_len": int(w.engine.max_model_len),
                    "ray_node_id": ray.get_runtime_context().get_node_id()}

        async def reserve(self, msg: bytes) -> bytes:
            assert self._worker is not None
            return pack(await self._worker.reserve(unpack(msg)))

        async def prefilled(self, msg: bytes) -> None:
            assert self._worker is not None
            await self._worker.prefilled(unpack(msg))

        async def stream(self, req_id: str) -> AsyncIterator[bytes]:
            assert self._worker is not None
            inner = self._worker.stream(req_id)
            try:
                async for item in inner:
                    yield pack(item)
            finally:
                await inner.aclose()  # now, not at GC: a reader gone aborts the request

        async def abort(self, req_id: str, error: str | None = None) -> None:
            assert self._worker is not None
            await self._worker.abort(req_id, error)

        async def preempt(self, req_id: str, mode: str, for_req_id: str | None) -> bool:
            assert self._worker is not None
            return await self._worker.preempt(req_id, mode, for_req_id)

        async def status(self) -> bytes:
            assert self._worker is not None
            return pack(self._worker.status())

        async def ping(self) -> bool:
            return True

    return DecodeWorkerActor


_ACTOR: Any = None


def decode_worker_actor() -> Any:
    """The Ray actor class (built on first use, so importing this module needs no Ray)."""
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _make_actor_class()
    return _ACTOR
