"""tierserve's mechanisms, each turned off by a setting (the ablations), and policy specs.

Each switch changes exactly the decision it names: admission off accepts a flood that
admission on turns away; the dispatch horizon off sends every request to a worker at
once; the step budget off plans vLLM's token-budget step; preemption modes off recompute
every victim; topology pricing off prices victims by memory over progress; placement off
takes the least loaded workers; reuse-aware eviction off protects no prefix blocks;
slack ordering off (``ordering=tier``) runs tiers in strict order. Specs
parse with their settings and refuse unknown keys and bad values by name."""

from __future__ import annotations

import pytest

from scheduler.cluster_scheduler import ClusterScheduler, NewRequest
from scheduler.messages import SubmitOutcome
from scheduler.placement import DecodeView, PrefillView
from scheduler.policies import check_policy, make_policy
from scheduler.policy import PolicyContext
from scheduler.policy_spec import PolicySpecError, parse_spec, split_specs
from scheduler.preemption import PreemptMode, VictimView
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerScheduler
from scheduler.testing import EST, make_costs, make_request, make_worker
from scheduler.tiers import default_tiers
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16
CTX = PolicyContext(default_tiers(), EST, make_costs(), BS)


def cluster(spec: str) -> ClusterScheduler:
    cs = ClusterScheduler(default_tiers(), spec, BS, make_costs())
    cs.add_worker(WorkerInfo("p0", WorkerRole.PREFILL, "n", "cuda:0", "A", 10_000), 10_000,
                  can_prefill=True, can_decode=False)
    cs.add_worker(WorkerInfo("d0", WorkerRole.DECODE, "n", "cuda:1", "A", 100_000), 100_000,
                  can_prefill=False, can_decode=True)
    return cs


def flood(cs: ClusterScheduler, n: int = 300) -> list[SubmitOutcome]:
    """Tier-1 prompts of 500 tokens at once (each fits its 2 s TTFT alone, not all)."""
    return [cs.submit(NewRequest(f"x{i}", 1, 0.0, 500, 64), 0.0).outcome for i in range(n)]


def test_admission_off_accepts_the_flood_that_admission_turns_away() -> None:
    assert SubmitOutcome.REJECTED in flood(cluster("tierserve"))
    assert set(flood(cluster("tierserve:admission=off"))) == {SubmitOutcome.ACCEPTED}


def test_dispatch_horizon_off_sends_every_request_to_a_worker_at_once() -> None:
    held = cluster("tierserve:admission=off")
    eager = cluster("tierserve:admission=off,dispatch_horizon=off")
    for cs in (held, eager):
        flood(cs, 40)
    assert 0 < len(held.plan(0.01).dispatches) < 40
    assert len(eager.plan(0.01).dispatches) == 40


def planner(spec: str) -> WorkerScheduler:
    costs = StepCosts((0.003, 3e-5, 0.0, 2e-5, 0.0), prior_weight=1e9)
    pol = make_policy(spec, PolicyContext(default_tiers(), costs, make_costs(), BS))
    info = WorkerInfo("p0", WorkerRole.PREFILL, "n", "cuda:0", "A", 100_000)
    return WorkerScheduler(info, pol, costs, block_size=BS, max_num_seqs=256,
                           max_num_batched_tokens=8192, chunk_tokens=8192)


def test_step_budget_off_plans_the_engines_token_budget_step() -> None:
    plans = {}
    for spec in ("tierserve", "tierserve:step_budget=off"):
        w = planner(spec)
        for i in range(4):
            w.add_prefill(Request(f"r{i}", 2, 0.0, 4000, 64, state=RequestState.PREFILLING),
                          4000, 0.0)
        plans[spec] = w.plan(0.0, 100_000)
    assert plans["tierserve"].predicted_s <= 0.05 + 1e-9  # a quarter of the 200 ms TTFT
    assert sum(n for _, n in plans["tierserve:step_budget=off"].chunks) == 8192


def _victims() -> list[VictimView]:
    """v0: a tier-2 long context early in its output; v1: a short tier-3 one half done."""
    d0 = make_worker("d0")
    return [VictimView(make_request(f"v{i}", tier=t, prompt=p, out=1000, num_output_tokens=o,
                                    state=RequestState.DECODING), d0, num_blocks=b)
            for i, (t, p, o, b) in enumerate(((2, 8000, 10, 500), (3, 200, 500, 45)))]


def test_preemption_modes_off_recomputes_every_victim() -> None:
    on = make_policy("tierserve", CTX).on_kv_pressure(600, _victims(), 10.0, 0)
    off = make_policy("tierserve:preempt_modes=off", CTX).on_kv_pressure(600, _victims(), 10.0, 0)
    assert PreemptMode.SWAP in {v.mode for v in on.victims}  # a long context swaps cheaper
    assert {v.mode for v in off.victims} == {PreemptMode.RECOMPUTE}


def test_topology_pricing_off_prices_victims_by_memory_over_progress() -> None:
    on = make_policy("tierserve", CTX).on_kv_pressure(40, _victims(), 10.0, 0)
    off = make_policy("tierserve:topology_pricing=off", CTX).on_kv_pressure(40, _victims(), 10.0, 0)
    assert [v.req_id for v in on.victims] == ["v1"]  # lowest tier weight x restore cost
    assert [v.req_id for v in off.victims] == ["v0"]  # most memory for the least progress


def test_placement_off_takes_the_least_loaded_prefill_and_the_freest_decode() -> None:
    req = make_request("r", tier=1, prompt=1600)
    p0 = make_worker("p0", WorkerRole.PREFILL, domain="d0")
    hit = PrefillView(p0, backlog_s=0.02, match_blocks=90)
    idle = PrefillView(make_worker("p1", WorkerRole.PREFILL, domain="d1"), backlog_s=0.0)
    near = DecodeView(make_worker("near", domain="d0"), num_free_blocks=500)
    far = DecodeView(make_worker("far", domain="d1"), num_free_blocks=900)
    on, off = make_policy("tierserve", CTX), make_policy("tierserve:placement=off", CTX)
    assert on.place_prefill(req, [hit, idle]) is hit
    assert off.place_prefill(req, [hit, idle]) is idle
    assert on.place_decode(req, 101, [far, near], p0).view is near
    assert off.place_decode(req, 101, [far, near], p0).view is far


def test_reuse_aware_eviction_off_protects_no_prefix_blocks() -> None:
    waiting = [make_request("w", tier=0, hashes=(1, 2, 3))]
    assert set(make_policy("tierserve", CTX).protected_hashes(waiting)) == {1, 2, 3}
    assert not make_policy("tierserve:reuse_eviction=off", CTX).protected_hashes(waiting)


def test_specs_parse_split_and_refuse_bad_settings_by_name() -> None:
    assert split_specs("vllm-priority:max_num_batched_tokens=2048,long_prefill_token_threshold"
                       "=512,tierserve,sglang-fcfs:chunked_prefill_size=1024") == [
        "vllm-priority:max_num_batched_tokens=2048,long_prefill_token_threshold=512",
        "tierserve", "sglang-fcfs:chunked_prefill_size=1024"]
    assert parse_spec("tierserve:wfq", "ordering").settings == (("ordering", "wfq"),)
    assert check_policy("tierserve:wfq").label == "tierserve:ordering=wfq"
    for bad, word in (("vllm-fcfs:max_batch=4", "max_batch"),
                      ("sglang-fcfs:chunked_prefill_size=big", "chunked_prefill_size"),
                      ("tierserve:admission=sometimes", "admission"),
                      ("tierserve:ordering=random", "random")):
        with pytest.raises(PolicySpecError, match=word):
            check_policy(bad)


def test_tier_ordering_serves_a_fresh_tier_1_before_a_tier_2_about_to_miss() -> None:
    """Slack ordering runs the tier-2 request due at 30 s (its end-to-end target) ahead of
    a tier-1 one with until 31.5 s for its first token; strict tier order (the ablation)
    runs tier 1 first whatever its slack."""
    late = make_request("late", tier=2, arrival=0.0, prompt=100)
    fresh = make_request("fresh", tier=1, arrival=29.5, prompt=100)
    on = make_policy("tierserve", CTX).order([fresh, late], 29.5)
    off = make_policy("tierserve:ordering=tier", CTX).order([late, fresh], 29.5)
    assert [r.req_id for r in on] == ["late", "fresh"]
    assert [r.req_id for r in off] == ["fresh", "late"]
