"""vLLM's v1 scheduler (``vllm/v1/core/sched/scheduler.py``, ``Scheduler.schedule``).

Reproduced from the source (vllm-project/vllm at 00024d3, read 2026-12):

1. One token budget per step, ``max_num_batched_tokens``; a request gets at most
   ``long_prefill_token_threshold`` tokens of it when that is set (0: off, its default
   unless ``max_num_partial_prefills`` > 1).
2. The RUNNING requests are scheduled first: every decode and every prefill already
   started (a chunked prefill continues before any waiting request starts), then the
   WAITING queue in policy order: arrival order (``fcfs``) or (priority, arrival)
   (``priority``, lower value first; here priority = tier).
3. A running request that finds no free KV block preempts by recompute (its blocks are
   freed, it goes back to the waiting queue): the last of the running list under
   ``fcfs`` (``self.running.pop()``), the one with the largest (priority, arrival) under
   ``priority``.
4. Preemption happens only while scheduling running requests: a waiting request that
   finds no free blocks stops the waiting loop (``break``) and never preempts a running
   one, whatever its priority. The v0 scheduler's "force preemption" of running requests
   by a higher-priority waiting one (PR #5958) is not in v1.

Here the prefill and decode pools are separate vLLM instances (P/D disaggregation with a
KV connector); a request's decode blocks are reserved when it is dispatched, and a
dispatch that finds no room waits at the head of the queue (the waiting loop's break).
Prefix caching (APC) is on; routing is load-based, with no prefix awareness, as with
vLLM's round-robin or least-load P/D proxies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.peers.common import recompute_in_order
from scheduler.policy import PolicyContext, SchedulingPolicy
from scheduler.preemption import PreemptionPlan, VictimView
from scheduler.queues import HeapQueue, WaitQueue
from scheduler.request import Request
from scheduler.step_planner import StepPlan, StepView, compose_budget_step, is_started


@dataclass(frozen=True, slots=True)
class VllmSettings:
    """The scheduler flags a vLLM user tunes (``vllm serve --help``)."""

    # Tokens per step; 0: the worker's engine budget (the simulator's H200 workers have
    # 8,192, the OpenAI server's default on GPUs with >= 70 GiB such as the H100 and H200:
    # ``EngineArgs.get_batch_defaults``; 2,048 on smaller ones). Never above the engine's.
    max_num_batched_tokens: int = 0
    # Most tokens one request's prefill gets in a step; 0: no cap.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 0 or self.long_prefill_token_threshold < 0:
            raise ValueError("max_num_batched_tokens and long_prefill_token_threshold must "
                             "be >= 0")


def budget_step(view: StepView, policy: SchedulingPolicy, max_num_batched_tokens: int,
                long_prefill_token_threshold: int) -> StepPlan:
    """vLLM v1's step with these flags on this worker (0: the worker's budget, no cap)."""
    limit = view.max_num_batched_tokens
    budget = min(max_num_batched_tokens, limit) if max_num_batched_tokens else limit
    t = long_prefill_token_threshold
    return compose_budget_step(view, policy, budget, t if 0 < t < budget else budget)


class VllmFcfsPolicy(SchedulingPolicy):
    """vLLM v1, ``--scheduling-policy fcfs`` (the default): see the module docstring.

    A waiting request never preempts a running one (``preempt_for`` is the base's None);
    KV pressure recomputes the most recently arrived running request first."""

    name = "vllm-fcfs"
    respects_anti_thrash = False
    settings_cls = VllmSettings

    def __init__(self, ctx: PolicyContext, settings: VllmSettings | None = None) -> None:
        super().__init__(ctx)
        self.settings = settings or VllmSettings()

    def compose_step(self, view: StepView) -> StepPlan:
        s = self.settings
        return budget_step(view, self, s.max_num_batched_tokens, s.long_prefill_token_threshold)

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return recompute_in_order(sorted(candidates, key=lambda v: -v.req.arrival_time),
                                  need_blocks)


class VllmPriorityPolicy(VllmFcfsPolicy):
    """vLLM v1, ``--scheduling-policy priority`` (priority = tier): see the module
    docstring. Waiting requests start in (priority, arrival) order; KV pressure
    recomputes the running request with the largest (priority, arrival) first."""

    name = "vllm-priority"

    def order(self, reqs: Sequence[Request], now: float) -> list[Request]:
        return sorted(reqs, key=lambda r: (r.tier, r.arrival_time))

    def make_queue(self) -> WaitQueue:
        return HeapQueue(key=lambda r: (not is_started(r), r.tier, r.arrival_time))

    def on_kv_pressure(self, need_blocks: int, candidates: Sequence[VictimView],
                       now: float, requester_tier: int) -> PreemptionPlan:
        return recompute_in_order(
            sorted(candidates, key=lambda v: (-v.req.tier, -v.req.arrival_time)), need_blocks)


__all__ = ["VllmFcfsPolicy", "VllmPriorityPolicy", "VllmSettings", "budget_step"]
