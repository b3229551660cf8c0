"""Simulated workers: the mechanism under the worker cores the live workers run.

A simulated worker holds what a live worker holds: a worker core
(:class:`~scheduler.worker_core.DecodeCore` or :class:`~scheduler.prefill_core.PrefillCore`,
the very objects the live decode and prefill workers drive) with its
:class:`~scheduler.step_planner.WorkerScheduler` (its own policy instance and its own
:class:`~scheduler.step_costs.StepCosts`). Every decision about a request (its stage,
the events it reports, what a preempt order comes to, who finishes) is the core's; this
module is the mechanism the live worker's engine, KV plane and clock are: a KV block
account, on a prefill worker a prefix cache over the trace's prefix ids, and the cost
model for each step's time (its StepCosts learn from those times, as a live worker's
learn from wall time). It says what happened in a :class:`~scheduler.messages.WorkerReport`,
the message a live worker sends. Its ``Request`` objects are its own copies, built from
what the wire carries; where the model emits EOS (the trace's output length) is the
mechanism's, never the kernel's.

The mechanism's part of a request's life: on a prefill worker, its cached prefix is
pinned in the prefix cache when it starts (what that evicts goes out as BlockRemoved),
the first chunk allocates all its blocks (the engine's rule; a host-tier prefix hit is
copied in first), and the blocks stay until the transfer to the decode worker ends
(``release_kv``). On a decode worker, the dispatch allocates the blocks (or is refused),
a decode whose next token starts a block gets one, victims' blocks are released and
swapped requests' allocated again; EOS or ``max_tokens`` ends a request (the core's
FINISHED_STOP / FINISHED_LENGTH). Blocks a PreemptOrder freed are held for the request
it names (the core's ``hold_for``, as a live decode worker does).

A decode-only step the planner would repeat unchanged (every decode runs, nothing else
waits, no block runs short, nobody finishes) runs as up to ``K_MAX`` steps at once,
committed one by one; anything that reaches the worker cuts them at the next step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

from scheduler.cluster_scheduler import PreemptOrder
from scheduler.kv import KVBlockAccount
from scheduler.messages import (
    BlockEvent,
    Prefilled,
    ReqEvent,
    RunningReq,
    WorkerReport,
)
from scheduler.preemption import PreemptMode
from scheduler.prefill_core import PrefillCore, PrefillOutput
from scheduler.prefix_index import PrefixIndex
from scheduler.request import Request
from scheduler.sim.costmodel import CostModel
from scheduler.step_planner import LocalRequest, StepPlan, WorkerScheduler
from scheduler.topology import TopologyClass, WorkerInfo
from scheduler.worker_core import DecodeCore, KVVerdict, Release, StepResult, eviction_order

K_MAX = 16


@dataclass(slots=True)
class Held:
    """What the mechanism keeps for one request on one worker, beside the planner's view."""

    req: Request  # this worker's copy (PREFILLING when it arrives, as a live worker's)
    # Where generation ends: the model's EOS, or the max_tokens budget (``is_length``).
    num_output_target: int
    is_length: bool
    # Prefill worker: where the KV goes, and the prefix ids it pinned in the cache.
    decode_worker_id: str | None = None
    move_class: TopologyClass = TopologyClass.SAME_DEVICE
    cache_ids: tuple[int, ...] = ()
    num_hit_ids: int = 0
    num_load_blocks: int = 0  # host-tier prefix blocks to copy in before its first chunk


@dataclass(slots=True)
class _Step:
    """The step (or run of identical decode-only steps) a worker is executing."""

    plan: StepPlan
    ends: list[float]  # when each of its steps ends
    seconds: list[float]  # each step's compute time (what the StepCosts observe)
    blocks: dict[str, int]  # requests' blocks once the step ran
    refused: list[str]


class SimWorker:
    """Plans, runs and commits steps, and reports; the roles below add what they do."""

    def __init__(self, info: WorkerInfo, ws: WorkerScheduler, cost: CostModel, *,
                 decodes_here: bool) -> None:
        self.info = info
        self.ws = ws
        self.cost = cost
        self.bs = cost.block_size
        self.account = KVBlockAccount(info.worker_id, info.num_kv_blocks)
        self.decodes_here = decodes_here
        self.held: dict[str, Held] = {}
        self.events: list[ReqEvent] = []
        self.block_events: list[BlockEvent] = []
        self.dirty: dict[str, None] = {}  # requests whose running figures changed
        self.step: _Step | None = None
        self.last_plan_time = 0.0
        self.last_plan = StepPlan()  # the plan of the step finished last
        self.version = 0  # a step's end event carries it; a cut step gets a new one
        self.num_mechanism_refusals = 0  # planned allocations that failed (a planner bug)
        self.refused_orders: list[str] = []  # PreemptOrders whose victim was not decoding
        # The control interval's periodic report (running figures, free blocks, fitted
        # step costs) is due, as a live worker sends one every interval; and whether it
        # lists every request held (the first report does).
        self.report_due = False
        self.complete_due = True

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def is_busy(self) -> bool:
        return self.step is not None

    @property
    def has_work(self) -> bool:
        """Anything for a step to do (an idle worker without it plans nothing)."""
        return self.ws.has_work()

    @property
    def has_news(self) -> bool:
        """A report is due: events to tell (a live worker reports after a step that had
        some), or the periodic report of every control interval (``report_due``)."""
        return bool(self.events or self.block_events or self.report_due)

    def report(self) -> WorkerReport:
        """Everything the worker holds when a complete report is due (``complete_due``:
        the cluster scheduler drops from its view what such a report leaves out), else
        only the requests whose figures changed since the last report (``dirty``): the
        simulated worker knows exactly what changed, so the cluster's view is the same
        either way, and a report does not walk thousands of queued prompts."""
        running = []
        local = self.ws.local
        held = self.held
        complete = self.complete_due
        for ev in self.events:
            self.dirty[ev.req_id] = None
        ids = (dict.fromkeys([*held, *local]) if complete
               else [rid for rid in self.dirty if rid in held or rid in local])
        for rid in ids:
            lr = local.get(rid)
            if lr is None:
                h = self.held.get(rid)
                running.append(RunningReq(rid, self.account.blocks_of(rid),
                                          h.req.num_output_tokens if h is not None else 0, 0))
                continue
            running.append(RunningReq(rid, self.account.blocks_of(rid),
                                      lr.req.num_output_tokens, lr.num_prefill_left))
        rep = WorkerReport(self.worker_id, self.account.num_free, self.account.num_total_blocks,
                           tuple(self.events), tuple(self.block_events), (), tuple(running),
                           self.ws.costs.to_tuple(), self.ws.num_steps, is_complete=complete)
        self.events.clear()
        self.block_events = []
        self.dirty = {}
        self.report_due = False
        self.complete_due = False
        return rep

    # -- steps -----------------------------------------------------------------------

    def begin_step(self, now: float) -> float | None:
        """Plan the next step and start it; returns when it ends (None: nothing to run)."""
        self._before_plan(now)
        self.last_plan_time = now
        plan = self.ws.plan(now, self._plannable_free(now))
        if plan.is_empty:
            return None
        delay = 0.0
        for v in plan.preempt:
            self.preempt(v.req_id, v.mode, None, now)
        blocks: dict[str, int] = {}
        local = self.ws.local
        decodes = [local[rid] for rid in plan.decodes]
        kept = self._grow(decodes, 1, blocks)
        if len(kept) < len(decodes):
            plan = replace(plan, decodes=tuple(d.req_id for d in kept))
            decodes = kept
        for rid in plan.swap_in:
            delay += self._swap_in(rid, now)
        refused: list[str] = []
        flops = 0.0
        for rid, n in plan.chunks:
            lr = local[rid]
            if lr.num_blocks == 0:
                need = lr.blocks_for(lr.num_computed + lr.num_prefill_left + 1, self.bs)
                if not self.account.allocate(rid, need):
                    self.num_mechanism_refusals += 1
                    refused.append(rid)
                    continue
                blocks[rid] = need
            h = self.held[rid]
            if h.num_load_blocks:
                delay += self.cost.links.swap_s(h.num_load_blocks)
                h.num_load_blocks = 0
            flops += self.cost.prefill_flops(n, lr.num_computed)
        k = self._repeat(plan, decodes)
        if k > 1:
            self._grow(decodes, k, blocks)
        ctx = sum(d.num_computed + 1 for d in decodes)
        n_dec = len(decodes)
        runs = flops > 0 or n_dec > 0
        t = now + delay
        ends, seconds = [], []
        for j in range(k):
            s = self.cost.step_s(flops, n_dec, ctx + j * n_dec) if runs else 0.0
            t += s
            ends.append(t)
            seconds.append(s)
        self.version += 1
        self.step = _Step(plan, ends, seconds, blocks, refused)
        return ends[-1]

    def _before_plan(self, now: float) -> None:
        """Work that reached the worker while a step ran (decode workers: preempt orders)."""

    def _plannable_free(self, now: float) -> int:
        """Free blocks the worker's own planner may use."""
        return self.account.num_free

    def _grow(self, decodes: list[LocalRequest], k: int, blocks: dict[str, int]
              ) -> list[LocalRequest]:
        """Blocks for ``k`` more tokens of each decode; returns the decodes that got them."""
        kept = []
        for d in decodes:
            have = blocks.get(d.req_id, d.num_blocks)
            extra = -(-(d.num_computed + k) // self.bs) - have
            if extra > 0:
                if not self.account.allocate(d.req_id, extra):
                    self.num_mechanism_refusals += 1
                    continue
                blocks[d.req_id] = have + extra
            kept.append(d)
        return kept

    def _repeat(self, plan: StepPlan, decodes: list[LocalRequest]) -> int:
        """How many identical steps this decode-only plan stands for (see the module)."""
        ws = self.ws
        if (plan.chunks or plan.preempt or plan.swap_in or not decodes or len(ws.queue)
                or ws.swapped or len(decodes) != len(ws.decoding) or self._has_orders()):
            return 1
        held = self.held
        k = min(K_MAX, min(held[d.req_id].num_output_target - d.req.num_output_tokens
                           for d in decodes))
        free = self._plannable_free(self.last_plan_time) - self.ws.num_held(self.last_plan_time)
        bs = self.bs
        while k > 1 and sum(max(0, -(-(d.num_computed + k) // bs) - d.num_blocks)
                            for d in decodes) > free:
            k -= 1
        return max(k, 1)

    def _has_orders(self) -> bool:
        return False

    def cut(self, now: float) -> float | None:
        """Something reached the worker: a run of steps ends after the one running at
        ``now``. Returns the new end (None: unchanged)."""
        st = self.step
        if st is None or len(st.ends) == 1:
            return None
        j = bisect.bisect_left(st.ends, now)
        if j >= len(st.ends) - 1:
            return None
        del st.ends[j + 1:]
        del st.seconds[j + 1:]
        self.version += 1
        return st.ends[-1]

    def finish_step(self, now: float) -> list[str]:
        """Commit the step that ended; returns the requests whose prefill ended in it."""
        st = self.step
        assert st is not None
        self.step = None
        done: list[str] = []
        plan = self.last_plan = st.plan
        for j, (end, sec) in enumerate(zip(st.ends, st.seconds, strict=True)):
            done += self.ws.commit(plan, end, seconds=sec if sec > 0 else None,
                                   refused=st.refused if j == 0 else (),
                                   blocks=st.blocks if j == 0 else None,
                                   decodes_here=self.decodes_here)
        for rid, _ in plan.chunks:
            self.dirty[rid] = None
        for rid in plan.decodes:
            self.dirty[rid] = None
        return done

    # -- requests --------------------------------------------------------------------

    def preempt(self, req_id: str, mode: PreemptMode, for_req_id: str | None,
                now: float) -> None:
        raise TypeError(f"{type(self).__name__} runs no decodes to preempt")

    def _swap_in(self, req_id: str, now: float) -> float:
        raise TypeError(f"{type(self).__name__} holds no swapped requests")

    def drop(self, req_id: str, now: float) -> None:
        """The cluster ended the request (AbortOrder): forget it, free its blocks."""
        self.ws.remove(req_id)
        self.account.release(req_id)
        self.held.pop(req_id, None)


class PrefillWorker(SimWorker):
    """A prefill-pool worker with a prefix cache over the trace's prefix ids. Its requests'
    lives are decided by the :class:`~scheduler.prefill_core.PrefillCore` a live prefill
    worker runs; this class is the mechanism (the prefix cache, the block account)."""

    def __init__(self, info: WorkerInfo, ws: WorkerScheduler, cost: CostModel,
                 cache_capacity: int | None, hash_block_tokens: int, host_tier: bool) -> None:
        super().__init__(info, ws, cost, decodes_here=False)
        self.core = PrefillCore(info.worker_id, ws)
        self.events = self.core.events  # the core says what happened
        self.hash_block_tokens = hash_block_tokens
        self.per_id = max(1, hash_block_tokens // self.bs)  # KV blocks per prefix id
        self.index: PrefixIndex | None = (
            None if cache_capacity is None else _ReportingIndex(cache_capacity, self._evicted))
        self.host_tier = host_tier
        self.accesses: list[tuple[int, ...]] = []  # prefix ids looked up, for Belady
        self._protected: dict[int, int] = {}  # prefix id -> waiting requests it prefixes

    def _evicted(self, ids: list[int]) -> None:
        per = self.per_id
        self.block_events.append(BlockEvent(False, tuple(
            h * per + i for h in ids for i in range(per))))

    def _protect(self, req: Request, sign: int) -> None:
        per = self.per_id
        for h in dict.fromkeys(b // per for b in self.ws.policy.protected_hashes([req])):
            n = self._protected.get(h, 0) + sign
            if n > 0:
                self._protected[h] = n
            else:
                self._protected.pop(h, None)

    def start_prefill(self, held: Held, cache_ids: tuple[int, ...], now: float) -> None:
        req = held.req
        hits = 0
        if self.index is not None and cache_ids:
            got = self.index.acquire(cache_ids, self._protected)
            if got is not None:
                hits = got
                held.cache_ids = cache_ids
                held.num_hit_ids = hits
                self.accesses.append(cache_ids)
        cached = min(hits * self.hash_block_tokens, max(req.prompt_len - 1, 0))
        if cached and self.host_tier:
            held.num_load_blocks = -(-cached // self.bs)
        self.held[req.req_id] = held
        self._protect(req, +1)
        self.core.start(None, req, held.decode_worker_id or "", now, num_cached_tokens=cached)
        self.dirty[req.req_id] = None

    def finish_step(self, now: float) -> list[str]:
        done = super().finish_step(now)
        self.core.outputs([PrefillOutput(rid, prefill_done=True) for rid in done], now)
        for rid in done:
            self._unpin(self.held[rid], stored=True)
        return done

    def _unpin(self, h: Held, *, stored: bool) -> None:
        self._protect(h.req, -1)
        if not h.cache_ids:
            return
        assert self.index is not None
        self.index.release(h.cache_ids)
        if stored:
            first = h.num_hit_ids * self.per_id
            new = h.req.block_hashes[first:]
            if new:
                parent = h.req.block_hashes[first - 1] if first else None
                self.block_events.append(BlockEvent(True, new, parent))
        h.cache_ids = ()

    def release_kv(self, req_id: str) -> None:
        """The transfer ended: the request's KV blocks here are free."""
        self.core.end(req_id, "sent", 0.0)
        self.account.release(req_id)
        self.held.pop(req_id, None)

    def drop(self, req_id: str, now: float) -> None:
        h = self.held.get(req_id)
        if h is not None and req_id in self.ws.local:
            self._unpin(h, stored=False)
        self.core.end(req_id, "abort", now)
        super().drop(req_id, now)


class _ReportingIndex(PrefixIndex):
    """The prefix cache; what it evicts is reported (BlockRemoved) as a block pool does."""

    def __init__(self, capacity: int, on_evict: Callable[[list[int]], None]) -> None:
        super().__init__(capacity)
        self._on_evict = on_evict

    def evict(self, num_blocks: int, protected: Collection[int] = ()) -> list[int]:
        out = super().evict(num_blocks, protected)
        if out:
            self._on_evict(out)
        return out


class DecodeWorker(SimWorker):
    """A decode-pool worker (in ``aggregated``/``auto`` mode it also prefills). Its
    requests' lives are decided by the :class:`~scheduler.worker_core.DecodeCore` a live
    decode worker runs; this class is the mechanism (a block account for the engine's
    pool, the cost model for its clock, the trace's output length for the model's EOS)."""

    def __init__(self, info: WorkerInfo, ws: WorkerScheduler, cost: CostModel) -> None:
        super().__init__(info, ws, cost, decodes_here=True)
        self.core = DecodeCore(info.worker_id, ws)
        self.events = self.core.events  # the core says what happened
        self.orders: list[PreemptOrder] = []

    def reserve(self, held: Held, num_blocks: int, source: str | None, now: float) -> bool:
        """The dispatch: its blocks, for KV from ``source`` (None: prefilled here)."""
        rid = held.req.req_id
        if not self.account.allocate(rid, num_blocks):
            return False
        self.ws.release_hold(rid)
        self.held[rid] = held
        if source is None:
            self.core.prefill_here(held.req, num_blocks, 0, now)
        else:
            self.core.receive(held.req, (), source, now, num_blocks=num_blocks)
        self.dirty[rid] = None
        return True

    def prefilled(self, req_id: str, now: float) -> bool:
        """The first token came from the prefill worker; True when that ended the request
        here (it was also the last, or the request is gone): no KV to send."""
        h = self.held.get(req_id)
        if h is None:
            return True
        last = h.num_output_target <= 1
        self.core.first_token(Prefilled(req_id, 0, ("length" if h.is_length else "stop")
                                        if last else None, now), now)
        if self.core.kv_progress(req_id, None, now) is KVVerdict.ENDED:
            self.core.drained(req_id, now)
            self._release(req_id)
            return True
        return False

    def kv_arrived(self, req_id: str, now: float) -> None:
        if self.core.kv_progress(req_id, True, now) is KVVerdict.JOIN:
            self.core.joined(req_id, now)

    def order(self, p: PreemptOrder) -> None:
        self.orders.append(p)

    @property
    def has_work(self) -> bool:
        return bool(self.orders) or self.ws.has_work()

    def _has_orders(self) -> bool:
        return bool(self.orders)

    def _before_plan(self, now: float) -> None:
        orders, self.orders = self.orders, []
        for p in orders:
            self.preempt(p.req_id, p.mode, p.for_req_id, now)

    def finish_step(self, now: float) -> list[str]:
        done = super().finish_step(now)
        held = self.held
        results = []
        for rid in [*self.last_plan.decodes, *done]:
            h = held.get(rid)
            ended = h is not None and h.req.num_output_tokens >= h.num_output_target
            results.append(StepResult(rid, finish=("length" if h.is_length else "stop")
                                      if ended and h is not None else None,
                                      request_finished=ended))
        for rid in self.core.outputs(results, set(done), now):
            self._release(rid)
        return done

    def _release(self, req_id: str) -> None:
        self.held.pop(req_id, None)
        self.account.release(req_id)
        self.dirty[req_id] = None

    def preempt(self, req_id: str, mode: PreemptMode, for_req_id: str | None,
                now: float) -> None:
        # The simulator moves no KV between workers: a migration is a recompute here.
        mode = mode if mode is PreemptMode.SWAP else PreemptMode.RECOMPUTE
        v = self.core.preempt_order(req_id, mode, None)
        if v.ok is not None:
            if not v.ok and for_req_id is not None:
                self.refused_orders.append(req_id)  # the cluster hears: its need stands
            return  # not decoding here any more (finished, preempted, never arrived)
        lr = self.ws.local[req_id]
        before = self.account.num_free
        self.account.release(req_id)
        self.core.evicted(req_id, eviction_order(mode, False)[0], for_req_id, now,
                          num_blocks=lr.num_blocks, num_freed=self.account.num_free - before)
        self.dirty[req_id] = None

    def drop(self, req_id: str, now: float) -> None:
        if self.core.abort(req_id, now) is Release.END_TRANSFER:
            self.core.drained(req_id, now)  # no transfer runs into a simulated reservation
        super().drop(req_id, now)

    def _swap_in(self, req_id: str, now: float) -> float:
        n = self.ws.swapped[req_id].num_blocks
        if not self.account.allocate(req_id, n):
            self.num_mechanism_refusals += 1
            return 0.0
        seconds = self.cost.links.swap_s(n)
        self.core.swapped_in(req_id, n, seconds, now)
        self.dirty[req_id] = None
        return seconds
