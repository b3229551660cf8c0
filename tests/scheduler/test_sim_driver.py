"""The simulator drives the serving path's scheduler objects and only carries out plans.

Its dispatches are the ClusterScheduler's, in the same order; every pool mode runs every
request to the end; its workers' StepCosts learn the cost model's step times from the
steps they ran, whatever the prior; the kernel sees the max_tokens budget, never the
trace's output length."""

from __future__ import annotations

import pytest

from scheduler.cluster_scheduler import PoolMode
from scheduler.request import RequestState
from scheduler.sim.cluster import parse_cluster
from scheduler.sim.costmodel import PROFILES, CostModel
from scheduler.sim.metrics import summarize
from scheduler.sim.simulator import Simulator
from scheduler.sim.traces import TraceRequest, poisson
from scheduler.step_costs import StepCosts, StepShape
from scheduler.tiers import default_tiers

COST = CostModel(PROFILES["h200-llama3-8b"])
TIERS = default_tiers()
SMALL = parse_cluster("prefill=1,decode=1,gpus_per_node=2,kv_blocks=1000", 1000)
TWO_BY_TWO = parse_cluster("prefill=2,decode=2,gpus_per_node=4,domains_per_node=2", 51_000)
TRACE = poisson("rate=20,duration=6,prompt=1200,output=100,prefix_groups=3", seed=5)


def hand_made() -> list[TraceRequest]:
    """A burst at t=0: tiers out of order, long and short prompts, a shared prefix."""
    spec = [(3, 6000, 50), (2, 300, 20), (0, 2500, 30), (1, 800, 40), (0, 200, 10),
            (3, 100, 5), (1, 7000, 60), (2, 1500, 25)]
    return [TraceRequest(f"h{i}", 0.0, p, o, t, (7, 100 + i) if p > 1024 else (7,))
            for i, (t, p, o) in enumerate(spec)]


@pytest.mark.parametrize("policy", ["tierserve", "vllm-priority", "sglang-lpm"])
def test_the_simulators_dispatches_are_the_cluster_schedulers_plan(policy: str) -> None:
    trace = hand_made()
    sim = Simulator(trace, policy, TWO_BY_TWO, COST, TIERS).run()
    # The same ClusterScheduler, built and registered as the simulator builds it, asked
    # directly: its first plan is what the simulator applied first, in the same order.
    ref = Simulator(trace, policy, TWO_BY_TWO, COST, TIERS)
    for tr in trace:
        assert ref.cs.submit(ref.new_request(tr), 0.0).accepted
    plan = ref.cs.plan(0.0)
    expected = [(0.0, d.req_id, d.decode_worker_id, d.prefill_worker_id) for d in plan.dispatches]
    assert expected and sim.dispatch_log[:len(expected)] == expected
    assert all(j.req.state.is_finished for j in sim.jobs.values())


def test_tier_order_reaches_the_workers_steps() -> None:
    """The prefill worker's planner, not arrival order, decides who runs first: the
    tier-0 prompts get their first tokens before every other tier's."""
    sim = Simulator(hand_made(), "tierserve", SMALL, COST, TIERS).run()
    first = {j.trace.req_id: j.req.first_token_time for j in sim.jobs.values()}
    tier0 = [first[j.trace.req_id] for j in sim.jobs.values() if j.trace.tier == 0]
    others = [first[j.trace.req_id] for j in sim.jobs.values() if j.trace.tier > 1]
    assert max(tier0) < min(others)


@pytest.mark.parametrize("mode", [PoolMode.AGGREGATED, PoolMode.AUTO])
@pytest.mark.parametrize("policy", ["tierserve", "vllm-fcfs"])
def test_aggregated_and_auto_modes_run_every_request_to_the_end(mode: PoolMode,
                                                                policy: str) -> None:
    sim = Simulator(TRACE, policy, SMALL, COST, TIERS, mode=mode).run()
    run = summarize(sim, 1.0)
    assert all(j.req.state.is_finished for j in sim.jobs.values())
    assert sum(t["completed"] + t["rejected"] for t in run["tiers"].values()) == len(TRACE)
    assert run["violations"]["kv_budget"] == 0 and run["violations"]["legal_transitions"] == 0
    assert all(w.account.num_owned == 0 and w.num_mechanism_refusals == 0 for w in sim.workers)
    local = {p is None for _, _, _, p in sim.dispatch_log}
    if mode is PoolMode.AGGREGATED:
        assert not sim.prefill and local == {True}
        assert len(sim.decode) == 2  # both GPUs of the spec prefill and decode
    else:
        assert local == {True, False}  # short prompts here, long ones on the prefill pool
    assert run["mode"] == mode.value


@pytest.mark.slow
@pytest.mark.parametrize("prior_scale, profile_prior", [(3.0, True), (0.3, True), (1.0, False)])
def test_learned_step_costs_converge_to_the_profiles_step_times(prior_scale: float,
                                                                profile_prior: bool) -> None:
    """The workers' StepCosts start 3x off the profile's step times (either way), or from
    the generic GPU prior an uncalibrated worker has (the default), and learn the cost
    model's step times from the steps they ran: the kernel's estimate is learned, never
    the cost model itself. Checked at the shapes the workers run (a fit says little far
    outside them)."""
    trace = poisson("rate=20,duration=30,prompt=1200,output=100,prefix_groups=3", seed=5)
    sim = Simulator(trace, "tierserve", SMALL, COST, TIERS, prior_scale=prior_scale,
                    profile_prior=profile_prior).run()
    (pw,), (dw,) = sim.prefill, sim.decode
    assert pw.ws.costs.num_observed > 300 and dw.ws.costs.num_observed > 3000
    start = StepCosts(COST.step_prior(True) if profile_prior else COST.generic_prior())
    for n in (256, 1200):
        truth = COST.prefill_step_s(COST.prefill_flops(n, 0))
        shape = StepShape(prefill_tokens=n, prefill_attention=n * n / 2)
        prior = start.step_s(shape) * prior_scale
        learned = pw.ws.costs.step_s(shape)
        assert learned == pytest.approx(truth, rel=0.1) and abs(prior - truth) > 0.1 * truth
    # Decodes at the batch and context the worker ran (here about one decode at a time:
    # the fit cannot tell a batch's cost from its context's far from that shape).
    b, ctx = dw.ws.costs.typical_decode
    for batch in {max(round(b), 1), max(round(b), 1) + 1}:
        truth = COST.decode_step_s(batch, int(batch * ctx))
        assert dw.ws.costs.decode_step_s(batch, int(batch * ctx)) == pytest.approx(truth,
                                                                                    rel=0.1)
    # The cluster scheduler predicts with what the workers reported.
    assert sim.cs.workers[dw.worker_id].costs.coefficients == pytest.approx(
        dw.ws.costs.coefficients)


def test_the_kernel_sees_the_max_tokens_budget_and_the_model_ends_at_eos() -> None:
    trace = [TraceRequest("short", 0.0, 500, 40, 1), TraceRequest("long", 0.0, 500, 900, 1)]
    sim = Simulator(trace, "tierserve", SMALL, COST, TIERS, max_tokens=300).run()
    assert {sim.new_request(tr).max_new_tokens for tr in trace} == {300}
    short, long = sim.jobs["short"], sim.jobs["long"]
    assert short.req.state is RequestState.FINISHED_STOPPED and short.num_output_tokens == 40
    assert long.req.state is RequestState.FINISHED_LENGTH and long.num_output_tokens == 300
    assert all(j.req.max_new_tokens == 300 for j in sim.jobs.values())
    run = summarize(sim, 1.0)
    assert run["tiers"]["1"]["completed"] == 2 and run["max_tokens"] == 300
