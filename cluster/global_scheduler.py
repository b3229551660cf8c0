"""The global scheduler: admission, placement, cross-worker preemption (DESIGN §1, §2).

One named Ray actor (:class:`GlobalSchedulerActor`) wraps the plain
:class:`GlobalScheduler`, which applies the decisions of a
``scheduler.policy.SchedulingPolicy`` chosen by name (``tierserve``, ``vllm-fcfs``...).

Life of a request here:

1. ``submit(spec)``: a kernel ``Request`` is created and admitted by the policy
   (accept / queue / reject with retry-after). Rejected: answered at once.
2. Placement loop (woken by arrivals and worker reports, and every control
   interval): the policy orders the queue; for each request it picks a prefill worker
   (prefix match from the :class:`PrefixMirror` fed by block events, plus load) and a
   decode worker (KV headroom, same NVLink domain first). No decode room: the policy may
   preempt lower-tier requests on a decode worker (swap or recompute), and the request
   waits for the next pass.
3. The decode worker reserves the request's blocks (all or nothing) and returns a
   kvtransfer ticket; only then is the prefill worker told to start (DESIGN §1:
   decode blocks are reserved before the prefill sends). QUEUED -> PREFILLING.
4. ``submit`` answers the router with the decode worker to stream from.
5. Worker reports carry lifecycle events (prefill done, decode start, preempted,
   resumed, finished, aborted), block events and KV use; each event becomes a
   ``transition`` with its ``DecisionRecord``, which feeds metrics and ``why``.
6. ``finish(req_id, timings)`` from the router closes the request's books: SLO
   observation for the fair-share controller, the latency histograms. Every closed
   (or rejected) request keeps its ``RequestLog`` for ``why`` and, with a tracer
   configured, becomes one OpenTelemetry trace (``RequestTracer.record``).

Metrics (router/metrics.py): every transition (``on_decision``), finished requests,
transfers, KV use per worker from reports, prefix-cache lookups at placement
(``on_prefix_lookup``: the prompt's full blocks against the reused ones), and at each
``/metrics`` scrape a snapshot of queue depth, running / preempted / swapped counts per
tier (``set_request_counts``) and the policy's fair shares (``set_shares``).

Workers are reached through a :class:`WorkerClient` (Ray handles with timeouts in
production, a fake in unit tests); a worker whose call fails is marked dead and its
requests are reported to the router as failed, which retries them elsewhere.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from cluster.aio import wait_event
from cluster.messages import WorkerEvent
from cluster.why import RequestLog, TransferInfo, explain
from router.metrics import CONTENT_TYPE, MetricsRecorder
from scheduler.admission import AdmissionKind, LoadSnapshot, kv_release_rate
from scheduler.placement import DecodeView, PrefillView
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptMode, VictimView
from scheduler.prefix_index import BlockRemoved, BlockStored, PrefixMirror
from scheduler.request import Decision, IllegalTransition, Request, RequestState, transition
from scheduler.tiers import TierConfig
from scheduler.topology import LinkCosts, TopologyClass, WorkerInfo, WorkerRole, topology_class

if TYPE_CHECKING:
    from cluster.tracing import RequestTracer

log = logging.getLogger(__name__)

MAX_LOGS = 20000  # finished requests kept for /why


class WorkerClient(Protocol):
    """Remote calls to workers; each raises ``WorkerGone`` when the worker is unreachable."""

    async def reserve(self, worker_id: str, msg: dict[str, Any]) -> dict[str, Any]: ...

    async def start_prefill(self, worker_id: str, msg: dict[str, Any]) -> None: ...

    async def preempt(self, worker_id: str, req_id: str, mode: str, for_req_id: str) -> bool: ...

    async def abort(self, worker_id: str, req_id: str) -> None: ...


class WorkerGone(Exception):
    """A worker did not answer (dead or past the call timeout)."""


@dataclass(slots=True)
class MeasuredEstimate:
    """ServiceEstimate from the workers' measured speeds (EWMA), with priors."""

    prefill_tokens_per_s: float = 2000.0
    decode_step_s: float = 0.05

    def prefill_s(self, num_new_tokens: int, num_context_tokens: int) -> float:
        return 0.002 + num_new_tokens / max(self.prefill_tokens_per_s, 1.0)

    def decode_token_s(self) -> float:
        return self.decode_step_s

    def observe(self, prefill_tokens_per_s: float | None, decode_step_s: float | None) -> None:
        a = 0.2
        if prefill_tokens_per_s and prefill_tokens_per_s > 0:
            self.prefill_tokens_per_s += a * (prefill_tokens_per_s - self.prefill_tokens_per_s)
        if decode_step_s and decode_step_s > 0:
            self.decode_step_s += a * (decode_step_s - self.decode_step_s)


@dataclass(slots=True)
class WorkerState:
    info: WorkerInfo
    num_free_blocks: int
    num_total_blocks: int
    is_alive: bool = True
    backlog_tokens: int = 0
    # Decode workers: req_id -> blocks held (preemption candidates).
    running: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Live:
    req: Request
    spec: dict[str, Any]
    placed: asyncio.Future[dict[str, Any]]
    transfers: list[TransferInfo] = field(default_factory=list)
    move_class: TopologyClass | None = None


def default_link_costs(bytes_per_block: int) -> LinkCosts:
    gb = 1e9
    return LinkCosts(
        bytes_per_block=bytes_per_block,
        bw={TopologyClass.SAME_DEVICE: 500 * gb, TopologyClass.SAME_DOMAIN: 150 * gb,
            TopologyClass.SAME_NODE: 20 * gb, TopologyClass.CROSS_NODE: 10 * gb},
        latency={TopologyClass.SAME_DEVICE: 5e-6, TopologyClass.SAME_DOMAIN: 10e-6,
                 TopologyClass.SAME_NODE: 30e-6, TopologyClass.CROSS_NODE: 100e-6},
        host_bw=20 * gb,
    )


class GlobalScheduler:
    def __init__(self, tiers: TierConfig, policy_name: str, block_size: int,
                 client: WorkerClient, *, bytes_per_block: int = 1 << 16,
                 control_interval_s: float = 0.1, tracer: RequestTracer | None = None) -> None:
        self.tiers = tiers
        self.block_size = block_size
        self.client = client
        self.est = MeasuredEstimate()
        self.policy: SchedulingPolicy = make_policy(
            policy_name, PolicyContext(tiers, self.est, default_link_costs(bytes_per_block),
                                       block_size))
        self.control_interval_s = control_interval_s
        self.workers: dict[str, WorkerState] = {}
        self.mirror = PrefixMirror()
        self.metrics = MetricsRecorder(tiers)
        self.live: dict[str, _Live] = {}
        self.queue: dict[str, _Live] = {}
        self.logs: OrderedDict[str, RequestLog] = OrderedDict()
        self.transfers_by_class: dict[str, int] = {c.value: 0 for c in TopologyClass}
        # "tier:mode" -> preemptions seen (swap / recompute), for stats and tests.
        self.preemptions: dict[str, int] = {}
        # One OpenTelemetry trace per closed request (cluster/tracing.py), when configured.
        self.tracer = tracer
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # aborts in flight (strong refs)

    async def close(self) -> None:
        """Stop the placement loop (the actor's end, or a test's)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)

    # -- workers -------------------------------------------------------------------------

    def register_worker(self, info: WorkerInfo, num_free_blocks: int) -> None:
        self.workers[info.worker_id] = WorkerState(info, num_free_blocks, info.num_kv_blocks)

    def mark_dead(self, worker_id: str) -> list[str]:
        """Forget a dead worker; returns the live requests it held (to be retried)."""
        w = self.workers.get(worker_id)
        if w is None or not w.is_alive:
            return []
        w.is_alive = False
        self.mirror.drop_worker(worker_id)
        lost = [rid for rid, lv in self.live.items()
                if worker_id in (lv.req.prefill_worker_id, lv.req.decode_worker_id)]
        for rid in lost:
            self._move(rid, RequestState.ABORTED, Decision.WORKER_FAILED, f"worker:{worker_id}")
        log.warning("worker %s marked dead; %d requests lost", worker_id, len(lost))
        return lost

    def report(self, rep: Mapping[str, Any]) -> None:
        wid = str(rep["worker_id"])
        w = self.workers.get(wid)
        if w is None or not w.is_alive:
            return
        w.num_free_blocks = int(rep["num_free_blocks"])
        w.backlog_tokens = int(rep.get("backlog_tokens", 0))
        if "running" in rep:
            w.running = {str(r): int(n) for r, n in rep["running"]}
        for ev in rep.get("block_events", ()):
            if ev["kind"] == "stored":
                self.mirror.apply(wid, BlockStored(list(ev["block_hashes"]), ev.get("parent_hash")))
            else:
                self.mirror.apply(wid, BlockRemoved(list(ev["block_hashes"])))
        for ev in rep.get("events", ()):
            self._on_event(wid, ev)
        for t in rep.get("transfers", ()):
            lv = self.live.get(str(t["req_id"]))
            if lv is None or lv.move_class is None or lv.req.prefill_worker_id is None:
                continue
            info = TransferInfo(lv.move_class.value, int(t["num_bytes"]),
                                float(t["duration_s"]), lv.req.prefill_worker_id, wid,
                                float(t["end_time"]) - float(t["duration_s"]))
            lv.transfers.append(info)
            self.metrics.on_transfer(lv.move_class, info.num_bytes, info.seconds)
        self.est.observe(rep.get("prefill_tokens_per_s"), rep.get("decode_step_s"))
        self.metrics.set_kv_usage(wid, w.num_total_blocks - w.num_free_blocks, w.num_total_blocks)
        self._wake.set()

    # -- requests ------------------------------------------------------------------------

    async def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Admit and place; answers ``{"kind": "placed"|"rejected", ...}``."""
        now = time.time()
        prompt = list(spec["prompt_token_ids"])
        from engine.block_pool import compute_block_hashes  # light: no model import

        req = Request(req_id=str(spec["req_id"]), tier=int(spec["tier"]), arrival_time=now,
                      prompt_len=len(prompt), max_new_tokens=int(spec["max_tokens"]),
                      block_hashes=tuple(compute_block_hashes(prompt, self.block_size)))
        if req.req_id in self.live:
            return {"kind": "rejected", "reason": "duplicate request id", "retry_after_s": None}
        if not 0 <= req.tier < self.tiers.num_tiers:
            return {"kind": "rejected", "reason": f"tier {req.tier} not configured",
                    "retry_after_s": None}
        decision = self.policy.admit(req, now, self._load())
        if decision.kind is AdmissionKind.REJECT:
            rec = transition(req, RequestState.REJECTED, decision=Decision.REJECT,
                             triggered_by=f"admission:{decision.reason.value}", now=now)
            self.metrics.on_decision(rec, req.tier)
            self._keep_log(req, [])
            return {"kind": "rejected", "reason": decision.reason.value,
                    "retry_after_s": decision.retry_after_s}
        self.policy.record_demand(req.tier, req.prompt_len + req.max_new_tokens, now)
        live = _Live(req, spec, asyncio.get_running_loop().create_future())
        self.live[req.req_id] = live
        self.queue[req.req_id] = live
        self._ensure_loop()
        self._wake.set()
        return await asyncio.shield(live.placed)

    async def abort(self, req_id: str, decision: Decision = Decision.CLIENT_GONE,
                    by: str = "router:abort") -> None:
        """End the request everywhere: its queue slot, its workers' blocks, its books."""
        lv = self.live.get(req_id)
        if lv is None:
            return
        self.queue.pop(req_id, None)
        if not lv.placed.done():
            lv.placed.set_result({"kind": "aborted"})
        for wid in {lv.req.prefill_worker_id, lv.req.decode_worker_id} - {None}:
            try:
                await self.client.abort(str(wid), req_id)
            except WorkerGone:
                self.mark_dead(str(wid))
        self._move(req_id, RequestState.ABORTED, decision, by)
        self._close(req_id)

    def finish(self, req_id: str, timing: Mapping[str, Any]) -> None:
        """The router's view of a finished request: TTFT/TPOT for metrics and fair share."""
        lv = self.live.get(req_id)
        req = lv.req if lv else None
        if req is None:
            return
        n_out = int(timing.get("num_output_tokens", 0))
        req.num_output_tokens = n_out
        first = timing.get("first_token_time")
        if first is not None:
            req.first_token_time = float(first)
        end = float(timing.get("finish_time", time.time()))
        arrival = float(timing.get("arrival_time", req.arrival_time))
        ttft = None if first is None else float(first) - arrival
        tpot = (end - float(first)) / (n_out - 1) if first is not None and n_out > 1 else None
        spec = self.tiers[req.tier]
        outcome = str(timing.get("outcome", "stop"))
        if outcome in ("stop", "length") and ttft is not None:
            self.metrics.on_request_finished(
                req.tier, ttft, tpot, end - arrival, num_prompt_tokens=req.prompt_len,
                num_output_tokens=n_out, finished_reason=outcome)
            if spec.ttft_s is not None:
                self.policy.observe_latency(req.tier, ttft, spec.ttft_s)
            elif spec.e2e_s is not None:
                self.policy.observe_latency(req.tier, end - arrival, spec.e2e_s)
            self.policy.record_served(req.tier, req.prompt_len + n_out, end - arrival, end)
            decision = Decision.FINISH_LENGTH if outcome == "length" else Decision.FINISH_STOP
            to = (RequestState.FINISHED_LENGTH if outcome == "length"
                  else RequestState.FINISHED_STOPPED)
            self._move(req_id, to, decision, "router:finish")
        else:
            self._move(req_id, RequestState.ABORTED, Decision.ERROR, f"router:{outcome}")
        self._close(req_id)

    def why(self, req_id: str) -> dict[str, Any] | None:
        logs: dict[str, RequestLog] = dict(self.logs)
        for rid, lv in self.live.items():
            logs[rid] = RequestLog.from_request(lv.req, lv.transfers)
        report = explain(req_id, logs, self.tiers, now=time.time())
        return None if report is None else report.to_dict()

    def render_metrics(self) -> tuple[bytes, str]:
        """The exposition, after a snapshot of the gauges (queue depth, request counts
        by state, fair shares) from the live requests and the policy."""
        n = self.tiers.num_tiers
        running, preempted, swapped = [0] * n, [0] * n, [0] * n
        for lv in self.live.values():
            req, t = lv.req, lv.req.tier
            if req.req_id in self.queue and not req.num_preemptions:
                continue  # waiting: the queue depth below
            if req.state in _RUNNING:
                running[t] += 1
            elif req.state in _PREEMPTED or req.req_id in self.queue:
                preempted[t] += 1  # includes recompute victims queued again
                if req.state is RequestState.PREEMPTED and _last_preempt(req) is \
                        Decision.PREEMPT_SWAP:
                    swapped[t] += 1
        for t in range(n):
            self.metrics.set_queue_depth(t, sum(1 for lv in self.queue.values() if lv.req.tier == t))
            self.metrics.set_request_counts(t, running=running[t], preempted=preempted[t],
                                            swapped=swapped[t])
        shares = getattr(self.policy, "shares", None)
        if shares is not None and len(shares) == n:
            self.metrics.set_shares([min(max(float(x), 0.0), 1.0) for x in shares])
        return self.metrics.render(), CONTENT_TYPE

    def stats(self) -> dict[str, Any]:
        return {
            "policy": self.policy.name,
            "num_live": len(self.live),
            "num_queued": len(self.queue),
            "transfers_by_class": dict(self.transfers_by_class),
            "preemptions": dict(self.preemptions),
            "workers": {wid: {"alive": w.is_alive, "free": w.num_free_blocks,
                              "total": w.num_total_blocks, "domain": w.info.domain,
                              "node": w.info.node, "role": w.info.role.value}
                        for wid, w in self.workers.items()},
        }

    # -- internals -----------------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._placement_loop())

    async def _placement_loop(self) -> None:
        while True:
            await wait_event(self._wake, self.control_interval_s)
            self._wake.clear()
            now = time.time()
            self.policy.tick(now, [lv.req for lv in self.queue.values()])
            for req in self.policy.order([lv.req for lv in self.queue.values()], now):
                if req.req_id not in self.queue:
                    continue
                try:
                    placed = await self._try_place(self.queue[req.req_id], now)
                except Exception:  # one bad placement must not stop the loop
                    log.exception("placement of %s failed", req.req_id)
                    placed = False
                if not placed and self.policy.name != "tierserve":
                    break  # peers serve strictly in their order (head-of-line)

    def _alive(self, role: WorkerRole) -> list[WorkerState]:
        return [w for w in self.workers.values() if w.is_alive and w.info.role is role]

    def _load(self) -> LoadSnapshot:
        n = self.tiers.num_tiers
        backlog = [0.0] * n
        queued = [0] * n
        for lv in self.queue.values():
            backlog[lv.req.tier] += self.est.prefill_s(lv.req.prompt_len, 0)
            queued[lv.req.tier] += -(-(lv.req.prompt_len + 1) // self.block_size)
        prefill = self._alive(WorkerRole.PREFILL)
        decode = self._alive(WorkerRole.DECODE)
        held = [0] * n
        pairs = []
        for w in decode:
            for rid, blocks in w.running.items():
                lv = self.live.get(rid)
                if lv is not None:
                    held[lv.req.tier] += blocks
                    pairs.append((blocks, lv.req.max_new_tokens))
        has_room = any(w.num_free_blocks > 0 for w in decode)
        return LoadSnapshot(backlog, len(prefill), has_room and not self.queue, queued, held,
                            sum(w.num_free_blocks for w in decode),
                            kv_release_rate(pairs, self.est.decode_token_s()), self.block_size)

    async def _try_place(self, lv: _Live, now: float) -> bool:
        req = lv.req
        prefill = self._alive(WorkerRole.PREFILL)
        decode = self._alive(WorkerRole.DECODE)
        if not prefill or not decode:
            self._fail_queued(lv, "no live prefill or decode worker")
            return False
        matches = self.mirror.match_lens(req.block_hashes, [w.info.worker_id for w in prefill])
        pviews = [PrefillView(w.info, self.est.prefill_s(w.backlog_tokens, 0),
                              matches[w.info.worker_id]) for w in prefill]
        pv = self.policy.place_prefill(req, pviews)
        if pv is None:
            return False
        need = math.ceil((req.prompt_len + 1) / self.block_size)
        dviews = [DecodeView(w.info, w.num_free_blocks, len(w.running)) for w in decode]
        choice = self.policy.place_decode(req, need, dviews, pv.info)
        if choice is None:
            await self._maybe_preempt(req, need, decode, pv.info, now)
            return False
        dw = self.workers[choice.view.info.worker_id]
        try:
            ans = await self.client.reserve(dw.info.worker_id, {
                "req_id": req.req_id, "prompt_token_ids": lv.spec["prompt_token_ids"],
                "spec": lv.spec, "prefill_worker_id": pv.info.worker_id,
                "tier": req.tier})
        except WorkerGone:
            self.mark_dead(dw.info.worker_id)
            return False
        dw.num_free_blocks = int(ans.get("num_free_blocks", dw.num_free_blocks))
        if not ans.get("ok"):
            return False
        dw.running[req.req_id] = need
        req.prefill_worker_id = pv.info.worker_id
        req.decode_worker_id = dw.info.worker_id
        num_hit = int(ans.get("num_cached_blocks", 0))
        cls = topology_class(pv.info, dw.info)
        self.transfers_by_class[cls.value] += 1
        lv.move_class = cls
        hit = max(num_hit, pv.match_blocks)
        self.metrics.on_prefix_lookup(len(req.block_hashes), min(hit, len(req.block_hashes)))
        self._move(req.req_id, RequestState.PREFILLING, Decision.SCHEDULE_PREFILL,
                   f"placement:{pv.info.worker_id}->{dw.info.worker_id}",
                   kv_reuse_hit=hit, mem=self._pressure(dw))
        del self.queue[req.req_id]
        try:
            await self.client.start_prefill(pv.info.worker_id, {
                "spec": lv.spec, "ticket": ans["ticket"], "decode_worker_id": dw.info.worker_id})
        except WorkerGone:
            self.mark_dead(pv.info.worker_id)
            try:
                await self.client.abort(dw.info.worker_id, req.req_id)
            except WorkerGone:
                self.mark_dead(dw.info.worker_id)
        if not lv.placed.done():
            lv.placed.set_result({"kind": "placed", "decode_worker_id": dw.info.worker_id,
                                  "prefill_worker_id": pv.info.worker_id,
                                  "topology_class": cls.value})
        return True

    async def _maybe_preempt(self, req: Request, need: int, decode: list[WorkerState],
                             prefill: WorkerInfo, now: float) -> None:
        best = None
        for w in sorted(decode, key=lambda w: topology_class(prefill, w.info).value
                        != TopologyClass.SAME_DOMAIN.value):
            cands = [VictimView(self.live[rid].req, w.info, n) for rid, n in w.running.items()
                     if rid in self.live
                     and self.live[rid].req.state is RequestState.DECODING]
            plan = self.policy.preempt_for(req, need, w.num_free_blocks, cands, now)
            if plan is not None and plan.victims:
                best = (w, plan)
                break
        if best is None:
            return
        w, plan = best
        for v in plan.victims:
            mode = PreemptMode.RECOMPUTE if v.mode is PreemptMode.MIGRATE else v.mode
            try:
                ok = await self.client.preempt(w.info.worker_id, v.req_id, mode.value, req.req_id)
            except WorkerGone:
                self.mark_dead(w.info.worker_id)
                return
            if ok:
                vreq = self.live[v.req_id].req
                # Anti-thrash: the kernel reads last_preempt_time before the worker reports.
                vreq.last_preempt_time = now
                w.running.pop(v.req_id, None)

    def _fail_queued(self, lv: _Live, why: str) -> None:
        self.queue.pop(lv.req.req_id, None)
        if not lv.placed.done():
            lv.placed.set_result({"kind": "unavailable", "reason": why})
        self._move(lv.req.req_id, RequestState.ABORTED, Decision.ERROR, f"placement:{why}")
        self._close(lv.req.req_id)

    def _pressure(self, w: WorkerState) -> float:
        return 1.0 - w.num_free_blocks / max(w.num_total_blocks, 1)

    def _on_event(self, wid: str, ev: Mapping[str, Any]) -> None:
        rid = str(ev["req_id"])
        lv = self.live.get(rid)
        if lv is None:
            return
        kind = WorkerEvent(ev["event"])
        w = self.workers[wid]
        by = f"{w.info.role.value}:{wid}"
        mem = self._pressure(w)
        S, D = RequestState, Decision
        if kind is WorkerEvent.PREFILL_DONE:
            self._move(rid, S.TRANSFERRING, D.START_TRANSFER, by, mem=mem)
        elif kind is WorkerEvent.DECODE_START:
            self._move(rid, S.DECODING, D.START_DECODE, by, mem=mem)
        elif kind in (WorkerEvent.PREEMPTED_SWAP, WorkerEvent.PREEMPTED_RECOMPUTE):
            d = D.PREEMPT_SWAP if kind is WorkerEvent.PREEMPTED_SWAP else D.PREEMPT_RECOMPUTE
            key = f"{lv.req.tier}:{'swap' if d is D.PREEMPT_SWAP else 'recompute'}"
            self.preemptions[key] = self.preemptions.get(key, 0) + 1
            blocker = ev.get("for_req_id")
            by = f"{'preempt_for' if blocker else 'kv_pressure'}:{wid}"
            self._move(rid, S.PREEMPTING, d, by, mem=mem, blocking=blocker)
            self._move(rid, S.PREEMPTED, D.PREEMPT_DONE, by, mem=mem, blocking=blocker)
            if kind is WorkerEvent.PREEMPTED_RECOMPUTE:
                self._move(rid, S.QUEUED, D.RESUME_RECOMPUTE, by, mem=mem)
        elif kind is WorkerEvent.RESUMED_SWAP:
            self._move(rid, S.DECODING, D.RESUME_SWAP_IN, by, mem=mem)
        elif kind is WorkerEvent.RESUMED_RECOMPUTE:
            self._move(rid, S.PREFILLING, D.RESUME_RECOMPUTE, by, mem=mem)
            self._move(rid, S.DECODING, D.START_DECODE, by, mem=mem)
        elif kind is WorkerEvent.TRANSFER_FAILED:
            self._move(rid, S.ABORTED, D.TRANSFER_FAILED, by, mem=mem)
        elif kind is WorkerEvent.ABORTED:
            # A worker gave up on the request (its reader left, or the engine refused it):
            # the other worker still holds blocks for it, and no router abort may follow.
            d = D.CLIENT_GONE if ev.get("reason") == "reader_gone" else D.ERROR
            self._move(rid, S.ABORTED, d, by, mem=mem)
            task = asyncio.get_running_loop().create_task(self.abort(rid, d, by))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _move(self, rid: str, to: RequestState, decision: Decision, by: str, *,
              mem: float = 0.0, kv_reuse_hit: int = 0, blocking: str | None = None) -> None:
        lv = self.live.get(rid)
        if lv is None or lv.req.state is to or lv.req.state.is_finished:
            return
        try:
            rec = transition(lv.req, to, decision=decision, triggered_by=by, now=time.time(),
                             mem_pressure=mem, kv_reuse_hit=kv_reuse_hit, blocking_req_id=blocking)
        except IllegalTransition as e:
            log.debug("ignored late event: %s", e)
            return
        self.metrics.on_decision(rec, lv.req.tier)

    def _close(self, rid: str) -> None:
        lv = self.live.pop(rid, None)
        if lv is None:
            return
        self.queue.pop(rid, None)
        for w in self.workers.values():
            w.running.pop(rid, None)
        self._keep_log(lv.req, lv.transfers)

    def _keep_log(self, req: Request, transfers: list[TransferInfo]) -> None:
        rlog = RequestLog.from_request(req, transfers)
        self.logs[req.req_id] = rlog
        while len(self.logs) > MAX_LOGS:
            self.logs.popitem(last=False)
        if self.tracer is not None:
            try:
                self.tracer.record(rlog)
            except Exception:  # a broken exporter must not stop scheduling
                log.exception("tracing request %s failed", req.req_id)


_RUNNING = frozenset({RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING})
_PREEMPTED = frozenset({RequestState.PREEMPTING, RequestState.PREEMPTED})


def _last_preempt(req: Request) -> Decision | None:
    for rec in reversed(req.history):
        if rec.decision in (Decision.PREEMPT_SWAP, Decision.PREEMPT_RECOMPUTE,
                            Decision.PREEMPT_MIGRATE):
            return rec.decision
    return None
