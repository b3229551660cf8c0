"""The vLLM peers reproduce vLLM v1's scheduler on small hand-made cases.

Running requests (decodes, started prefills) are scheduled before waiting ones within
``max_num_batched_tokens``; ``long_prefill_token_threshold`` caps one request's share;
the waiting queue is arrival order (fcfs) or (priority, arrival); KV pressure recomputes
the last of the running list (fcfs) or the largest (priority, arrival); a waiting request
never preempts a running one."""

from __future__ import annotations

from scheduler.policies import make_policy
from scheduler.policy import PolicyContext
from scheduler.preemption import PreemptMode, VictimView
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerScheduler
from scheduler.testing import EST, make_costs, make_request, make_worker
from scheduler.tiers import default_tiers
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16
COSTS = (0.003, 3e-5, 0.0, 2e-5, 0.0)


def planner(spec: str) -> WorkerScheduler:
    costs = StepCosts(COSTS, prior_weight=1e9)
    pol = make_policy(spec, PolicyContext(default_tiers(), costs, make_costs(), BS))
    info = WorkerInfo("p0", WorkerRole.PREFILL, "n", "cuda:0", "A", 100_000)
    return WorkerScheduler(info, pol, costs, block_size=BS, max_num_seqs=256,
                           max_num_batched_tokens=8192, chunk_tokens=8192)


def waiting(rid: str, tier: int, prompt: int, arrival: float = 0.0) -> Request:
    return Request(rid, tier, arrival, prompt, 64, state=RequestState.PREFILLING)


def test_a_started_prefill_runs_before_a_more_urgent_waiting_one() -> None:
    w = planner("vllm-priority:max_num_batched_tokens=512")
    w.add_prefill(waiting("long", 3, 4000), 4000, 0.0)
    first = w.plan(0.0, 100_000)
    assert first.chunks == (("long", 512),)
    w.commit(first, 0.02, seconds=None)
    w.add_prefill(waiting("urgent", 0, 300, arrival=0.01), 300, 0.02)
    # The running (started) request takes the budget first: the tier-0 arrival waits.
    assert w.plan(0.02, 100_000).chunks == (("long", 512),)


def test_the_budget_left_by_running_requests_goes_to_waiting_ones() -> None:
    w = planner("vllm-priority:max_num_batched_tokens=1024")
    w.add_prefill(waiting("long", 3, 1200), 1200, 0.0)
    w.commit(w.plan(0.0, 100_000), 0.03, seconds=None)  # 1024 done, 176 left
    w.add_prefill(waiting("urgent", 0, 300, arrival=0.01), 300, 0.03)
    assert w.plan(0.03, 100_000).chunks == (("long", 176), ("urgent", 300))


def test_long_prefill_threshold_caps_each_request_and_shares_the_step() -> None:
    w = planner("vllm-fcfs:max_num_batched_tokens=1024,long_prefill_token_threshold=300")
    for i in range(4):
        w.add_prefill(waiting(f"r{i}", 1, 1000, arrival=i * 0.01), 1000, 0.0)
    assert w.plan(0.1, 100_000).chunks == (("r0", 300), ("r1", 300), ("r2", 300), ("r3", 124))


def test_waiting_order_is_arrival_for_fcfs_and_priority_then_arrival_for_priority() -> None:
    arrivals = [("t2-early", 2, 0.0), ("t0-late", 0, 0.2), ("t1", 1, 0.1), ("t0-early", 0, 0.1)]
    for spec, expected in (("vllm-fcfs", ["t2-early", "t1", "t0-early", "t0-late"]),
                           ("vllm-priority", ["t0-early", "t0-late", "t1", "t2-early"])):
        w = planner(spec)
        for rid, tier, t in arrivals:
            w.add_prefill(waiting(rid, tier, 100, arrival=t), 100, t)
        assert [rid for rid, _ in w.plan(0.3, 100_000).chunks] == expected, spec


def _running(now: float = 5.0) -> list[VictimView]:
    d0 = make_worker("d0")
    reqs = [make_request("t0-old", tier=0, arrival=0.0, state=RequestState.DECODING),
            make_request("t2-old", tier=2, arrival=1.0, state=RequestState.DECODING),
            make_request("t2-new", tier=2, arrival=2.0, state=RequestState.DECODING),
            make_request("t0-new", tier=0, arrival=3.0, state=RequestState.DECODING)]
    return [VictimView(r, d0, num_blocks=10) for r in reqs]


def test_kv_pressure_recomputes_the_newest_under_fcfs_the_lowest_priority_under_priority() -> None:
    ctx = PolicyContext(default_tiers(), EST, make_costs(), BS)
    fcfs = make_policy("vllm-fcfs", ctx).on_kv_pressure(15, _running(), 5.0, 0)
    prio = make_policy("vllm-priority", ctx).on_kv_pressure(15, _running(), 5.0, 0)
    assert [v.req_id for v in fcfs.victims] == ["t0-new", "t2-new"]
    assert [v.req_id for v in prio.victims] == ["t2-new", "t2-old"]
    assert {v.mode for v in (*fcfs.victims, *prio.victims)} == {PreemptMode.RECOMPUTE}


def test_a_waiting_request_never_preempts_a_running_one() -> None:
    """v1 preempts only while scheduling running requests (v0's force preemption is gone)."""
    ctx = PolicyContext(default_tiers(), EST, make_costs(), BS)
    arrival = make_request("urgent", tier=0, arrival=5.0)
    for spec in ("vllm-fcfs", "vllm-priority"):
        low = [v for v in _running() if v.req.tier == 2]
        assert make_policy(spec, ctx).preempt_for(arrival, 30, 0, low, 5.0) is None
