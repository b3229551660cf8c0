"""The global scheduler as one named Ray actor, and its Ray-backed worker client.

:class:`RayWorkerClient` reaches workers through their actor handles, every call
awaited with a timeout; an unreachable worker raises ``WorkerGone`` with the reason (no
answer in time, its process restarting, removed for good). Messages in and out are typed
``scheduler.messages`` messages as msgpack bytes. With ``tracing.enabled`` the scheduler
gets a :class:`~cluster.tracing.RequestTracer` (:func:`make_tracer`) and emits one trace per
request as it closes.

:class:`SchedulerService`, the actor's body, adds what keeps the cluster whole
(``cluster/supervisor.py`` says why it works this way):

1. REGISTER: each worker sends a ``WorkerHello`` once it has set up, and again whenever
   a report of its is answered "unknown". A new ``incarnation`` of a known worker replaces
   the old one (whose requests were ended with it); a worker this process never saw, after
   this actor itself restarted, has its requests adopted as they are.
2. WATCH: every second each live worker is pinged. No answer in time, or busy without a
   step (or a report) for ``scheduling.worker_stall_timeout_s`` in two rounds in a row:
   removed and killed, so Ray restarts it.
   Its process restarting (or a new incarnation answering): removed, back when it registers.
   Removed for good (``ray.kill(no_restart=True)``): removed.
3. SETTLE: once every expected worker has registered (or ``SETTLE_GRACE_S`` after this
   actor started), routers' claims are answered and adopted requests still waiting on a
   prefill worker that does not hold them are released.

The actor runs with ``max_restarts=-1`` (cluster/app.py): after a crash Ray starts it
again with the same arguments, and the workers' next reports bring it back its view.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from cluster.config import ClusterConfig
from cluster.global_scheduler import GlobalScheduler, GoneReason, WorkerGone
from cluster.messages import pack, setup_document
from cluster.supervisor import ProgressWatch, Verdict
from scheduler.cluster_scheduler import PoolMode
from scheduler.links import prior_link_costs
from scheduler.messages import (
    AbortBatch,
    Claim,
    ClaimAnswer,
    Dispatch,
    DispatchAnswer,
    FinishBatch,
    HelloAnswer,
    PreemptCall,
    SubmitAnswer,
    SubmitAnswers,
    SubmitBatch,
    SubmitOutcome,
    WorkerHello,
    WorkerReport,
    WorkerSetup,
    decode,
    encode,
)
from scheduler.step_costs import cost_prior
from scheduler.topology import WorkerInfo, WorkerRole

if TYPE_CHECKING:
    from cluster.tracing import RequestTracer

log = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
PING_TIMEOUT_S = 3.0
# A restarted scheduler answers routers' claims once every expected worker registered
# again, or this long after it started (a worker may be down too).
SETTLE_GRACE_S = 10.0


class RayWorkerClient:
    def __init__(self, handles: dict[str, Any], timeout_s: float) -> None:
        self.handles = handles
        self.timeout_s = timeout_s

    async def _call(self, worker_id: str, method: str, *args: Any,
                    timeout: float | None = None) -> Any:
        import ray

        handle = self.handles.get(worker_id)
        if handle is None:
            raise WorkerGone(worker_id, GoneReason.DEAD)
        try:
            return await asyncio.wait_for(getattr(handle, method).remote(*args),
                                          timeout or self.timeout_s)
        except asyncio.TimeoutError:
            raise WorkerGone(f"{worker_id}: no answer", GoneReason.TIMEOUT) from None
        except ray.exceptions.ActorUnavailableError:
            raise WorkerGone(f"{worker_id}: restarting", GoneReason.RESTARTING) from None
        except ray.exceptions.ActorDiedError:
            # With max_restarts=-1 only a worker removed for good dies for good.
            raise WorkerGone(f"{worker_id}: removed", GoneReason.DEAD) from None
        except ray.exceptions.RayActorError:
            raise WorkerGone(f"{worker_id}: unreachable", GoneReason.UNKNOWN) from None

    async def dispatch(self, worker_id: str, msg: Dispatch) -> DispatchAnswer:
        return decode(await self._call(worker_id, "dispatch", encode(msg)), DispatchAnswer)

    async def preempt(self, worker_id: str, msg: PreemptCall) -> bool:
        return bool(await self._call(worker_id, "preempt", encode(msg)))

    async def abort(self, worker_id: str, req_id: str) -> None:
        await self._call(worker_id, "abort", req_id)

    async def release_waiting(self, worker_id: str, prefill_worker_id: str,
                              req_ids: tuple[str, ...] | None) -> list[str]:
        got = await self._call(worker_id, "release_waiting", prefill_worker_id,
                               None if req_ids is None else list(req_ids))
        return [str(r) for r in got]

    async def ping(self, worker_id: str) -> str:
        """The incarnation answering under ``worker_id``."""
        return str(await self._call(worker_id, "ping", timeout=PING_TIMEOUT_S))

    async def kill(self, worker_id: str) -> None:
        """Kill the worker's process; Ray starts it again (``no_restart=False``)."""
        import ray

        handle = self.handles.get(worker_id)
        if handle is not None:
            await asyncio.to_thread(ray.kill, handle, no_restart=False)


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
    """The actor's body: the plain scheduler plus registration, the watch and settling."""

    def __init__(self, cfg: ClusterConfig, expected_worker_ids: tuple[str, ...] = (),
                 client: RayWorkerClient | None = None) -> None:
        """``client``: how workers are reached (a fake in unit tests)."""
        self.cfg = cfg
        self.client = client or RayWorkerClient({}, cfg.router.rpc_timeout_s)
        self.core: GlobalScheduler | None = None
        # The infos the workers registered with, by worker id: a restarted Serve app
        # reuses them (cluster.app.attach_workers).
        self.infos: dict[str, dict[str, Any]] = {}
        # Every worker this process has seen, and the incarnation it last registered.
        self.incarnations: dict[str, str] = {}
        self.watch = ProgressWatch(cfg.scheduling.worker_stall_timeout_s)
        self.expected = frozenset(expected_worker_ids)
        # New with every start of this actor's process (stats; the drills watch it).
        self.incarnation = uuid.uuid4().hex[:12]
        self._started = time.monotonic()
        self._ready = asyncio.Event()
        self._settled = asyncio.Event()
        self._prefill_jobs: dict[str, set[str]] = {}
        self._suspects: dict[str, Verdict] = {}  # the watch's verdicts of the last round
        self._health: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for t in [self._health, *self._tasks]:
            if t is not None:
                t.cancel()
        if self.core is not None:
            await self.core.close()

    # -- registration --------------------------------------------------------------------

    def _make_core(self, info: WorkerSetup) -> GlobalScheduler:
        bpb = info.bytes_per_block or 1 << 16
        device = info.device
        p = self.cfg.pools
        return GlobalScheduler(self.cfg.tier_config, self.cfg.scheduling.policy,
                               p.block_size, self.client, prior_link_costs(bpb, device),
                               mode=PoolMode(self.cfg.pool_mode),
                               control_interval_s=self.cfg.scheduling.control_interval_s,
                               cost_prior=cost_prior(device),
                               chunk_tokens=p.prefill_chunk_size,
                               local_prefill_max_tokens=p.auto_local_prefill_max_tokens,
                               tracer=make_tracer(self.cfg))

    async def register(self, hello: WorkerHello, handle: Any) -> HelloAnswer:
        if self.core is None:
            self.core = self._make_core(hello.info)
            self._ready.set()
        if self._health is None:
            self._health = asyncio.get_running_loop().create_task(self._health_loop())
        wid = hello.worker_id
        self.client.handles[wid] = handle
        slot = self.core.core.workers.get(wid)
        if (self.incarnations.get(wid) == hello.incarnation and slot is not None
                and slot.is_alive):
            return HelloAnswer()  # a repeated hello (its first answer was lost)
        adopt = wid not in self.incarnations
        self.incarnations[wid] = hello.incarnation
        self.infos[wid] = setup_document(wid, hello.role, hello.info)
        i = hello.info
        role = WorkerRole(hello.role)
        info = WorkerInfo(wid, role, i.node, i.device, i.nvlink_domain, i.num_total_blocks)
        decodes = role is WorkerRole.DECODE
        mode = self.core.core.mode
        drop = self.core.rejoin(info, i.num_free_blocks,
                                can_prefill=not decodes or mode is not PoolMode.DISAGGREGATED,
                                can_decode=decodes, held=hello.held, adopt=adopt)
        if not decodes:
            self._prefill_jobs[wid] = {h.spec.req_id for h in hello.held}
        self.watch.watch(wid, hello.incarnation, time.monotonic())
        log.info("worker %s registered (incarnation %s%s)", wid, hello.incarnation,
                 ", adopted its requests" if adopt and hello.held else "")
        self._check_settled()
        return HelloAnswer(drop)

    def report(self, rep: WorkerReport) -> bool:
        """Apply a report; False: the sender is not a registered live worker (it registers)."""
        if self.core is None:
            return False
        slot = self.core.core.workers.get(rep.worker_id)
        if slot is None or not slot.is_alive:
            return False
        if not self.watch.on_report(rep.worker_id, rep.incarnation, rep.num_steps,
                                    rep.is_busy, time.monotonic(), rep.is_healthy):
            return False
        self.core.report(rep)
        return True

    def ready(self) -> bool:
        return self.core is not None

    async def wait_ready(self) -> GlobalScheduler:
        await self._ready.wait()
        assert self.core is not None
        return self.core

    def _core(self) -> GlobalScheduler:
        if self.core is None:
            raise SchedulerNotReady("the scheduler has no workers registered yet")
        return self.core

    # -- settling after a restart --------------------------------------------------------

    def _check_settled(self) -> None:
        if self._settled.is_set() or self.core is None:
            return
        alive = {wid for wid, w in self.core.core.workers.items() if w.is_alive}
        if self.expected <= alive or time.monotonic() - self._started > SETTLE_GRACE_S:
            self._settled.set()
            self.core.check_adopted_prefills(self._prefill_jobs)
            self._prefill_jobs.clear()

    async def claim(self, c: Claim) -> ClaimAnswer:
        core = await self.wait_ready()
        try:
            await asyncio.wait_for(self._settled.wait(), SETTLE_GRACE_S)
        except asyncio.TimeoutError:
            self._check_settled()
        return core.claim(c.router_id, c.req_ids)

    # -- the watch -----------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            try:
                await self._check_workers()
            except Exception:  # one bad round must not end the watch
                log.exception("health check failed")

    async def _check_workers(self) -> None:
        core = self._core()
        alive = [(wid, self.incarnations.get(wid)) for wid, w in core.core.workers.items()
                 if w.is_alive]
        results = await asyncio.gather(*(self.client.ping(w) for w, _ in alive),
                                       return_exceptions=True)
        for (wid, inc), res in zip(alive, results, strict=True):
            if isinstance(res, WorkerGone):
                self._give_up(wid, inc, res.reason.value, kill=res.reason is GoneReason.TIMEOUT)
            elif isinstance(res, BaseException):
                log.warning("ping of %s failed: %r", wid, res)
            elif res != inc:
                self._give_up(wid, inc, "restarted", kill=False)
        # A verdict must stand in two rounds in a row: reports queued behind a slow round
        # of this actor are applied before the second one.
        verdicts = dict(self.watch.verdicts(time.monotonic()))
        for wid, verdict in verdicts.items():
            if self._suspects.get(wid) == verdict:
                self._give_up(wid, self.incarnations.get(wid), verdict.value, kill=True)
        self._suspects = verdicts
        self._check_settled()

    def _give_up(self, worker_id: str, incarnation: str | None, why: str, *, kill: bool) -> None:
        """Remove the worker (if ``incarnation`` is still the registered one) and, for a
        hung one, kill it so Ray restarts it."""
        core = self._core()
        slot = core.core.workers.get(worker_id)
        if self.incarnations.get(worker_id) != incarnation or slot is None or not slot.is_alive:
            return  # already gone, or a newer incarnation registered meanwhile
        log.warning("worker %s (incarnation %s): %s%s", worker_id, incarnation, why,
                    "; killing it, Ray restarts it" if kill else "")
        self.watch.forget(worker_id)
        core.worker_failed(worker_id)
        if kill:
            task = asyncio.get_running_loop().create_task(self._kill(worker_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _kill(self, worker_id: str) -> None:
        try:
            await self.client.kill(worker_id)
        except Exception as e:  # already gone
            log.warning("could not kill %s: %r", worker_id, e)

    async def suspect(self, worker_id: str) -> None:
        """Someone (a router whose token stream broke) thinks the worker died: check now."""
        inc = self.incarnations.get(worker_id)
        try:
            answer = await self.client.ping(worker_id)
        except WorkerGone as e:
            self._give_up(worker_id, inc, e.reason.value, kill=e.reason is GoneReason.TIMEOUT)
            return
        if answer != inc:
            self._give_up(worker_id, inc, "restarted", kill=False)


class SchedulerNotReady(RuntimeError):
    """Asked before the workers registered (the router answers 503 meanwhile)."""


def _make_actor_class() -> Any:
    import ray

    @ray.remote
    class GlobalSchedulerActor:
        def __init__(self, cfg: dict[str, Any], expected_worker_ids: list[str] | None = None
                     ) -> None:
            logging.basicConfig(level=logging.INFO)
            self._svc = SchedulerService(ClusterConfig.from_dict(cfg),
                                         tuple(expected_worker_ids or ()))

        async def register_worker(self, hello: bytes, handle: Any) -> bytes:
            return encode(await self._svc.register(decode(hello, WorkerHello), handle))

        async def submit(self, batch: bytes) -> bytes:
            specs = decode(batch, SubmitBatch)
            if not self._svc.ready():
                return encode(SubmitAnswers(tuple(
                    SubmitAnswer(s.req_id, SubmitOutcome.UNAVAILABLE, "no worker registered yet")
                    for s in specs.specs)))
            return encode(self._svc._core().submit_batch(specs))

        async def report(self, rep: bytes) -> bool:
            return self._svc.report(decode(rep, WorkerReport))

        async def abort(self, batch: bytes) -> None:
            ids = decode(batch, AbortBatch).req_ids
            if self._svc.core is not None:
                for rid in ids:
                    self._svc.core.abort(rid)

        async def finish(self, batch: bytes) -> None:
            items = decode(batch, FinishBatch)
            if self._svc.core is not None:  # timings of before a restart are dropped
                self._svc.core.finish_batch(items)

        async def notices(self, router_id: str) -> AsyncIterator[bytes]:
            core = await self._svc.wait_ready()  # a router may subscribe before the workers
            inner = core.notices(router_id)
            try:
                async for item in inner:
                    yield item
            finally:
                await inner.aclose()

        async def claim(self, c: bytes) -> bytes:
            return encode(await self._svc.claim(decode(c, Claim)))

        async def worker_failed(self, worker_id: str) -> None:
            if self._svc.ready():
                await self._svc.suspect(worker_id)

        async def ready(self) -> bool:
            return self._svc.ready()

        async def why(self, req_id: str, tenant: str | None = None) -> bytes:
            if not self._svc.ready():
                return pack(None)
            return pack(self._svc._core().why(req_id, tenant))

        async def metrics(self) -> bytes:
            if not self._svc.ready():
                return b""  # nothing measured yet: an empty exposition
            payload, _ = self._svc._core().render_metrics()
            return payload

        async def health(self) -> bytes:
            if not self._svc.ready():
                return pack({"ready": False, "policy": self._svc.cfg.scheduling.policy,
                             "live_workers": {"prefill": 0, "decode": 0}})
            return pack({"ready": True, **self._svc._core().health()})

        async def stats(self) -> bytes:
            inc = self._svc.incarnation
            if not self._svc.ready():
                return pack({"ready": False, "workers": {}, "incarnation": inc,
                             "policy": self._svc.cfg.scheduling.policy})
            return pack({"ready": True, "incarnation": inc, **self._svc._core().stats()})

        async def worker_infos(self) -> bytes:
            """The registered workers' setup infos (empty before registration)."""
            return pack(list(self._svc.infos.values()))

    return GlobalSchedulerActor


_ACTOR: Any = None


def scheduler_actor() -> Any:
    global _ACTOR
    if _ACTOR is None:
        _ACTOR = _make_actor_class()
    return _ACTOR
