"""Peer policies: public schedulers reproduced in the same decision interface.

Each class reproduces the documented behaviour of one open-source scheduler so
the simulator can compare them with :class:`scheduler.policy.TierservePolicy`
on the same cluster, cost model and trace. All run disaggregated (prefill and
decode pools) like tierserve, with a prefix cache on every prefill worker; only
the decisions differ. None of them rejects at admission.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.placement import DecodeChoice, DecodeView, PrefillView, choose_decode
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptionPlan, PreemptMode, Victim, VictimView
from scheduler.queues import HeapQueue, WaitQueue
from scheduler.request import Request
from scheduler.step_planner import is_started
from scheduler.topology import WorkerInfo


def _recompute(victims: Sequence[VictimView], need_blocks: int) -> PreemptionPlan:
    chosen: list[Victim] = []
    freed = 0
    for v in victims:
        if freed >= need_blocks:
            break
        chosen.append(Victim(v.req.req_id, PreemptMode.RECOMPUTE, v.num_blocks, 0.0))
        freed += v.num_blocks
    return PreemptionPlan(tuple(chosen), freed)


class VllmFcfsPolicy(SchedulingPolicy):
    """vLLM, ``--scheduling-policy fcfs`` (the default).

    Reproduces: waiting requests are served strictly in arrival order; when the
    KV cache runs out of free blocks for a running request, the scheduler
    preempts the most recently arrived running request (the tail of the running
    queue) in RECOMPUTE mode, dropping its blocks to re-prefill it later (vLLM v1
    ``Scheduler.schedule``; docs "Preemption": "the default preemption mode is
    RECOMPUTE"). Prefix caching (APC) is on; routing between workers is
    load-based, with no prefix awareness, as with vLLM's round-robin/least-load
    P/D proxies. A waiting request never preempts a running one.
    """

    name = "vllm-fcfs"
    respects_anti_thrash = False

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return _recompute(sorted(candidates, key=lambda v: -v.req.arrival_time), need_blocks)


class VllmPriorityPolicy(VllmFcfsPolicy):
    """vLLM, ``--scheduling-policy priority`` (vllm-project/vllm PR #5958, v1 scheduler).

    Reproduces: waiting and running queues are ordered by (priority, arrival
    time), lower value first (here priority = tier); under KV pressure the
    lowest-priority running request (largest (priority, arrival)) is preempted by
    recompute; a waiting request of higher priority than a running one forces
    that running request out so it can start (PR #5958, "force preemption").
    """

    name = "vllm-priority"

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        return sorted(reqs, key=lambda r: (r.tier, r.arrival_time))

    def make_queue(self) -> WaitQueue:
        return HeapQueue(key=lambda r: (not is_started(r), r.tier, r.arrival_time))

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return _recompute(sorted(candidates, key=lambda v: (-v.req.tier, -v.req.arrival_time)),
                          need_blocks)

    def preempt_for(self, req: Request, need_blocks: int, free_blocks: int,
                    candidates: Sequence[VictimView], now: float) -> PreemptionPlan | None:
        lower = sorted((v for v in candidates if v.req.tier > req.tier),
                       key=lambda v: (-v.req.tier, -v.req.arrival_time))
        plan = _recompute(lower, need_blocks - free_blocks)
        return plan if plan.victims and plan.covers(need_blocks - free_blocks) else None


class SglangLpmPolicy(SchedulingPolicy):
    """SGLang, ``--schedule-policy lpm`` with the radix cache and priority scheduling.

    Reproduces: the waiting queue is sorted by longest prefix match against the
    worker's radix cache (LRU eviction), falling back to FCFS when more than 128
    requests wait (SGLang ``schedule_policy.py``, the LPM fallback threshold);
    with ``--enable-priority-scheduling``, a waiting request preempts a running
    one only when their priority gap is at least
    ``--priority-scheduling-preemption-threshold`` (default 10; here tiers are
    mapped to priorities 10 apart per tier step scaled by ``priority_step``, so a
    gap of two tiers or more preempts). Preempted requests are retracted and
    recomputed. Routing follows the SGLang router's cache-aware policy: the
    worker with the longest prefix match unless load is imbalanced, then the
    least loaded.
    """

    name = "sglang-lpm"
    respects_anti_thrash = False
    LPM_FALLBACK = 128
    PREEMPT_GAP = 10
    PRIORITY_STEP = 5
    BALANCE_ABS_S = 2.0  # load imbalance (s of queued prefill) that disables cache routing

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.match_len: dict[str, int] = {}

    def place_prefill(self, req: Request, views: Sequence[PrefillView]) -> PrefillView | None:
        if not views:
            return None
        loads = [v.backlog_s for v in views]
        if max(loads) - min(loads) > self.BALANCE_ABS_S:
            best = min(views, key=lambda v: v.backlog_s)
        else:
            best = max(views, key=lambda v: (v.match_blocks, -v.backlog_s))
        self.match_len[req.req_id] = best.match_blocks
        return best

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        if len(reqs) > self.LPM_FALLBACK:
            return sorted(reqs, key=lambda r: r.arrival_time)
        return sorted(reqs, key=lambda r: (-self.match_len.get(r.req_id, 0), r.arrival_time))

    def make_queue(self) -> WaitQueue:
        return HeapQueue(key=lambda r: (not is_started(r), -self.match_len.get(r.req_id, 0),
                                        r.arrival_time),
                         long_key=lambda r: (not is_started(r), r.arrival_time),
                         long_threshold=self.LPM_FALLBACK)

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        # SGLang retracts the decode requests with the fewest output tokens first
        # (the longest remaining work), recomputed later.
        return _recompute(sorted(candidates, key=lambda v: (v.req.num_output_tokens,
                                                            -v.req.prompt_len)), need_blocks)

    def preempt_for(self, req: Request, need_blocks: int, free_blocks: int,
                    candidates: Sequence[VictimView], now: float) -> PreemptionPlan | None:
        gap_ok = [v for v in candidates
                  if (v.req.tier - req.tier) * self.PRIORITY_STEP >= self.PREEMPT_GAP]
        plan = _recompute(sorted(gap_ok, key=lambda v: (-v.req.tier, -v.req.arrival_time)),
                          need_blocks - free_blocks)
        return plan if plan.victims and plan.covers(need_blocks - free_blocks) else None


class DynamoPriorityPolicy(SchedulingPolicy):
    """NVIDIA Dynamo: KV-aware router with a router-side priority queue.

    Reproduces: the KV router picks the worker minimising
    ``overlap_weight x prefill_blocks + decode_blocks`` (blocks still to prefill
    after the worker's cached overlap, plus its active decode load; Dynamo docs,
    "KV Router: cost function", ``--kv-overlap-score-weight`` default 1), and
    holds requests in a router queue ordered by priority then arrival when
    workers are busy. Workers run without cross-request preemption; when a
    decode worker runs out of blocks, the engine's own recompute of its newest
    request applies (Dynamo delegates that to the backend engine).
    """

    name = "dynamo-priority"
    respects_anti_thrash = False
    OVERLAP_WEIGHT = 1.0

    def place_prefill(self, req: Request, views: Sequence[PrefillView]) -> PrefillView | None:
        bs = self.ctx.block_size
        need = -(-req.prompt_len // bs)
        # Queued work is in seconds; turn it into blocks with the prefill rate.
        per_block = max(self.ctx.est.prefill_s(bs, 0), 1e-9)
        return min(views, key=lambda v: self.OVERLAP_WEIGHT * (need - v.match_blocks)
                   + v.backlog_s / per_block, default=None)

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        return sorted(reqs, key=lambda r: (r.tier, r.arrival_time))

    def make_queue(self) -> WaitQueue:
        return HeapQueue(key=lambda r: (not is_started(r), r.tier, r.arrival_time))

    def place_decode(self, req: Request, need_blocks: int, views: Sequence[DecodeView],
                     prefill: WorkerInfo) -> DecodeChoice | None:
        fits = [v for v in views if v.num_free_blocks >= need_blocks]
        if not fits:
            return None
        best = max(fits, key=lambda v: v.num_free_blocks)
        return choose_decode(need_blocks, [best], prefill, self.ctx.costs, min_headroom=0.0)

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return _recompute(sorted(candidates, key=lambda v: -v.req.arrival_time), need_blocks)
