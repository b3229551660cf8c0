"""The cluster scheduler stepped synchronously: submit, plan, feed results, plan again.

No clock and no I/O: every test builds the object, drives it with explicit times and
checks the plans it returns (tier order, dispatch horizon, shedding order, preemption
for a more urgent tier, conditional disaggregation, dead workers, a restarted scheduler
adopting what the workers hold)."""

from __future__ import annotations

from scheduler.cluster_scheduler import ClusterScheduler, NewRequest, PoolMode
from scheduler.messages import (
    GenerationSpec,
    HeldRequest,
    HeldStage,
    ReqEvent,
    RunningReq,
    SamplingSpec,
    SubmitOutcome,
    WorkerEvent,
    WorkerReport,
)
from scheduler.preemption import PreemptMode
from scheduler.request import Decision, RequestState
from scheduler.testing import make_costs, make_request
from scheduler.tiers import TierConfig, TierSpec
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16


def cpu_tiers() -> TierConfig:
    return TierConfig((
        TierSpec("latency-critical", 1.0, 0.25, None, 0.3, 8.0, 0.9, 5.0),
        TierSpec("interactive", 4.0, 0.5, None, 0.5, 4.0, 1.0, 30.0),
        TierSpec("batch", None, None, 60.0, 0.1, 2.0, 1.0, 120.0),
        TierSpec("best-effort", None, None, 300.0, 0.1, 1.0, 1.0, 900.0),
    ))


def make_cluster(mode: PoolMode = PoolMode.DISAGGREGATED, policy: str = "tierserve",
                 decode_blocks: int = 256, num_prefill: int = 1,
                 num_decode: int = 1) -> ClusterScheduler:
    cs = ClusterScheduler(cpu_tiers(), policy, BS, make_costs(), mode=mode)
    for i in range(num_prefill if mode is not PoolMode.AGGREGATED else 0):
        cs.add_worker(WorkerInfo(f"p{i}", WorkerRole.PREFILL, "n", "cpu", "A", 256), 256,
                      can_prefill=True, can_decode=False)
    for i in range(num_decode):
        cs.add_worker(WorkerInfo(f"d{i}", WorkerRole.DECODE, "n", "cpu", "A", decode_blocks),
                      decode_blocks, can_prefill=mode is not PoolMode.DISAGGREGATED,
                      can_decode=True)
    return cs


def submit(cs: ClusterScheduler, rid: str, tier: int, prompt: int, now: float,
           max_new: int = 16):
    return cs.submit(NewRequest(rid, tier, now, prompt, max_new), now)


def dispatch_all(cs: ClusterScheduler, now: float) -> list[str]:
    """Plan once and answer every dispatch with success; returns the dispatched ids."""
    plan = cs.plan(now)
    for d in plan.dispatches:
        cs.on_dispatch_result(d.req_id, True, now)
    return [d.req_id for d in plan.dispatches]


def test_dispatch_follows_tier_order_and_reserves_before_prefill() -> None:
    cs = make_cluster()
    for i, tier in enumerate((3, 2, 1, 0)):
        assert submit(cs, f"r{tier}", tier, 100, now=0.0 + i * 1e-3).accepted
    plan = cs.plan(0.01)
    ids = [d.req_id for d in plan.dispatches]
    assert ids[0] == "r0"  # the most urgent tier first, whatever the arrival order
    d = plan.dispatches[0]
    assert d.decode_worker_id == "d0" and d.prefill_worker_id == "p0"
    assert d.num_blocks == -(-(100 + 1) // BS)
    assert cs.get("r0").state is RequestState.QUEUED  # until the decode worker says yes
    cs.on_dispatch_result("r0", True, 0.02)
    assert cs.get("r0").state is RequestState.PREFILLING


def test_dispatch_horizon_keeps_lower_tiers_in_the_global_queue_but_never_tier0() -> None:
    cs = make_cluster()
    for i in range(40):
        submit(cs, f"b{i}", 2, 1000, now=0.0)
    first = dispatch_all(cs, 0.01)
    assert 0 < len(first) < 40  # the worker got a few steps' worth, the rest waits here
    assert submit(cs, "urgent", 0, 1000, now=0.02).accepted
    assert dispatch_all(cs, 0.03) == ["urgent"]


def test_refused_dispatch_goes_back_to_the_queue() -> None:
    cs = make_cluster()
    submit(cs, "a", 1, 100, now=0.0)
    plan = cs.plan(0.0)
    cs.on_dispatch_result("a", False, 0.01, num_free_blocks=0)
    assert cs.get("a").state is RequestState.QUEUED
    assert "a" in [r.req_id for r in cs.waiting()]
    assert plan.dispatches


def test_a_rejection_sheds_no_other_tier_and_no_feasible_request() -> None:
    cs = make_cluster()
    # Flood tier 1 until admission refuses (its 4 s TTFT cannot be met).
    outcome = None
    for i in range(400):
        outcome = submit(cs, f"x{i}", 1, 1000, now=0.0)
        if outcome.outcome is SubmitOutcome.REJECTED:
            break
    assert outcome is not None and outcome.outcome is SubmitOutcome.REJECTED
    assert outcome.retry_after_s and outcome.retry_after_s > 0
    # The tier-1 work ahead of it fits one deadline window: only its own prompt made it
    # miss, so a shorter tier-1 prompt is still judged (no window sheds it), and the
    # later tiers are judged against their own targets (a 300 s tier is not shed
    # because a 4 s one is full).
    assert cs.shed_s_by_tier(0.0) == (0.0, 0.0, 0.0, 0.0)
    assert submit(cs, "low", 3, 10, now=0.01).accepted
    assert submit(cs, "top", 0, 10, now=0.01).accepted


def test_a_rejection_whose_wait_alone_misses_sheds_its_own_tier_only() -> None:
    cs = make_cluster()
    # Tier-0 work far beyond tier 1's 4 s target: every tier-1 arrival misses whatever
    # its own size, so the tier is shed for a moment; later tiers are judged on their own.
    for i in range(300):
        assert submit(cs, f"t{i}", 0, 2000, now=0.0).accepted  # tier 0 is never rejected
    got = submit(cs, "one", 1, 16, now=0.0)
    assert got.outcome is SubmitOutcome.REJECTED
    shed = cs.shed_s_by_tier(0.0)
    assert shed[1] > 0 and shed[0] == shed[2] == shed[3] == 0.0
    assert submit(cs, "two", 1, 16, now=0.01).outcome is SubmitOutcome.REJECTED
    assert submit(cs, "top", 0, 16, now=0.01).accepted


def test_tier0_without_decode_room_preempts_a_lower_tier_decode() -> None:
    cs = make_cluster(decode_blocks=16)
    submit(cs, "low", 3, 200, now=0.0)
    assert dispatch_all(cs, 0.0) == ["low"]
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent("low", WorkerEvent.PREFILL_DONE, 0.5),)), 0.5)
    cs.on_report(WorkerReport("d0", 2, 16, events=(
        ReqEvent("low", WorkerEvent.DECODE_START, 0.6),),
        running=(RunningReq("low", 14, 1),)), 0.6)
    assert cs.get("low").state is RequestState.DECODING
    submit(cs, "top", 0, 200, now=2.0)
    plan = cs.plan(2.0)
    assert not plan.dispatches
    assert [(p.req_id, p.worker_id, p.for_req_id) for p in plan.preempts] == [
        ("low", "d0", "top")]
    assert plan.preempts[0].mode in (PreemptMode.SWAP, PreemptMode.RECOMPUTE)


def _full_decode_worker(policy: str = "tierserve", blocks: int = 16,
                        held: int = 14) -> ClusterScheduler:
    """One decode worker of ``blocks`` blocks, ``held`` of them held by a decoding tier-3
    request."""
    cs = make_cluster(decode_blocks=blocks, policy=policy)
    submit(cs, "low", 3, held * BS - 20, now=0.0)
    assert dispatch_all(cs, 0.0) == ["low"]
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent("low", WorkerEvent.PREFILL_DONE, 0.5),)), 0.5)
    cs.on_report(WorkerReport("d0", blocks - held, blocks, events=(
        ReqEvent("low", WorkerEvent.DECODE_START, 0.6),),
        running=(RunningReq("low", held, 1),)), 0.6)
    return cs


def test_blocks_a_more_urgent_request_waits_for_do_not_go_to_a_smaller_later_one() -> None:
    cs = _full_decode_worker(blocks=64, held=40)  # 24 free
    submit(cs, "small", 2, 20, now=1.0)  # 2 blocks: fits, its tier's reserve too
    alone = _full_decode_worker(blocks=64, held=40)
    submit(alone, "small", 2, 20, now=1.0)
    assert [d.req_id for d in alone.plan(1.0).dispatches] == ["small"]
    submit(cs, "big", 1, 470, now=1.0)  # 30 blocks: no room
    assert "small" not in [d.req_id for d in cs.plan(1.0).dispatches]


def test_a_batch_tier_waits_for_released_memory_while_its_slack_covers_the_wait() -> None:
    # "low" ends within its 16 tokens: a 60 s batch request waits for its blocks...
    cs = _full_decode_worker()
    submit(cs, "batch", 2, 150, now=1.0)
    assert not cs.plan(1.0).preempts
    # ...and preempts at once with the mechanism off, as tier 0 always does.
    eager = _full_decode_worker("tierserve:preempt_when_late=false")
    submit(eager, "batch", 2, 150, now=1.0)
    assert [p.req_id for p in eager.plan(1.0).preempts] == ["low"]


def test_tierserve_admission_never_turns_tier0_away_but_rejects_the_later_tiers() -> None:
    from scheduler.admission import AdmissionKind, LoadSnapshot
    from scheduler.policies import make_policy
    from scheduler.policy import PolicyContext
    from scheduler.step_costs import StepCosts

    costs = StepCosts((0.02, 2e-3, 0.0, 3e-3, 0.0))
    policy = make_policy("tierserve", PolicyContext(cpu_tiers(), costs, make_costs(), BS))
    # Decode memory spoken for by 1,000 blocks of queued tier-0 work, freed at 200 a
    # second: a 5 s wait for blocks, far past tier 0's 1 s and tier 1's 4 s.
    full = LoadSnapshot([0.0] * 4, 1, False, kv_queued_blocks_by_tier=[1000, 0, 0, 0],
                        kv_held_blocks_by_tier=[0, 0, 0, 0], kv_free_blocks=0,
                        kv_release_blocks_per_s=200.0, block_size=BS)
    top = policy.admit(make_request("t0", tier=0, arrival=0.0, prompt=160), 0.0, full)
    assert top.kind is AdmissionKind.QUEUE and top.predicted_s > 1.0
    t1 = policy.admit(make_request("t1", tier=1, arrival=0.0, prompt=160), 0.0, full)
    assert t1.kind is AdmissionKind.REJECT


def test_worker_events_walk_the_state_machine_to_the_end() -> None:
    cs = make_cluster()
    submit(cs, "a", 0, 50, now=0.0)
    dispatch_all(cs, 0.0)
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent("a", WorkerEvent.PREFILL_DONE, 0.2),)), 0.2)
    assert cs.get("a").state is RequestState.TRANSFERRING
    assert cs.get("a").first_token_time == 0.2
    cs.on_report(WorkerReport("d0", 250, 256, events=(
        ReqEvent("a", WorkerEvent.DECODE_START, 0.25),
        ReqEvent("a", WorkerEvent.FINISHED_STOP, 0.9))), 0.9)
    assert cs.get("a") is None  # closed
    assert cs.workers["d0"].held == {}


def test_a_dispatch_its_prefill_worker_could_not_take_ends_for_the_router_to_retry() -> None:
    # The decode worker could not reach the prefill worker (dead, restarting): the attempt
    # ends with worker_failed, which the router retries under its resume bound.
    cs = make_cluster()
    submit(cs, "a", 1, 100, now=0.0)
    assert cs.plan(0.0).dispatches
    req = cs.get("a")
    cs.on_dispatch_result("a", False, 0.01, num_free_blocks=90, reason="worker_failed",
                          fatal=True)
    assert cs.get("a") is None
    plan = cs.plan(0.02)
    assert [(a.req_id, a.error) for a in plan.aborts] == [("a", "worker_failed")]
    assert req.history[-1].decision is Decision.WORKER_FAILED


def test_dead_decode_worker_ends_its_requests_with_a_retryable_error() -> None:
    cs = make_cluster()
    submit(cs, "a", 1, 50, now=0.0)
    dispatch_all(cs, 0.0)
    assert cs.remove_worker("d0", 1.0) == ["a"]
    plan = cs.plan(1.0)
    assert [(a.req_id, a.worker_ids, a.error) for a in plan.aborts] == [
        ("a", ("p0",), "worker_failed")]
    assert submit(cs, "b", 1, 50, now=1.1).outcome is SubmitOutcome.UNAVAILABLE


def test_aggregated_mode_prefills_on_the_decode_worker() -> None:
    cs = make_cluster(PoolMode.AGGREGATED, num_decode=2)
    submit(cs, "a", 1, 100, now=0.0)
    submit(cs, "b", 1, 100, now=0.0)
    plan = cs.plan(0.0)
    assert all(d.prefill_worker_id is None for d in plan.dispatches)
    # The second goes to the other worker: the first one's queued prefill is ahead there.
    assert {d.decode_worker_id for d in plan.dispatches} == {"d0", "d1"}


def test_auto_mode_prefills_short_prompts_locally_and_long_ones_remotely() -> None:
    cs = make_cluster(PoolMode.AUTO)
    cs.local_prefill_max_tokens = 256
    submit(cs, "short", 1, 40, now=0.0)
    submit(cs, "long", 1, 2000, now=0.0)
    plan = cs.plan(0.0)
    where = {d.req_id: d.prefill_worker_id for d in plan.dispatches}
    assert where == {"short": None, "long": "p0"}


def test_peer_policy_stops_at_the_head_of_the_line() -> None:
    for policy, expect in (("vllm-fcfs", []), ("tierserve", ["small"])):
        cs = make_cluster(policy=policy, decode_blocks=64)
        submit(cs, "occupant", 1, 600, now=0.0)  # 38 blocks
        assert dispatch_all(cs, 0.0) == ["occupant"]
        cs.on_report(WorkerReport("p0", 256, 256, events=(
            ReqEvent("occupant", WorkerEvent.PREFILL_DONE, 0.05),)), 0.05)
        submit(cs, "big", 1, 420, now=0.1)  # 27 blocks: more than the 26 left
        submit(cs, "small", 1, 10, now=0.2)
        # FCFS: the head blocks the line; tierserve lets the small one pass.
        assert dispatch_all(cs, 0.3) == expect, policy


def test_an_abort_that_overtakes_its_submission_refuses_it() -> None:
    cs = make_cluster()
    cs.abort("late", 0.0)  # the router's abort arrived first (they travel separately)
    assert submit(cs, "late", 1, 10, now=0.1).outcome is SubmitOutcome.INVALID
    assert cs.get("late") is None and not cs.waiting()


def test_reports_drop_what_the_worker_no_longer_holds() -> None:
    cs = make_cluster()
    submit(cs, "a", 2, 100, now=0.0)
    dispatch_all(cs, 0.0)
    assert cs.workers["p0"].prefill_left.as_dict() == {"a": 100}
    cs.on_report(WorkerReport("p0", 256, 256, running=(RunningReq("a", 0, 0, 40),)), 0.1)
    assert cs.workers["p0"].prefill_left.as_dict() == {"a": 40}
    cs.on_report(WorkerReport("p0", 256, 256, running=()), 0.2)  # gone from the worker
    assert cs.workers["p0"].prefill_left.as_dict() == {}
    assert cs.workers["p0"].backlog_s() == 0.0


def test_a_prompt_no_worker_could_ever_hold_is_refused_at_once() -> None:
    cs = make_cluster(decode_blocks=16)
    adm = submit(cs, "huge", 1, 16 * 16, now=0.0)  # 257 tokens with its first output: 17 blocks
    assert adm.outcome is SubmitOutcome.INVALID and "16" in adm.reason


def test_on_pick_reports_the_dispatch_order_and_who_found_no_room() -> None:
    picks = []
    cs = ClusterScheduler(cpu_tiers(), "tierserve", BS, make_costs(), on_pick=picks.append)
    cs.add_worker(WorkerInfo("p0", WorkerRole.PREFILL, "n", "cpu", "A", 256), 256,
                  can_prefill=True, can_decode=False)
    cs.add_worker(WorkerInfo("d0", WorkerRole.DECODE, "n", "cpu", "A", 64), 64,
                  can_prefill=False, can_decode=True)
    submit(cs, "occupant", 1, 600, now=0.0)  # 38 blocks
    assert dispatch_all(cs, 0.0) == ["occupant"]
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent("occupant", WorkerEvent.PREFILL_DONE, 0.05),)), 0.05)
    picks.clear()
    submit(cs, "big", 1, 420, now=0.1)  # 27 blocks: more than the 26 left
    submit(cs, "small", 1, 10, now=0.15)
    plan = cs.plan(0.2)
    assert [d.req_id for d in plan.dispatches] == ["small"]
    (pick,) = picks
    assert pick.site.value == "dispatch" and pick.now == 0.2 and pick.rest == ()
    assert [(r.req_id, v.value) for r, v in pick.offers] == [("big", "skip"), ("small", "take")]


def test_a_preemption_in_flight_is_not_ordered_again_until_the_worker_answers() -> None:
    """Until the victim's PREEMPTED event arrives it still looks like a decode: the next
    plans must wait for it, not order it again (sglang-fcfs, which preempts for an
    arrival, ignores the anti-thrash window) or another victim for the same need."""
    cs = make_cluster(policy="sglang-fcfs", decode_blocks=16)
    submit(cs, "low", 3, 200, now=0.0)
    assert dispatch_all(cs, 0.0) == ["low"]
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent("low", WorkerEvent.PREFILL_DONE, 0.5),)), 0.5)
    cs.on_report(WorkerReport("d0", 2, 16, events=(
        ReqEvent("low", WorkerEvent.DECODE_START, 0.6),), running=(RunningReq("low", 14, 1),)),
        0.6)
    submit(cs, "top", 0, 200, now=2.0)
    assert [(p.req_id, p.for_req_id) for p in cs.plan(2.0).preempts] == [("low", "top")]
    for t in (2.01, 2.02, 2.03):
        again = cs.plan(t)
        assert not again.preempts and not again.dispatches
    cs.on_report(WorkerReport("d0", 16, 16, events=(
        ReqEvent("low", WorkerEvent.PREEMPTED_RECOMPUTE, 2.05, for_req_id="top"),)), 2.05)
    assert dispatch_all(cs, 2.05) == ["top"]


def _finish_one(cs: ClusterScheduler, rid: str, tier: int, now: float, num_out: int) -> None:
    submit(cs, rid, tier, 50, now=now, max_new=2048)
    assert dispatch_all(cs, now) == [rid]
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent(rid, WorkerEvent.PREFILL_DONE, now + 0.1),)), now + 0.1)
    cs.on_report(WorkerReport("d0", 250, 256, events=(
        ReqEvent(rid, WorkerEvent.DECODE_START, now + 0.2),), running=(
        RunningReq(rid, 4, num_out),)), now + 0.3)
    cs.on_report(WorkerReport("d0", 256, 256, events=(
        ReqEvent(rid, WorkerEvent.FINISHED_STOP, now + 0.4),)), now + 0.4)


def test_expected_output_is_learned_from_finished_requests_not_the_budget() -> None:
    """max_new_tokens is the client's budget; admission's KV release rate uses what
    requests actually generated."""
    cs = make_cluster()
    probe = make_request("probe", tier=1, prompt=50, out=2048)
    assert cs.outputs.expected(probe) == 2048  # nothing learned yet
    for i in range(20):
        _finish_one(cs, f"r{i}", 2, 1.0 + i, num_out=30)
    assert cs.outputs.expected(probe) == 30  # tier 1 has none yet: all tiers' mean
    _finish_one(cs, "t1", 1, 30.0, num_out=300)
    assert cs.outputs.expected(probe) == 300
    assert cs.outputs.expected(make_request("short", tier=1, out=16)) == 16  # within budget


def test_first_tokens_feed_the_fair_share_controller() -> None:
    cs = make_cluster()
    _finish_one(cs, "a", 0, 0.0, num_out=20)
    assert cs.policy.tails.p99_ratio(0) == 0.1 / 1.0  # TTFT 0.1 s against 1 s
    assert cs.policy.ledger.total_served[0] == 50 + 19  # the prompt, then 19 output tokens


def test_a_dead_prefill_worker_leaves_its_requests_to_their_decode_worker() -> None:
    cs = make_cluster()
    submit(cs, "a", 1, 50, now=0.0)
    submit(cs, "b", 1, 50, now=0.0)
    dispatch_all(cs, 0.0)
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent("a", WorkerEvent.PREFILL_DONE, 0.2),)), 0.2)
    cs.on_report(WorkerReport("d0", 250, 256, events=(
        ReqEvent("a", WorkerEvent.DECODE_START, 0.25),)), 0.25)
    # Whether b's KV arrived only d0 knows: nothing ends here, d0 is asked about b.
    assert cs.remove_worker("p0", 1.0) == []
    assert cs.waiting_on("p0") == {"d0": ["b"]}
    assert cs.get("a").state is RequestState.DECODING
    cs.abort("b", 1.1, Decision.WORKER_FAILED, "worker:p0", error="worker_failed")
    plan = cs.plan(1.1)
    assert [(a.req_id, a.worker_ids, a.error) for a in plan.aborts] == [
        ("b", ("d0",), "worker_failed")]
    assert cs.get("a") is not None and cs.get("b") is None


def _held(rid: str, stage: HeldStage, *, blocks: int = 4, out: int = 3, tier: int = 1,
          prefill: str | None = None, router: str = "r1") -> HeldRequest:
    spec = GenerationSpec(rid, tuple(range(40)), SamplingSpec(16, 0.0), tier, "t", 0.0,
                          router_id=router)
    return HeldRequest(spec, stage, blocks, out, prefill, 0.5 if out else None)


def test_a_restarted_scheduler_adopts_what_a_decode_worker_holds() -> None:
    cs = make_cluster()
    assert cs.adopt("d0", _held("dec", HeldStage.DECODING))
    assert cs.adopt("d0", _held("swp", HeldStage.SWAPPED))
    assert cs.adopt("d0", _held("rcv", HeldStage.RECEIVING, out=0, prefill="p0"))
    assert not cs.adopt("d0", _held("dec", HeldStage.DECODING))  # already live
    assert not cs.adopt("p0", _held("x", HeldStage.DECODING))  # not a decode worker
    assert cs.get("dec").state is RequestState.DECODING
    assert cs.get("swp").state is RequestState.PREEMPTED
    assert cs.get("rcv").state is RequestState.PREFILLING
    assert cs.waiting_on("p0") == {"d0": ["rcv"]}
    assert cs.workers["d0"].held == {"dec": 4, "swp": 4, "rcv": 4}
    # The adopted requests go on through the state machine as if never interrupted.
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent("rcv", WorkerEvent.PREFILL_DONE, 1.0),)), 1.0)
    cs.on_report(WorkerReport("d0", 200, 256, events=(
        ReqEvent("rcv", WorkerEvent.DECODE_START, 1.1),
        ReqEvent("swp", WorkerEvent.RESUMED_SWAP, 1.1),
        ReqEvent("dec", WorkerEvent.FINISHED_STOP, 1.2))), 1.2)
    assert cs.get("dec") is None
    assert cs.get("rcv").state is RequestState.DECODING
    assert cs.get("swp").state is RequestState.DECODING


def test_adopted_requests_their_router_does_not_claim_are_ended() -> None:
    cs = make_cluster()
    cs.adopt("d0", _held("mine", HeldStage.DECODING))
    cs.adopt("d0", _held("gone", HeldStage.DECODING))
    cs.adopt("d0", _held("other", HeldStage.DECODING, router="r2"))
    assert cs.drop_unclaimed("r1", ["mine", "never-seen"], 2.0) == ["gone"]
    plan = cs.plan(2.0)
    assert [(a.req_id, a.worker_ids, a.error) for a in plan.aborts] == [("gone", ("d0",), None)]
    # Claimed once, a request is its router's again: a later claim does not end it.
    assert cs.drop_unclaimed("r1", [], 3.0) == []
    assert cs.get("mine") is not None and cs.get("other") is not None
