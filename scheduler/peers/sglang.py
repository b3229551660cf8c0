"""SGLang's scheduler (``python/sglang/srt/managers/schedule_policy.py``, ``scheduler.py``,
``schedule_batch.py``) and its cache-aware router.

Reproduced from the source (sgl-project/sglang at 00550cd, read 2026-12):

1. ``--schedule-policy``: ``lpm`` sorts the waiting queue by the longest prefix match in
   the worker's radix cache, falling back to arrival order when more than 128 requests
   wait (``_determine_active_policy``); ``fcfs`` with ``--enable-priority-scheduling``
   sorts it by (priority, arrival) (``_sort_by_priority_and_fcfs``). Here a request's
   priority is ``tier x priority_step`` with low values first
   (``--schedule-low-priority-values-first``).
2. Chunked prefill: a step's prefill batch holds at most ``--chunked-prefill-size``
   tokens; the one request cut short continues first in the next step (``chunked_req``),
   then waiting requests in policy order (``PrefillAdder``). 8,192 is the default on
   H200-class GPUs (``ServerArgs._handle_gpu_memory_settings``).
3. Priority preemption (``PrefillAdder.preempt_to_schedule``): a waiting request that
   finds no room preempts running requests whose priority is worse by more than
   ``--priority-scheduling-preemption-threshold`` (default 10), lowest priority first and
   the latest of them first, only if together they free what it needs (else none).
4. Decode KV runs out (``retract_decode``): the running requests with the fewest output
   tokens go first (ties: the longest prompt), until the rest fit; they are recomputed.
5. Routing (sgl-router ``cache_aware``): the worker with the longest prefix match, unless
   the load is imbalanced, then the least loaded.

Here prefill and decode are separate pools (PD disaggregation); the preemption of 3 is
what a dispatch that finds no decode memory asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.peers.common import recompute_in_order
from scheduler.peers.vllm import budget_step
from scheduler.placement import PrefillView
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptionPlan, VictimView
from scheduler.queues import HeapQueue, WaitQueue
from scheduler.request import Request
from scheduler.step_planner import StepPlan, StepView, is_started


@dataclass(frozen=True, slots=True)
class SglangSettings:
    """The scheduler flags an SGLang user tunes (``python -m sglang.launch_server --help``)."""

    # Tokens per prefill step; 0: the worker's engine budget (the simulator's H200 workers
    # have 8,192, SGLang's default on 90-160 GB GPUs such as the H200).
    chunked_prefill_size: int = 0
    # Priority value per tier step (tier t has priority t x priority_step; low first).
    priority_step: int = 10
    # A running request is preemptible when its priority is worse by more than this.
    priority_scheduling_preemption_threshold: int = 10

    def __post_init__(self) -> None:
        if self.chunked_prefill_size < 0:
            raise ValueError("chunked_prefill_size must be >= 0")
        if self.priority_step < 0 or self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("priority_step and the preemption threshold must be >= 0")


class _SglangPolicy(SchedulingPolicy):
    """What both schedule policies share: the router, the chunked-prefill step, priority
    preemption for an arrival and decode retraction (see the module docstring)."""

    respects_anti_thrash = False
    settings_cls = SglangSettings
    BALANCE_ABS_S = 2.0  # load imbalance (s of queued prefill) that disables cache routing

    def __init__(self, ctx: PolicyContext, settings: SglangSettings | None = None) -> None:
        super().__init__(ctx)
        self.settings = settings or SglangSettings()
        self.match_len: dict[str, int] = {}

    def priority(self, req: Request) -> int:
        return req.tier * self.settings.priority_step

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

    def compose_step(self, view: StepView) -> StepPlan:
        return budget_step(view, self, self.settings.chunked_prefill_size, 0)

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return recompute_in_order(
            sorted(candidates, key=lambda v: (v.req.num_output_tokens, -v.req.prompt_len)),
            need_blocks)

    def preempt_for(self, req: Request, need_blocks: int, free_blocks: int,
                    candidates: Sequence[VictimView], now: float,
                    wait_s: float | None = None) -> PreemptionPlan | None:
        gap = self.settings.priority_scheduling_preemption_threshold
        mine = self.priority(req)
        ok = [v for v in candidates if self.priority(v.req) - mine > gap]
        plan = recompute_in_order(
            sorted(ok, key=lambda v: (-self.priority(v.req), -v.req.arrival_time)),
            need_blocks - free_blocks)
        return plan if plan.victims and plan.covers(need_blocks - free_blocks) else None


class SglangLpmPolicy(_SglangPolicy):
    """SGLang, ``--schedule-policy lpm`` with the radix cache and
    ``--enable-priority-scheduling`` (preemption only; LPM does not sort by priority)."""

    name = "sglang-lpm"
    LPM_FALLBACK = 128

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        if len(reqs) > self.LPM_FALLBACK:
            return sorted(reqs, key=lambda r: r.arrival_time)
        return sorted(reqs, key=lambda r: (-self.match_len.get(r.req_id, 0), r.arrival_time))

    def make_queue(self) -> WaitQueue:
        return HeapQueue(key=lambda r: (not is_started(r), -self.match_len.get(r.req_id, 0),
                                        r.arrival_time),
                         long_key=lambda r: (not is_started(r), r.arrival_time),
                         long_threshold=self.LPM_FALLBACK)


class SglangFcfsPolicy(_SglangPolicy):
    """SGLang, ``--schedule-policy fcfs --enable-priority-scheduling``: the waiting queue
    by (priority, arrival), the started chunk first."""

    name = "sglang-fcfs"

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        return sorted(reqs, key=lambda r: (self.priority(r), r.arrival_time))

    def make_queue(self) -> WaitQueue:
        return HeapQueue(key=lambda r: (not is_started(r), self.priority(r), r.arrival_time))


__all__ = ["SglangFcfsPolicy", "SglangLpmPolicy", "SglangSettings"]
