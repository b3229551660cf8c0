"""A worker's step planner stepped by hand: what the engine runs next, by policy.

tierserve: a tier-0 arrival runs in the next step ahead of a long lower-tier prefill; a
step stays within its time budget; the decode batch is sized so the tightest TPOT target
in it holds; KV pressure evicts the least urgent tier. The vLLM v1 peer: every running
decode, started prefills before waiting ones, a token budget."""

from __future__ import annotations

from scheduler.policies import make_policy
from scheduler.policy import PolicyContext
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts, StepShape
from scheduler.step_planner import WorkerScheduler
from scheduler.testing import make_costs
from scheduler.tiers import cpu_tiers
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16
# 20 ms per step, 2 ms per prefill token, 3 ms per decode: a CPU-like worker.
COSTS = (0.02, 2e-3, 0.0, 3e-3, 0.0)


def make_worker(policy: str = "tierserve", *, max_num_seqs: int = 64,
                max_batched: int = 2048) -> WorkerScheduler:
    costs = StepCosts(COSTS, prior_weight=1e9)  # pinned: these tests fix the machine's speed
    pol = make_policy(policy, PolicyContext(cpu_tiers(), costs, make_costs(), BS))
    info = WorkerInfo("w0", WorkerRole.DECODE, "n", "cpu", "A", 4096)
    return WorkerScheduler(info, pol, costs, block_size=BS, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_batched, chunk_tokens=512)


def req(rid: str, tier: int, prompt: int, arrival: float = 0.0, max_new: int = 64) -> Request:
    return Request(rid, tier, arrival, prompt, max_new, state=RequestState.PREFILLING)


def decoding(w: WorkerScheduler, rid: str, tier: int, context: int = 100) -> None:
    r = req(rid, tier, context)
    r.first_token_time = 0.0
    r.num_output_tokens = 1
    w.add_decode(r, context, -(-(context + 1) // BS) + 1)


def test_a_tier0_arrival_runs_in_the_next_step_ahead_of_a_long_lower_tier_prefill() -> None:
    w = make_worker()
    w.add_prefill(req("long", 3, 3000), 3000, 0.0)
    first = w.plan(0.0, 4000)
    assert [rid for rid, _ in first.chunks] == ["long"]
    w.commit(first, 0.3, seconds=first.predicted_s)
    w.add_prefill(req("urgent", 0, 100, arrival=0.3), 100, 0.3)
    nxt = w.plan(0.3, 4000)
    assert nxt.chunks[0] == ("urgent", 100)  # whole, and first


def test_a_tierserve_step_stays_within_its_time_budget() -> None:
    w = make_worker()
    for i in range(6):
        w.add_prefill(req(f"r{i}", 1, 800), 800, 0.0)
    plan = w.plan(0.0, 4000)
    # The cap is a quarter of the tightest TTFT (1 s): 250 ms, about 115 tokens here.
    assert 0 < plan.predicted_s <= 0.25 + 1e-9
    assert sum(n for _, n in plan.chunks) < 800


def test_the_decode_batch_keeps_the_tightest_tpot_target() -> None:
    w = make_worker(max_num_seqs=256)
    for i in range(5):
        decoding(w, f"t0-{i}", 0)
    for i in range(100):
        decoding(w, f"t2-{i}", 2)
    plan = w.plan(1.0, 4000)
    tier0 = [d for d in plan.decodes if d.startswith("t0")]
    assert len(tier0) == 5  # the tier with a TPOT target always runs
    step = w.costs.step_s(StepShape(num_decodes=len(plan.decodes)))
    assert step <= 0.8 * 0.25 + 1e-9  # tier 0's 250 ms TPOT, with the planner's margin
    assert len(plan.decodes) < 105  # some tier-2 decodes wait a step for it


def test_with_more_decodes_than_slots_the_most_urgent_run_not_the_oldest() -> None:
    w = make_worker(max_num_seqs=4)
    for i in range(4):
        decoding(w, f"old-t3-{i}", 3)  # joined first
    for i in range(2):
        decoding(w, f"new-t0-{i}", 0)
    plan = w.plan(1.0, 4000)
    assert len(plan.decodes) == 4
    assert {"new-t0-0", "new-t0-1"} <= set(plan.decodes)


def test_an_urgent_prefill_takes_a_slot_from_a_lower_tier_decode_when_all_are_full() -> None:
    w = make_worker(max_num_seqs=4)
    for i in range(4):
        decoding(w, f"t3-{i}", 3)
    w.add_prefill(req("urgent", 0, 64, arrival=1.0), 64, 1.0)
    plan = w.plan(1.0, 4000)
    assert plan.chunks and plan.chunks[0][0] == "urgent"
    assert len(plan.decodes) == 3  # one tier-3 decode sits this step out
    w2 = make_worker(max_num_seqs=4)
    for i in range(4):
        decoding(w2, f"t0-{i}", 0)
    w2.add_prefill(req("lower", 3, 64, arrival=1.0), 64, 1.0)
    plan2 = w2.plan(1.0, 4000)
    assert len(plan2.decodes) == 4 and not plan2.chunks  # a lower tier waits for a slot


def test_kv_pressure_evicts_the_least_urgent_decodes() -> None:
    w = make_worker()
    for i in range(3):
        decoding(w, f"hi{i}", 0, context=16)  # the next token needs a new block
    for i in range(3):
        decoding(w, f"lo{i}", 3, context=16)
    for lr in w.decoding.values():
        lr.num_blocks = 1
    plan = w.plan(5.0, 3)  # 6 decodes need a block each, 3 are free
    evicted = {v.req_id for v in plan.preempt}
    assert evicted and all(rid.startswith("lo") for rid in evicted)
    assert all(d not in evicted for d in plan.decodes)
    assert {d for d in plan.decodes if d.startswith("hi")} == {"hi0", "hi1", "hi2"}


def test_vllm_peer_runs_every_decode_then_started_prefills_within_its_token_budget() -> None:
    w = make_worker("vllm-priority", max_batched=256)
    decoding(w, "d", 3)
    w.add_prefill(req("started", 3, 600), 600, 0.0)
    first = w.plan(0.0, 4000)
    assert first.decodes == ("d",) and first.chunks == (("started", 255),)
    w.commit(first, 0.1, seconds=0.5)
    w.add_prefill(req("urgent", 0, 50, arrival=0.1), 50, 0.1)
    nxt = w.plan(0.1, 4000)
    # vLLM v1 schedules running requests before waiting ones, whatever their priority.
    assert [rid for rid, _ in nxt.chunks][0] == "started"
    assert sum(n for _, n in nxt.chunks) + len(nxt.decodes) <= 256


def test_commit_advances_chunks_and_hands_finished_prefills_to_decoding() -> None:
    w = make_worker()
    r = req("a", 1, 40)
    w.add_prefill(r, 40, 0.0)
    plan = w.plan(0.0, 100)
    done = w.commit(plan, 0.1, seconds=0.1)
    assert done == ["a"] and "a" in w.decoding
    assert r.first_token_time == 0.1 and r.num_output_tokens == 1
    nxt = w.plan(0.2, 100)
    assert nxt.decodes == ("a",)
    w.commit(nxt, 0.3, seconds=0.05)
    assert r.num_output_tokens == 2
    assert w.costs.num_observed == 2


def test_blocks_freed_for_an_arrival_are_not_taken_back_by_the_victim() -> None:
    w = make_worker()
    decoding(w, "victim", 3)
    w.swap_out("victim")  # a preemption for the tier-0 arrival "x" freed its 8 blocks
    w.hold_for("x", 8, now=1.0)
    assert w.plan(1.1, 8).swap_in == ()  # held for "x": no swap-in
    w.release_hold("x")  # "x" was dispatched here
    assert w.plan(1.2, 16).swap_in == ("victim",)
    w2 = make_worker()
    decoding(w2, "victim", 3)
    w2.swap_out("victim")
    w2.hold_for("x", 8, now=1.0)
    assert w2.plan(3.5, 9).swap_in == ("victim",)  # the hold expired: "x" went elsewhere


def test_a_swapped_request_comes_back_only_with_room_for_every_decode_to_grow() -> None:
    w = make_worker()
    decoding(w, "victim", 3)  # 8 blocks
    decoding(w, "a", 1)
    decoding(w, "b", 1)
    w.swap_out("victim")
    # Its own 8 blocks and one more for each of the three decodes (itself too) to grow:
    # in 10 free blocks it would be the next block boundary's victim again.
    assert w.plan(1.0, 10).swap_in == ()
    assert w.plan(1.1, 11).swap_in == ("victim",)
