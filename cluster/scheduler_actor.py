"""The global scheduler as one named Ray actor, and its Ray-backed worker client.

:class:`RayWorkerClient` reaches workers through their actor handles, every call
awaited with a timeout; an unreachable worker raises ``WorkerGone``. The actor adds
registration and a health loop: each worker is pinged every second, and one that does not
answer is removed from the kernel's view (its requests end with a retryable error on
their routers' notice streams). Messages in and out are typed ``scheduler.messages``
messages as msgpack bytes. With ``tracing.enabled`` the scheduler gets a
:class:`~cluster.tracing.RequestTracer` (:func:`make_tracer`) and emits one trace per
request as it closes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cluster.config import ClusterConfig
from cluster.global_scheduler import GlobalScheduler, WorkerGone
from cluster.messages import pack, unpack
from cluster.worker_setup import cost_prior, link_costs
from scheduler.cluster_scheduler import PoolMode
from scheduler.messages import (
    AbortBatch,
    Dispatch,
    DispatchAnswer,
    FinishBatch,
    SubmitBatch,
    WorkerReport,
    decode,
    encode,
)
from scheduler.topology import WorkerInfo, WorkerRole

if TYPE_CHECKING:
    from cluster.tracing import RequestTracer

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
PING_TIMEOUT_S = 3.0


class RayWorkerClient:
    def __init__(self, handles: dict[str, Any], timeout_s: float) -> None:
        self.handles = handles
        self.timeout_s = timeout_s

    async def _call(self, worker_id: str, method: str, *args: Any,
                    timeout: float | None = None) -> Any:
        import ray

        handle = self.handles.get(worker_id)
        if handle is None:
            raise WorkerGone(worker_id)
        try:
            return await asyncio.wait_for(getattr(handle, method).remote(*args),
                                          timeout or self.timeout_s)
        except (asyncio.TimeoutError, ray.exceptions.RayActorError,
                ray.exceptions.ActorUnavailableError) as e:
            raise WorkerGone(f"{worker_id}: {type(e).__name__}") from None

    async def dispatch(self, worker_id: str, msg: Dispatch) -> DispatchAnswer:
        return decode(await self._call(worker_id, "dispatch", encode(msg)), DispatchAnswer)

    async def preempt(self, worker_id: str, req_id: str, mode: str,
                      for_req_id: str | None) -> bool:
        return bool(await self._call(worker_id, "preempt", req_id, mode, for_req_id))

    async def abort(self, worker_id: str, req_id: str) -> None:
        await self._call(worker_id, "abort", req_id)

    async def ping(self, worker_id: str) -> None:
        await self._call(worker_id, "ping", timeout=PING_TIMEOUT_S)


def make_tracer(cfg: ClusterConfig) -> RequestTracer | None:
    """The request tracer ``cfg.tracing`` asks for (None when disabled); a setting that
    cannot work raises ``TracingError`` at start, not at the first request."""
    t = cfg.tracing
    if not t.enabled:
        return None
    from cluster.tracing import RequestTracer

    return RequestTracer.from_settings(t.otlp_endpoint, None if t.otlp_endpoint else t.trace_file,
                                       protocol=t.otlp_protocol, service_name=t.service_name)


class SchedulerService:
    """The actor's body: the plain scheduler plus registration and the health loop."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.client = RayWorkerClient({}, cfg.router.rpc_timeout_s)
        self.core: GlobalScheduler | None = None
        # The infos the workers registered with: a restarted Serve app reuses them.
        self.infos: list[dict[str, Any]] = []
        self._health: asyncio.Task[None] | None = None

    async def register(self, infos: list[dict[str, Any]], handles: dict[str, Any]) -> None:
        self.client.handles.update(handles)
        self.infos = list(infos)
        bpb = max((int(i.get("bytes_per_block", 0)) for i in infos), default=0) or 1 << 16
        device = next((str(i["location"]["device"]) for i in infos), "cpu")
        p = self.cfg.pools
        self.core = GlobalScheduler(self.cfg.tier_config, self.cfg.scheduling.policy,
                                    p.block_size, self.client, link_costs(bpb),
                                    mode=PoolMode(self.cfg.pool_mode),
                                    control_interval_s=self.cfg.scheduling.control_interval_s,
                                    cost_prior=cost_prior(device),
                                    chunk_tokens=p.prefill_chunk_size,
                                    local_prefill_max_tokens=p.auto_local_prefill_max_tokens,
                                    tracer=make_tracer(self.cfg))
        mode = self.core.core.mode
        for i in infos:
            loc = i["location"]
            role = WorkerRole(i["role"])
            info = WorkerInfo(str(i["worker_id"]), role, str(loc["node"]), str(loc["device"]),
                              str(loc["nvlink_domain"]), int(i["num_total_blocks"]))
            decodes = role is WorkerRole.DECODE
            self.core.register_worker(info, int(i["num_free_blocks"]),
                                      can_prefill=not decodes or mode is not PoolMode.DISAGGREGATED,
                                      can_decode=decodes)
        self._health = asyncio.get_running_loop().create_task(self._health_loop())

    def ready(self) -> bool:
        return self.core is not None

    def _core(self) -> GlobalScheduler:
        if self.core is None:
            raise SchedulerNotReady("the scheduler has no workers registered yet")
        return self.core

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            core = self._core()
            alive = [wid for wid, w in core.core.workers.items() if w.is_alive]
            results = await asyncio.gather(*(self.client.ping(w) for w in alive),
                                           return_exceptions=True)
            for wid, res in zip(alive, results, strict=True):
                if isinstance(res, WorkerGone):
                    log.warning("worker %s did not answer its ping", wid)
                    core.worker_failed(wid)


class SchedulerNotReady(RuntimeError):
    """Asked before the workers registered (the router answers 503 meanwhile)."""


def _make_actor_class() -> Any:
    import ray

    @ray.remote
    class GlobalSchedulerActor:
        def __init__(self, cfg: dict[str, Any]) -> None:
            logging.basicConfig(level=logging.INFO)
            self._svc = SchedulerService(ClusterConfig.from_dict(cfg))

        async def register(self, infos: bytes, handles: dict[str, Any]) -> None:
            await self._svc.register(unpack(infos), handles)

        async def submit(self, batch: bytes) -> bytes:
            return encode(self._svc._core().submit_batch(decode(batch, SubmitBatch)))

        async def report(self, rep: bytes) -> None:
            if self._svc.core is not None:  # reports may arrive before registration
                self._svc.core.report(decode(rep, WorkerReport))

        async def abort(self, batch: bytes) -> None:
            core = self._svc._core()
            for rid in decode(batch, AbortBatch).req_ids:
                core.abort(rid)

        async def finish(self, batch: bytes) -> None:
            self._svc._core().finish_batch(decode(batch, FinishBatch))

        async def notices(self, router_id: str) -> AsyncIterator[bytes]:
            inner = self._svc._core().notices(router_id)
            try:
                async for item in inner:
                    yield item
            finally:
                await inner.aclose()

        async def worker_failed(self, worker_id: str) -> None:
            self._svc._core().worker_failed(worker_id)

        async def ready(self) -> bool:
            return self._svc.ready()

        async def why(self, req_id: str, tenant: str | None = None) -> bytes:
            return pack(self._svc._core().why(req_id, tenant))

        async def metrics(self) -> bytes:
            payload, _ = self._svc._core().render_metrics()
            return payload

        async def stats(self) -> bytes:
            if not self._svc.ready():
                return pack({"ready": False, "workers": {}, "policy": self._svc.cfg.scheduling.policy})
            return pack({"ready": True, **self._svc._core().stats()})

        async def worker_infos(self) -> bytes:
            """The registered workers' setup infos (empty before registration)."""
            return pack(self._svc.infos)

    return GlobalSchedulerActor


_ACTOR: Any = None


def scheduler_actor() -> Any:
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _make_actor_class()
    return _ACTOR
