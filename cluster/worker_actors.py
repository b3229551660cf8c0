"""The Ray actors around the plain worker classes: typed messages as msgpack bytes.

``DecodeWorkerActor`` wraps :class:`decode_pool.worker.DecodeWorker` (dispatch, first
tokens from prefill workers, the routers' token subscriptions, aborts, preemptions, and
requests migrating in from another decode worker);
``PrefillWorkerActor`` wraps :class:`prefill_pool.worker.PrefillWorker`. The classes are
built on first use, so importing this module needs no Ray. Both live here, on the top
floor, because building a worker needs the cluster's configuration and topology; the
pools below know nothing of either.

Each actor sets itself up from its constructor (model, KV endpoint, links) and then
registers with the global scheduler, on its first start and on every restart Ray makes
after its process died (the actors run with ``max_restarts=-1``, ``cluster/supervisor.py``
says why). ``setup()`` only waits for that and returns the setup document. Every start of
the process has a new ``incarnation``, which ``ping`` answers, so the scheduler tells a
restarted worker from the one it knew. Calls that arrive before the setup is done are
refused at once (a dispatch, a start of a prefill) or ignored (first tokens, aborts for
requests this process never had), never queued behind the model load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from cluster.config import ClusterConfig
from cluster.messages import pack, setup_document
from engine.service import bytes_per_block
from scheduler.messages import (
    AbortBatch,
    Dispatch,
    DispatchAnswer,
    MigrateAnswer,
    MigrateIn,
    PreemptCall,
    PrefilledBatch,
    StartPrefill,
    WorkerHello,
    WorkerSetup,
    decode,
    encode,
)

log = logging.getLogger(__name__)


class WorkerStarting(RuntimeError):
    """Called before the worker finished setting up (its process just restarted)."""


def _setup(worker: Any) -> WorkerSetup:
    import ray

    loc = worker.location
    return WorkerSetup(node=loc.node, device=loc.device, nvlink_domain=loc.nvlink_domain,
                       num_total_blocks=worker.engine.num_total_blocks,
                       num_free_blocks=worker.engine.num_free_blocks,
                       bytes_per_block=bytes_per_block(worker.engine),
                       max_model_len=int(worker.engine.max_model_len),
                       ray_node_id=str(ray.get_runtime_context().get_node_id()),
                       pid=os.getpid())


class _WorkerActorBase:
    """Self-setup, registration and the calls both roles answer."""

    role = ""

    def __init__(self, worker_id: str, index: int, cfg: dict[str, Any], scheduler_name: str,
                 namespace: str) -> None:
        import ray

        from cluster.scheduler_link import SchedulerLink

        logging.basicConfig(level=logging.INFO)
        self.worker_id = worker_id
        self.index = index
        self.cfg = ClusterConfig.from_dict(cfg)
        self.namespace = namespace
        self.incarnation = uuid.uuid4().hex[:12]
        self.link = SchedulerLink(scheduler_name, namespace, worker_id, self.incarnation,
                                  ray.get_runtime_context().current_actor)
        self._w: Any = None
        # Ray runs an async actor's constructor on its event loop.
        self._setup_task = asyncio.get_running_loop().create_task(self._setup())
        # Retrieved here too: after a restart nobody may await it (the failure is logged).
        self._setup_task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _build(self) -> Any:
        """The worker of this actor's role (cluster.worker_setup builds both)."""
        from cluster import worker_setup

        make = {"decode": worker_setup.make_decode_worker,
                "prefill": worker_setup.make_prefill_worker}[self.role]
        return await make(self.worker_id, self.index, self.cfg, self.link, self.namespace)

    async def _setup(self) -> bytes:
        try:
            self._w = await self._build()
        except Exception:
            log.exception("%s: setup failed", self.worker_id)
            raise
        self.link.bind(self._hello, self._drop)
        await self.link.register()
        return pack(setup_document(self.worker_id, self.role, _setup(self._w)))

    def _hello(self) -> WorkerHello:
        return WorkerHello(self.worker_id, self.role, self.incarnation,
                           _setup(self._w), self._w.held_requests())

    async def _drop(self, req_ids: tuple[str, ...]) -> None:
        for rid in req_ids:
            await self._w.abort(rid, "worker_failed")

    def _ready(self) -> Any:
        if self._w is None or not self.link.is_registered:
            raise WorkerStarting(f"{self.worker_id} is starting")
        return self._w

    async def setup(self) -> bytes:
        """The setup document, once this process has set up and registered."""
        return await asyncio.shield(self._setup_task)

    async def ping(self) -> str:
        return self.incarnation

    async def status(self) -> bytes:
        if self._w is None:
            return pack({"worker_id": self.worker_id, "ready": False, "pid": os.getpid(),
                         "incarnation": self.incarnation})
        return pack({**self._w.status(), "ready": self.link.is_registered, "pid": os.getpid(),
                     "incarnation": self.incarnation})

    async def abort(self, req_id: str, error: str | None = None) -> None:
        if self._w is not None:
            await self._w.abort(req_id, error)


def _make_decode_actor() -> Any:
    import ray

    @ray.remote
    class DecodeWorkerActor(_WorkerActorBase):
        role = "decode"

        async def dispatch(self, msg: bytes) -> bytes:
            d = decode(msg, Dispatch)
            try:
                w = self._ready()
            except WorkerStarting:
                return encode(DispatchAnswer(d.spec.req_id, False, 0, reason="starting"))
            return encode(await w.dispatch(d))

        async def prefilled(self, msg: bytes) -> None:
            if self._w is not None:  # first tokens for a process that died are lost with it
                await self._w.prefilled(decode(msg, PrefilledBatch))

        async def subscribe(self, router_id: str) -> AsyncIterator[bytes]:
            await asyncio.shield(self._setup_task)
            inner = self._w.subscribe(router_id)
            try:
                async for item in inner:
                    yield item
            finally:
                await inner.aclose()  # now, not at GC: the router's stream is gone

        async def abort_many(self, msg: bytes) -> None:
            for rid in decode(msg, AbortBatch).req_ids:
                await self.abort(rid)

        async def preempt(self, msg: bytes) -> bool:
            m = decode(msg, PreemptCall)
            if self._w is None:
                return False
            return await self._w.preempt(m.req_id, m.mode, m.for_req_id, m.target_worker_id)

        async def migrate_in(self, msg: bytes) -> bytes:
            m = decode(msg, MigrateIn)
            try:
                w = self._ready()
            except WorkerStarting:
                return encode(MigrateAnswer(m.spec.req_id, None, "starting"))
            return encode(await w.migrate_in(m))

        async def release_waiting(self, prefill_worker_id: str,
                                  req_ids: list[str] | None) -> list[str]:
            if self._w is None:
                return []
            return await self._w.release_waiting(
                prefill_worker_id, None if req_ids is None else tuple(req_ids))

    return DecodeWorkerActor


def _make_prefill_actor() -> Any:
    import ray

    @ray.remote
    class PrefillWorkerActor(_WorkerActorBase):
        role = "prefill"

        async def start_request(self, msg: bytes) -> str | None:
            # Not set up: raises, which the decode worker reads as "unreachable" (that
            # attempt ends with worker_failed and its router retries it), not as a refusal
            # of the request itself.
            return await self._ready().start_request(decode(msg, StartPrefill))

    return PrefillWorkerActor


_ACTORS: dict[str, Any] = {}


def decode_worker_actor() -> Any:
    if "decode" not in _ACTORS:
        _ACTORS["decode"] = _make_decode_actor()
    return _ACTORS["decode"]


def prefill_worker_actor() -> Any:
    if "prefill" not in _ACTORS:
        _ACTORS["prefill"] = _make_prefill_actor()
    return _ACTORS["prefill"]
