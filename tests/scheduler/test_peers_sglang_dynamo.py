"""The SGLang and Dynamo peers reproduce their schedulers on small hand-made cases.

SGLang: fcfs with priority scheduling orders by (priority, arrival), lpm by the longest
prefix match until more than 128 wait; ``chunked_prefill_size`` caps a step; a waiting
request preempts running ones only when their priority is worse by more than the
threshold, lowest priority and latest first, and only when they free all it needs;
decode retraction takes the fewest output tokens, then the longest prompt. Dynamo: the KV
router weighs cached overlap against queued load; its router queue holds requests once
the picked worker holds the threshold's work; its engines are vLLM priority."""

from __future__ import annotations

import dataclasses

from scheduler.placement import PrefillView
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext
from scheduler.preemption import VictimView
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerScheduler
from scheduler.testing import EST, make_costs, make_request, make_worker
from scheduler.tiers import default_tiers
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16
CTX = PolicyContext(default_tiers(), EST, make_costs(), BS)


def planner(spec: str) -> WorkerScheduler:
    costs = StepCosts((0.003, 3e-5, 0.0, 2e-5, 0.0), prior_weight=1e9)
    pol = make_policy(spec, PolicyContext(default_tiers(), costs, make_costs(), BS))
    info = WorkerInfo("p0", WorkerRole.PREFILL, "n", "cuda:0", "A", 100_000)
    return WorkerScheduler(info, pol, costs, block_size=BS, max_num_seqs=256,
                           max_num_batched_tokens=8192, chunk_tokens=8192)


def waiting(rid: str, tier: int, prompt: int, arrival: float = 0.0) -> Request:
    return Request(rid, tier, arrival, prompt, 64, state=RequestState.PREFILLING)


def test_sglang_fcfs_runs_priority_then_arrival_within_its_chunked_prefill_size() -> None:
    w = planner("sglang-fcfs:chunked_prefill_size=1000")
    for rid, tier, t in (("t2", 2, 0.0), ("t0-late", 0, 0.2), ("t0-early", 0, 0.1), ("t1", 1, 0.0)):
        w.add_prefill(waiting(rid, tier, 400, arrival=t), 400, t)
    assert w.plan(0.3, 100_000).chunks == (("t0-early", 400), ("t0-late", 400), ("t1", 200))


def test_sglang_lpm_runs_the_longest_prefix_match_first_until_the_queue_is_long() -> None:
    pol = make_policy("sglang-lpm", CTX)
    p0 = make_worker("p0", WorkerRole.PREFILL)
    reqs = [make_request(f"r{n}", tier=1, arrival=0.1 * i) for i, n in enumerate((0, 30, 10))]
    for r, n in zip(reqs, (0, 30, 10), strict=True):
        pol.place_prefill(r, [PrefillView(p0, 0.0, match_blocks=n)])
    assert [r.req_id for r in pol.order(reqs, 1.0)] == ["r30", "r10", "r0"]
    crowd = reqs + [make_request(f"x{i}", tier=1, arrival=0.05 + i * 1e-3) for i in range(130)]
    assert [r.req_id for r in pol.order(crowd, 1.0)][:2] == ["r0", "x0"]  # fcfs beyond 128


def _running() -> list[VictimView]:
    d0 = make_worker("d0")
    spec = [("t1", 1, 0.0, 5), ("t2-old", 2, 1.0, 5), ("t2-new", 2, 2.0, 5), ("t3", 3, 0.5, 5)]
    return [VictimView(make_request(rid, tier=t, arrival=a, state=RequestState.DECODING),
                       d0, num_blocks=n) for rid, t, a, n in spec]


def test_sglang_preempts_only_beyond_the_priority_threshold_lowest_and_latest_first() -> None:
    pol = make_policy("sglang-fcfs", CTX)  # priority 10 per tier, threshold 10
    urgent = make_request("urgent", tier=0, arrival=5.0)
    plan = pol.preempt_for(urgent, 12, 2, _running(), 5.0)
    assert plan is not None and [v.req_id for v in plan.victims] == ["t3", "t2-new"]
    # Tier 1 is only 10 worse: not preemptible, and the rest cannot free 30 blocks: none.
    assert pol.preempt_for(urgent, 32, 2, _running(), 5.0) is None
    tier1 = make_request("t1-arrival", tier=1, arrival=5.0)
    assert [v.req_id for v in pol.preempt_for(tier1, 7, 2, _running(), 5.0).victims] == ["t3"]
    strict = make_policy("sglang-fcfs:priority_scheduling_preemption_threshold=20", CTX)
    assert [v.req_id for v in strict.preempt_for(urgent, 7, 2, _running(), 5.0).victims] == ["t3"]


def test_sglang_retracts_the_fewest_output_tokens_then_the_longest_prompt() -> None:
    d0 = make_worker("d0")
    spec = [("many", 300, 100), ("few-short", 100, 3), ("few-long", 900, 3), ("some", 200, 40)]
    cands = [VictimView(make_request(rid, tier=1, prompt=p, num_output_tokens=o,
                                     state=RequestState.DECODING), d0, num_blocks=10)
             for rid, p, o in spec]
    plan = make_policy("sglang-lpm", CTX).on_kv_pressure(15, cands, 1.0, 1)
    assert [v.req_id for v in plan.victims] == ["few-long", "few-short"]


def test_dynamo_router_weighs_cached_overlap_against_queued_load() -> None:
    pol = make_policy("dynamo-priority", CTX)
    p0, p1 = make_worker("p0", WorkerRole.PREFILL), make_worker("p1", WorkerRole.PREFILL)
    req = make_request("r", tier=1, prompt=1600)  # 100 blocks
    hit = PrefillView(p0, backlog_s=0.0, match_blocks=60)
    idle = PrefillView(p1, backlog_s=0.0)
    assert pol.place_prefill(req, [hit, idle]) is hit
    per_block = EST.prefill_s(BS, 0)
    busy = dataclasses.replace(hit, backlog_s=80 * per_block)  # 80 blocks queued > 60 saved
    assert pol.place_prefill(req, [busy, idle]) is idle


def test_dynamo_router_queue_holds_requests_only_when_set() -> None:
    req = make_request("r", tier=2)
    assert make_policy("dynamo-priority", CTX).dispatch_horizon_s(req) is None
    queued = make_policy("dynamo-priority:max_num_batched_tokens=2048,router_queue_threshold=2",
                         CTX)
    assert queued.dispatch_horizon_s(req) == EST.prefill_s(4096, 0)


def test_dynamo_engines_step_and_evict_like_vllm_priority() -> None:
    w = planner("dynamo-priority:max_num_batched_tokens=512")
    w.add_prefill(waiting("t1", 1, 2000), 2000, 0.0)
    w.add_prefill(waiting("t0", 0, 2000, arrival=0.1), 2000, 0.1)
    assert w.plan(0.2, 100_000).chunks == (("t0", 512),)
    plan = make_policy("dynamo-priority", CTX).on_kv_pressure(8, _running(), 5.0, 0)
    assert [v.req_id for v in plan.victims] == ["t3", "t2-new"]
