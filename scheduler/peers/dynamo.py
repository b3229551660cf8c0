"""NVIDIA Dynamo: the KV-aware router in front of vLLM workers (docs.nvidia.com/dynamo,
"Router": routing concepts, configuration and tuning, priority scheduling).

Reproduced:

1. Worker choice: the KV router minimises ``overlap_weight x prefill blocks + decode
   blocks`` (the prompt's blocks not already cached on the worker, plus its active decode
   load; ``--router-kv-overlap-score-weight``, default 1); here a worker's queued prefill
   work stands for its active load, turned into blocks at the prefill rate.
2. Router queue (``--router-queue-threshold``): while every worker's queued prefill
   tokens exceed this fraction of ``max_num_batched_tokens``, new requests wait in the
   router's queue, released by priority then arrival (the default ``fcfs`` queue policy
   applies ``priority``); 0 here means no router queue (dispatch at once). The check is
   made against the worker the router picks (the least loaded, unless a prefix hit
   outweighs its load).
3. The engines are vLLM with ``--scheduling-policy priority``: their step is vLLM v1's
   (:mod:`scheduler.peers.vllm`: ``max_num_batched_tokens``,
   ``long_prefill_token_threshold``, running requests first, no preemption for a
   waiting request; KV pressure recomputes the running request with the largest
   (priority, arrival) first).
4. Decode worker: the one with the most free blocks among those that fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.peers.common import recompute_in_order
from scheduler.peers.vllm import budget_step
from scheduler.placement import DecodeChoice, DecodeView, PrefillView, choose_decode
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptionPlan, VictimView
from scheduler.queues import HeapQueue, WaitQueue
from scheduler.request import Request
from scheduler.step_planner import StepPlan, StepView, is_started
from scheduler.topology import WorkerInfo


@dataclass(frozen=True, slots=True)
class DynamoSettings:
    """The router's flags and its vLLM engines' step flags."""

    # The vLLM engines' step flags (scheduler.peers.vllm.VllmSettings; 0: the worker's).
    max_num_batched_tokens: int = 0
    long_prefill_token_threshold: int = 0
    # Router queue: hold requests while every worker's queued prefill tokens exceed this
    # fraction of max_num_batched_tokens (0: no router queue).
    router_queue_threshold: float = 0.0
    kv_overlap_score_weight: float = 1.0

    def __post_init__(self) -> None:
        if min(self.max_num_batched_tokens, self.long_prefill_token_threshold,
               self.router_queue_threshold, self.kv_overlap_score_weight) < 0:
            raise ValueError("settings must be >= 0")


class DynamoPriorityPolicy(SchedulingPolicy):
    """Dynamo's KV router with its priority router queue, over vLLM priority engines (see
    the module docstring)."""

    name = "dynamo-priority"
    respects_anti_thrash = False
    settings_cls = DynamoSettings

    def __init__(self, ctx: PolicyContext, settings: DynamoSettings | None = None) -> None:
        super().__init__(ctx)
        self.settings = settings or DynamoSettings()

    def place_prefill(self, req: Request, views: Sequence[PrefillView]) -> PrefillView | None:
        bs = self.ctx.block_size
        need = -(-req.prompt_len // bs)
        # Queued work is in seconds; turn it into blocks with the prefill rate.
        per_block = max(self.ctx.est.prefill_s(bs, 0), 1e-9)
        w = self.settings.kv_overlap_score_weight
        return min(views, key=lambda v: w * (need - v.match_blocks) + v.backlog_s / per_block,
                   default=None)

    # The worker budget the router's queue threshold is a fraction of, when the settings
    # leave it to the engine (the router knows its workers' flags; the cluster scheduler's
    # placement does not see them, so this is the simulator's H200 engines' budget).
    ENGINE_BUDGET = 8192

    def dispatch_horizon_s(self, req: Request) -> float | None:
        s = self.settings
        if s.router_queue_threshold <= 0:
            return None
        budget = s.max_num_batched_tokens or self.ENGINE_BUDGET
        return self.ctx.est.prefill_s(int(s.router_queue_threshold * budget), 0)

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        return sorted(reqs, key=lambda r: (r.tier, r.arrival_time))

    def make_queue(self) -> WaitQueue:
        return HeapQueue(key=lambda r: (not is_started(r), r.tier, r.arrival_time))

    def compose_step(self, view: StepView) -> StepPlan:
        s = self.settings
        return budget_step(view, self, s.max_num_batched_tokens, s.long_prefill_token_threshold)

    def place_decode(self, req: Request, need_blocks: int, views: Sequence[DecodeView],
                     prefill: WorkerInfo) -> DecodeChoice | None:
        fits = [v for v in views if v.num_free_blocks >= need_blocks]
        if not fits:
            return None
        best = max(fits, key=lambda v: v.num_free_blocks)
        return choose_decode(need_blocks, [best], prefill, self.ctx.costs, min_headroom=0.0)

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return recompute_in_order(
            sorted(candidates, key=lambda v: (-v.req.tier, -v.req.arrival_time)), need_blocks)


__all__ = ["DynamoPriorityPolicy", "DynamoSettings"]
