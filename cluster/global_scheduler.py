"""The global scheduler: applies the kernel's plans to the Ray workers (DESIGN §1, §2).

One named Ray actor (``cluster/scheduler_actor.py``) wraps :class:`GlobalScheduler`,
which holds the one :class:`scheduler.cluster_scheduler.ClusterScheduler` and does only
what the kernel cannot: I/O. Every decision is the kernel's; this class applies them.

Life of a request here:

1. ``submit_batch``: each spec goes to ``core.submit`` (admission: accepted into the
   kernel's queue, or rejected with a retry-after and the tiers it sheds); the answers go
   back to the router at once (the router then waits for tokens on its subscriptions).
2. The plan loop (woken by submissions, reports and results, and every control
   interval) asks ``core.plan(now)`` and applies it: every ``DispatchOrder`` is a
   concurrent ``dispatch`` RPC to the decode worker (which reserves the blocks and starts
   the prefill on the named prefill worker or itself) whose answer goes back with
   ``core.on_dispatch_result``; ``PreemptOrder`` and ``AbortOrder`` are RPCs too; an
   abort with an error becomes a ``Notice`` on its router's notice stream.
3. ``report``: a worker's ``WorkerReport`` goes to ``core.on_report`` (events move the
   request, free blocks, running requests and learned step costs refresh the view);
   transfers feed the metrics.
4. ``finish_batch``: the routers' client-side timings feed the latency histograms and
   the SLO counters, and close requests no worker event closed (fair share hears the
   workers' events through the kernel, as in every driver).

Every RPC is awaited with a timeout; a worker whose call fails is removed from the
kernel's view (its requests end with a retryable error). A dead prefill worker's requests
are ended only where their decode worker says their KV had not all arrived
(``release_waiting``); the others decode on. Metrics (router/metrics.py), "why was my
request late" logs and traces hear every decision through the kernel's observer hooks.

Healing (``cluster/scheduler_actor.py`` drives it): ``rejoin`` takes a worker back after
a restart of the worker (a fresh slot; what the old process held was ended with it) or of
this scheduler (``adopt``: the requests the worker holds are taken over as they are);
``claim`` answers a router that reconnected which of its requests this scheduler does
not know, and ends adopted requests nobody waits on any more.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from cluster.kv_memory_stats import KVMemoryStats
from cluster.why import RequestLog, TransferInfo, explain
from engine.aio import wait_event
from router.metrics import CONTENT_TYPE, MetricsRecorder
from scheduler.block_hashes import compute_block_hashes
from scheduler.cluster_scheduler import (
    AbortOrder,
    ClusterScheduler,
    DispatchOrder,
    NewRequest,
    PoolMode,
    PreemptOrder,
)
from scheduler.messages import (
    RETRYABLE_ERRORS,
    ClaimAnswer,
    Dispatch,
    DispatchAnswer,
    FinishBatch,
    GenerationSpec,
    HeldRequest,
    Notice,
    NoticeBatch,
    PreemptCall,
    ReqEvent,
    SubmitAnswer,
    SubmitAnswers,
    SubmitBatch,
    WorkerEvent,
    WorkerReport,
    encode,
)
from scheduler.pool_planner import Pool, PoolSignals
from scheduler.pool_window import PoolWindow
from scheduler.request import Decision, DecisionRecord, Request, RequestState
from scheduler.step_costs import CPU_PRIOR
from scheduler.tiers import TierConfig
from scheduler.topology import LinkCosts, TopologyClass, WorkerInfo, topology_class

if TYPE_CHECKING:
    from cluster.tracing import RequestTracer

log = logging.getLogger(__name__)

MAX_LOGS = 20000  # finished requests kept for /why


class WorkerClient(Protocol):
    """Remote calls to workers; each raises ``WorkerGone`` when the worker is unreachable."""

    async def dispatch(self, worker_id: str, msg: Dispatch) -> DispatchAnswer: ...

    async def preempt(self, worker_id: str, msg: PreemptCall) -> bool:
        """Swap, recompute or (``msg.target_worker_id`` set) migrate ``msg.req_id``; False:
        the worker did not (it no longer decodes it, or the target would not take it)."""
        ...

    async def abort(self, worker_id: str, req_id: str) -> None: ...

    async def release_waiting(self, worker_id: str, prefill_worker_id: str,
                              req_ids: tuple[str, ...] | None) -> list[str]:
        """Decode worker ``worker_id`` drops the requests (all, or ``req_ids``) still
        waiting on ``prefill_worker_id`` for KV or a first token; returns their ids."""
        ...


class GoneReason(enum.Enum):
    """How a worker failed to answer: what the health loop does next depends on it."""

    TIMEOUT = "timeout"  # no answer in time: hung, or overloaded (it is killed, restarts)
    RESTARTING = "restarting"  # its process died; Ray is starting a new one
    DEAD = "dead"  # removed for good (ray.kill with no_restart=True)
    UNKNOWN = "unknown"


class WorkerGone(Exception):
    """A worker did not answer (dead or past the call timeout)."""

    def __init__(self, message: str, reason: GoneReason = GoneReason.UNKNOWN) -> None:
        super().__init__(message)
        self.reason = reason


class GlobalScheduler:
    def __init__(self, tiers: TierConfig, policy_name: str, block_size: int,
                 client: WorkerClient, link_costs: LinkCosts, *,
                 mode: PoolMode = PoolMode.DISAGGREGATED, control_interval_s: float = 0.1,
                 cost_prior: tuple[float, ...] = CPU_PRIOR, chunk_tokens: int = 256,
                 local_prefill_max_tokens: int = 1024,
                 tracer: RequestTracer | None = None) -> None:
        self.tiers = tiers
        self.client = client
        self.control_interval_s = control_interval_s
        self.metrics = MetricsRecorder(tiers)
        self.core = ClusterScheduler(tiers, policy_name, block_size, link_costs, mode=mode,
                                     cost_prior=cost_prior, chunk_tokens=chunk_tokens,
                                     local_prefill_max_tokens=local_prefill_max_tokens,
                                     observer=self, migration=True)
        self.policy = self.core.policy
        self.specs: dict[str, GenerationSpec] = {}
        self.transfers: dict[str, list[TransferInfo]] = {}
        self.logs: OrderedDict[str, RequestLog] = OrderedDict()
        self.transfers_by_class: dict[str, int] = {c.value: 0 for c in TopologyClass}
        # "tier:mode" -> preemptions the kernel ordered for an arrival and the worker
        # carried out (swap / recompute / migrate), for stats and tests.
        self.preemptions: dict[str, int] = {}
        # Every preemption by mode, restore times, swap spaces, prefix caches, links.
        self.kv_stats = KVMemoryStats()
        # What the SLO planner reads (scheduler/pool_window.py), since it last stepped.
        self.pool_window = PoolWindow(time.time())
        self.tracer = tracer
        self._notices: dict[str, asyncio.Queue[bytes]] = {}
        self._pending_notices: dict[str, list[Notice]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()

    # -- workers -------------------------------------------------------------------------

    def register_worker(self, info: WorkerInfo, num_free_blocks: int, *, can_prefill: bool,
                        can_decode: bool) -> None:
        self.core.add_worker(info, num_free_blocks, can_prefill=can_prefill,
                             can_decode=can_decode)

    def worker_failed(self, worker_id: str) -> list[str]:
        slot = self.core.workers.get(worker_id)
        if slot is None or not slot.is_alive:
            return []
        lost = self.core.remove_worker(worker_id, time.time())
        log.warning("worker %s removed; %d requests end with worker_failed", worker_id,
                    len(lost))
        self.metrics.forget_worker(worker_id)
        self.kv_stats.forget_worker(worker_id)
        self.pool_window.forget(worker_id)
        if not slot.can_decode:
            self._release_waiting_on(worker_id, None)
        self._kick()
        return lost

    def rejoin(self, info: WorkerInfo, num_free_blocks: int, *, can_prefill: bool,
               can_decode: bool, held: Sequence[HeldRequest] = (),
               adopt: bool = False) -> tuple[str, ...]:
        """A worker registers again. ``adopt``: this scheduler has not seen it before (it
        restarted), so the requests it holds are taken over; otherwise whatever it holds
        was ended when its old slot died. Returns the ids the worker must drop."""
        self.worker_failed(info.worker_id)
        self.register_worker(info, num_free_blocks, can_prefill=can_prefill,
                             can_decode=can_decode)
        drop = [] if adopt and not can_decode else [h.spec.req_id for h in held]
        if adopt and can_decode:
            drop = []
            for h in held:
                if self.core.adopt(info.worker_id, h):
                    self.specs[h.spec.req_id] = h.spec
                else:
                    drop.append(h.spec.req_id)
            if held:
                log.info("worker %s: took over %d of the %d requests it holds",
                         info.worker_id, len(held) - len(drop), len(held))
        self._kick()
        return tuple(drop)

    def claim(self, router_id: str, req_ids: Sequence[str]) -> ClaimAnswer:
        """A router's requests in flight after its notice stream reconnected: the ones
        this scheduler neither runs nor has closed are unknown (the router retries them);
        adopted requests of that router it did not name end."""
        unknown = tuple(rid for rid in req_ids
                        if self.core.get(rid) is None and rid not in self.logs)
        dropped = self.core.drop_unclaimed(router_id, req_ids, time.time())
        if unknown or dropped:
            log.info("router %s: %d requests unknown here, %d adopted ones unclaimed",
                     router_id, len(unknown), len(dropped))
        self._kick()
        return ClaimAnswer(unknown)

    def check_adopted_prefills(self, jobs: dict[str, set[str]]) -> None:
        """After a restart, once the workers registered: adopted requests still waiting
        on a prefill worker that does not hold them (``jobs``: what each prefill worker
        said it holds) are released by their decode worker unless their KV arrived."""
        for (prefill_id, req_ids) in self._adopted_waiting(jobs).items():
            self._release_waiting_on(prefill_id, req_ids)

    def _adopted_waiting(self, jobs: dict[str, set[str]]) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for prefill_id in {req.prefill_worker_id for req, _, _ in self.core.entries()}:
            if prefill_id is None:
                continue
            held = jobs.get(prefill_id, set())
            for rids in self.core.waiting_on(prefill_id).values():
                missing = {rid for rid in rids if rid not in held}
                if missing:
                    out.setdefault(prefill_id, set()).update(missing)
        return out

    def _release_waiting_on(self, prefill_id: str, only: set[str] | None) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # a synchronous test: nobody to ask
        targets = [w.worker_id for w in self.core.workers.values() if w.is_alive and w.can_decode]
        if only is not None:
            where = {rid: d for d, rids in self.core.waiting_on(prefill_id).items() for rid in rids}
            targets = sorted({where[rid] for rid in only if rid in where})
        for decode_id in targets:
            ids = None if only is None else tuple(
                rid for rid in only if (r := self.core.get(rid)) and r.decode_worker_id == decode_id)
            self._spawn(loop, self._release_waiting(decode_id, prefill_id, ids))

    async def _release_waiting(self, decode_id: str, prefill_id: str,
                               req_ids: tuple[str, ...] | None) -> None:
        try:
            dropped = await self.client.release_waiting(decode_id, prefill_id, req_ids)
        except WorkerGone:
            self.worker_failed(decode_id)
            return
        now = time.time()
        for rid in dropped:
            self.core.abort(rid, now, Decision.WORKER_FAILED, f"worker:{prefill_id}",
                            error="worker_failed")
        if dropped:
            log.warning("%d requests waiting on dead prefill worker %s were dropped by %s",
                        len(dropped), prefill_id, decode_id)
        self._kick()

    def report(self, rep: WorkerReport) -> None:
        now = time.time()
        w = self.core.workers.get(rep.worker_id)
        for ev in rep.events:
            if ev.event is WorkerEvent.PREFILL_DONE and ev.started > 0:
                self._observe_hops(ev)
        self.core.on_report(rep, now)
        if w is not None:
            self.pool_window.on_report(rep.worker_id,
                                       Pool.DECODE if w.can_decode else Pool.PREFILL,
                                       rep.step_seconds)
        for t in rep.transfers:
            entry = self.core.live.get(t.req_id)
            cls = entry.move_class if entry is not None else None
            req = entry.req if entry is not None else None
            if cls is None or req is None or req.prefill_worker_id is None:
                continue
            info = TransferInfo(cls.value, t.num_bytes, t.duration_s, req.prefill_worker_id,
                                rep.worker_id, t.end_time - t.duration_s)
            self.transfers.setdefault(t.req_id, []).append(info)
            self.metrics.on_transfer(cls, t.num_bytes, t.duration_s)
        if w is not None:
            self.metrics.set_kv_usage(rep.worker_id, rep.num_total_blocks - rep.num_free_blocks,
                                      rep.num_total_blocks)
            if rep.memory is not None:
                self.kv_stats.on_memory(rep.worker_id, rep.memory,
                                        lambda src: self._move_class(src, rep.worker_id))
                m = rep.memory
                self.metrics.set_kv_memory(rep.worker_id, m.num_swap_used, m.num_swap_peak,
                                           m.num_prefix_query_blocks, m.num_prefix_hit_blocks)
        self._kick()

    def _observe_hops(self, ev: ReqEvent) -> None:
        """A first prefill's time to first token, hop by hop (``tierserve:ttft_part_seconds``):
        the kernel's arrival and dispatch order, the prefill worker's receipt and step start."""
        entry = self.core.live.get(ev.req_id)
        if entry is None or entry.req.first_token_time is not None:
            return  # gone, or its first token was already counted
        req, sent = entry.req, entry.dispatched_at
        if not req.arrival_time <= sent <= ev.received <= ev.started <= ev.time:
            return  # clocks that disagree (another host's) tell nothing here
        self.metrics.on_ttft_parts(req.tier, {
            "queued": sent - req.arrival_time, "handoff": ev.received - sent,
            "step_wait": ev.started - ev.received, "prefill": ev.time - ev.started})

    def _move_class(self, src_id: str, dst_id: str) -> str | None:
        src, dst = self.core.workers.get(src_id), self.core.workers.get(dst_id)
        if src is None or dst is None:
            return None
        return topology_class(src.info, dst.info).value

    # -- requests ------------------------------------------------------------------------

    def submit_batch(self, batch: SubmitBatch) -> SubmitAnswers:
        now = time.time()
        answers = []
        bs = self.core.block_size
        for spec in batch.specs:
            nr = NewRequest(spec.req_id, spec.tier, spec.arrival_time, len(spec.prompt_token_ids),
                            spec.sampling.max_tokens,
                            tuple(compute_block_hashes(list(spec.prompt_token_ids), bs)),
                            spec.router_id)
            adm = self.core.submit(nr, now)
            if adm.accepted:
                self.specs[spec.req_id] = spec
            answers.append(SubmitAnswer(spec.req_id, adm.outcome, adm.reason, adm.retry_after_s))
        self._kick()
        return SubmitAnswers(tuple(answers), self.core.shed_s_by_tier(now))

    def abort(self, req_id: str) -> None:
        self.core.abort(req_id, time.time())
        self._kick()

    def finish_batch(self, batch: FinishBatch) -> None:
        """The routers' view of ended requests: TTFT/TPOT for metrics and fair share."""
        now = time.time()
        for f in batch.items:
            req = self.core.get(f.req_id) or self._closed_request(f.req_id)
            if req is None:
                continue
            self._observe(req, f.arrival_time, f.first_token_time, f.finish_time,
                          f.num_output_tokens, f.outcome)
            self.core.on_router_finish(f.req_id, f.outcome, now,
                                       num_output_tokens=f.num_output_tokens)
        self._kick()

    def _closed_request(self, req_id: str) -> Request | None:
        rlog = self.logs.get(req_id)
        return None if rlog is None else Request(req_id, rlog.tier, rlog.arrival_time,
                                                 rlog.prompt_len,
                                                 max(rlog.num_output_tokens, 1))

    def _observe(self, req: Request, arrival: float, first: float | None, end: float,
                 n_out: int, outcome: str) -> None:
        if outcome not in ("stop", "length") or first is None:
            return
        # Metrics only: the kernel feeds fair share from the workers' events itself (the
        # same in every driver).
        ttft = first - arrival
        tpot = (end - first) / (n_out - 1) if n_out > 1 else None
        sent = _dispatched_at(req)
        self.metrics.on_request_finished(req.tier, ttft, tpot, end - arrival,
                                         queue_s=None if sent is None else max(sent - arrival, 0.0),
                                         num_prompt_tokens=req.prompt_len,
                                         num_output_tokens=n_out, finished_reason=outcome)

    async def notices(self, router_id: str):  # noqa: ANN201 - an async generator of bytes
        """A router's notice stream: requests the cluster ended, and the shed state."""
        q: asyncio.Queue[bytes] = asyncio.Queue()
        old = self._notices.get(router_id)
        self._notices[router_id] = q
        if old is not None:
            old.put_nowait(b"")
        self._flush_notices()
        q.put_nowait(encode(NoticeBatch((), self.core.shed_s_by_tier(time.time()))))
        try:
            while True:
                item = await q.get()
                if not item:
                    return
                yield item
        finally:
            if self._notices.get(router_id) is q:
                del self._notices[router_id]

    def _flush_notices(self) -> None:
        shed = None
        for router_id in list(self._pending_notices):
            q = self._notices.get(router_id)
            if q is None:
                continue
            if shed is None:
                shed = self.core.shed_s_by_tier(time.time())
            q.put_nowait(encode(NoticeBatch(tuple(self._pending_notices.pop(router_id)), shed)))

    # -- the plan loop -------------------------------------------------------------------

    def _kick(self) -> None:
        self._wake.set()
        if self._loop_task is None or self._loop_task.done():
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return  # no loop (a synchronous test): plans are applied by step()
            self._loop_task = loop.create_task(self._plan_loop())

    async def _plan_loop(self) -> None:
        while True:
            await wait_event(self._wake, self.control_interval_s)
            self._wake.clear()
            try:
                self.step()
            except Exception:  # one bad plan must not stop the loop
                log.exception("applying a plan failed")

    def step(self) -> None:
        """Ask the kernel for a plan and start applying it (RPCs run concurrently)."""
        plan = self.core.plan(time.time())
        loop = asyncio.get_running_loop()
        for d in plan.dispatches:
            self._spawn(loop, self._dispatch(d))
        for p in plan.preempts:
            self._spawn(loop, self._preempt(p))
        for a in plan.aborts:
            self._apply_abort(loop, a)
        self._flush_notices()

    def _spawn(self, loop: asyncio.AbstractEventLoop, coro) -> None:  # noqa: ANN001
        task = loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _dispatch(self, d: DispatchOrder) -> None:
        spec = self.specs.get(d.req_id)
        if spec is None:
            self.core.on_dispatch_result(d.req_id, False, time.time())
            return
        self.transfers_by_class[d.move_class.value] += 1
        req = self.core.get(d.req_id)
        hashes = req.block_hashes if req is not None else ()
        try:
            ans = await self.client.dispatch(d.decode_worker_id, Dispatch(
                spec, d.prefill_worker_id, d.num_blocks, block_hashes=hashes))
        except WorkerGone:
            self.worker_failed(d.decode_worker_id)
            return
        except Exception as e:  # the worker raised: end the request, never leave it hanging
            log.exception("dispatch of %s to %s failed", d.req_id, d.decode_worker_id)
            self.core.on_dispatch_result(d.req_id, False, time.time(), fatal=True,
                                         reason=f"dispatch failed: {type(e).__name__}")
            self._kick()
            return
        self.core.on_dispatch_result(d.req_id, ans.ok, time.time(),
                                     num_free_blocks=ans.num_free_blocks,
                                     num_cached_blocks=ans.num_cached_blocks, reason=ans.reason,
                                     fatal=ans.fatal)
        self._kick()

    async def _preempt(self, p: PreemptOrder) -> None:
        req = self.core.get(p.req_id)
        try:
            ok = await self.client.preempt(p.worker_id, PreemptCall(
                p.req_id, p.mode, p.for_req_id, p.target_worker_id))
        except WorkerGone:
            self.worker_failed(p.worker_id)
            return
        self.core.on_preempt_result(p.req_id, p.worker_id, ok, time.time())
        if ok and req is not None and p.for_req_id is not None:
            key = f"{req.tier}:{p.mode.value}"
            self.preemptions[key] = self.preemptions.get(key, 0) + 1
        self._kick()

    def _apply_abort(self, loop: asyncio.AbstractEventLoop, a: AbortOrder) -> None:
        if a.error is not None and a.router_id:
            self._pending_notices.setdefault(a.router_id, []).append(
                Notice(a.req_id, a.error, retryable=a.error in RETRYABLE_ERRORS))
        for wid in a.worker_ids:
            self._spawn(loop, self._abort_on(wid, a.req_id))

    async def _abort_on(self, worker_id: str, req_id: str) -> None:
        try:
            await self.client.abort(worker_id, req_id)
        except WorkerGone:
            self.worker_failed(worker_id)

    # -- the kernel's observer -----------------------------------------------------------

    def on_decision(self, rec: DecisionRecord, tier: int) -> None:
        self.metrics.on_decision(rec, tier)
        self.kv_stats.on_decision(rec)

    def on_prefix_lookup(self, num_blocks: int, num_hit: int) -> None:
        self.metrics.on_prefix_lookup(num_blocks, num_hit)

    def on_closed(self, req: Request) -> None:
        self.pool_window.on_closed(req, self.tiers[req.tier])
        spec = self.specs.pop(req.req_id, None)
        rlog = RequestLog.from_request(req, self.transfers.pop(req.req_id, []),
                                       tenant=spec.tenant if spec is not None else "")
        self.logs[req.req_id] = rlog
        while len(self.logs) > MAX_LOGS:
            self.logs.popitem(last=False)
        if self.tracer is not None:
            try:
                self.tracer.record(rlog)
            except Exception:  # a broken exporter must not stop scheduling
                log.exception("tracing request %s failed", req.req_id)

    # -- read side -----------------------------------------------------------------------

    def why(self, req_id: str, tenant: str | None = None) -> dict[str, object] | None:
        """``tenant`` set: only that tenant's request, naming no other tenant's."""
        logs: dict[str, RequestLog] = dict(self.logs)
        for req, _, _ in self.core.entries():
            spec = self.specs.get(req.req_id)
            logs[req.req_id] = RequestLog.from_request(
                req, self.transfers.get(req.req_id, []),
                tenant=spec.tenant if spec is not None else "")
        report = explain(req_id, logs, self.tiers, now=time.time(), viewer=tenant)
        return None if report is None else report.to_dict()

    def render_metrics(self) -> tuple[bytes, str]:
        n = self.tiers.num_tiers
        running, preempted, swapped, waiting = [0] * n, [0] * n, [0] * n, [0] * n
        queued = {r.req_id for r in self.core.waiting()}
        for req, _, _ in self.core.entries():
            t = req.tier
            if req.req_id in queued and not req.num_preemptions:
                waiting[t] += 1
            elif req.state in _RUNNING:
                running[t] += 1
            elif req.state in _PREEMPTED or req.req_id in queued:
                preempted[t] += 1
                if req.state is RequestState.PREEMPTED and _swapped(req):
                    swapped[t] += 1
        for t in range(n):
            self.metrics.set_queue_depth(t, waiting[t])
            self.metrics.set_request_counts(t, running=running[t], preempted=preempted[t],
                                            swapped=swapped[t])
        shares = getattr(self.policy, "shares", None)
        if shares is not None and len(shares) == n:
            self.metrics.set_shares([min(max(float(x), 0.0), 1.0) for x in shares])
        self.metrics.set_work_conservation(self.work_conservation_s())
        return self.metrics.render(), CONTENT_TYPE

    def work_conservation_s(self) -> list[float]:
        """Per tier, the kernel's seconds past one planning interval that a waiting request
        fitted a decode worker and was not placed, up to now (0 for a policy that does not
        claim work conservation)."""
        return list(self.core.work_conservation_s(time.time()))

    def health(self) -> dict[str, object]:
        """What ``/health`` needs, in one pass over the workers (``stats`` walks every live
        request and every worker's reserves: not for a probe anyone may send)."""
        live = {"prefill": 0, "decode": 0}
        for w in self.core.workers.values():
            if w.is_alive:
                live["decode" if w.can_decode else "prefill"] += 1
        return {"policy": self.policy.name, "mode": self.core.mode.value, "live_workers": live}

    def planner_signals(self, now: float, num_prefill: int, num_decode: int) -> PoolSignals:
        """The SLO planner's window, closed now (``num_*``: the pools' desired sizes, what
        the planner changes): the decode workers' KV in use, and whether tier-0 requests
        wait for a prefill now."""
        used = total = 0
        for w in self.core.workers.values():
            if w.is_alive and w.can_decode:
                total += w.info.num_kv_blocks
                used += w.info.num_kv_blocks - max(w.free_blocks, 0)
        waiting0 = any(r.tier == 0 for r in self.core.waiting())
        return self.pool_window.close(now, num_prefill, num_decode,
                                      used / total if total else 0.0, waiting0)

    def stats(self) -> dict[str, object]:
        return {
            "policy": self.policy.name,
            "mode": self.core.mode.value,
            "num_live": len(self.core.live),
            "num_queued": len(self.core.queue),
            "queued_by_tier": _count(r.tier for r in self.core.waiting()),
            # Live requests by state, and by where they run ("prefill->decode" workers).
            "live_states": _count(req.state.value for req, _, _ in self.core.entries()),
            "live_placements": _count(f"{req.prefill_worker_id}->{req.decode_worker_id}"
                                      for req, _, _ in self.core.entries()),
            "transfers_by_class": dict(self.transfers_by_class),
            "preemptions": dict(self.preemptions),
            # Per tier: seconds a waiting request that fitted a worker was left unplaced
            # past one planning interval (tierserve:work_conservation_seconds_total).
            "work_conservation_s": self.work_conservation_s(),
            # Per tier and hop, the time-to-first-token histograms (MetricsRecorder.ttft_parts).
            "ttft_parts": self.metrics.ttft_parts(),
            "kv_memory": self.kv_stats.snapshot(self.core.links.snapshot()),
            "workers": {wid: {"alive": w.is_alive, "free": w.num_free_blocks,
                              "total": w.info.num_kv_blocks, "domain": w.info.domain,
                              # requests decoding (or reserved) here / prefilling here
                              "num_held": len(w.held), "num_prefilling": len(w.prefill_left),
                              # blocks dispatches and migrations in flight will take here
                              "promised": w.num_promised,
                              # blocks a request of each tier leaves free here now
                              "reserve": list(self.core.decode_reserves(wid)),
                              "node": w.info.node,
                              "role": "decode" if w.can_decode else "prefill",
                              "step_costs": list(w.costs.coefficients)}
                        for wid, w in self.core.workers.items()},
        }


_RUNNING = frozenset({RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING})
_PREEMPTED = frozenset({RequestState.PREEMPTING, RequestState.PREEMPTED})


def _count(keys: object) -> dict[str, int]:
    out: dict[str, int] = {}
    for k in keys:  # type: ignore[attr-defined]
        out[str(k)] = out.get(str(k), 0) + 1
    return out


def _swapped(req: Request) -> bool:
    from scheduler.request import Decision

    for rec in reversed(req.history):
        if rec.decision in (Decision.PREEMPT_SWAP, Decision.PREEMPT_RECOMPUTE,
                            Decision.PREEMPT_MIGRATE):
            return rec.decision is Decision.PREEMPT_SWAP
    return False


def _dispatched_at(req: Request) -> float | None:
    """When the request first left the global queue for a worker, as the kernel recorded it
    (the decode worker's answer to its dispatch; None: it never did)."""
    for rec in req.history:
        if rec.from_state is RequestState.QUEUED and rec.to_state is not RequestState.QUEUED \
                and not rec.to_state.is_finished:
            return rec.time
    return None
