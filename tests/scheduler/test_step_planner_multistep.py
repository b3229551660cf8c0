"""The step planner's multi-step decodes and its pick records (what the checkers read)."""

from __future__ import annotations

import pytest

from scheduler.policies import make_policy
from scheduler.policy import PolicyContext
from scheduler.queues import Pick, PickSite, Verdict
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerScheduler
from scheduler.testing import EST, make_costs, make_request, make_worker
from scheduler.tiers import default_tiers

BS = 4
# c0 10 ms a step, 1 ms a prefill token, 20 ms a decode.
PRIOR = (0.01, 1e-3, 0.0, 0.02, 0.0)


def make_worker_scheduler(policy: str = "tierserve", num_decode_steps: int = 1
                          ) -> WorkerScheduler:
    pol = make_policy(policy, PolicyContext(default_tiers(), EST, make_costs(), BS))
    return WorkerScheduler(make_worker("w0", blocks=64), pol, StepCosts(PRIOR), block_size=BS,
                           max_num_seqs=16, max_num_batched_tokens=256, chunk_tokens=256,
                           num_decode_steps=num_decode_steps)


def decoding(rid: str, tier: int, context: int, out: int = 64, produced: int = 1,
             first_token_time: float = 0.0) -> Request:
    return make_request(rid, tier=tier, prompt=context - produced, out=out,
                        state=RequestState.DECODING, num_output_tokens=produced,
                        first_token_time=first_token_time)


def test_single_step_decodes_grow_by_one_token() -> None:
    ws = make_worker_scheduler()
    r = decoding("a", 1, context=8)
    ws.add_decode(r, num_context=7, num_blocks=2)  # 7 computed, the 8th decodes next
    plan = ws.plan(0.0, num_free_blocks=0)
    assert plan.decodes == ("a",)  # 8 slots in 2 blocks: no new block needed
    ws.commit(plan, 0.02, seconds=None)
    assert ws.local["a"].num_computed == 8 and r.num_output_tokens == 2


def test_multi_step_plan_finds_blocks_for_every_token_of_the_step() -> None:
    ws = make_worker_scheduler(num_decode_steps=4)
    r = decoding("a", 1, context=8)
    ws.add_decode(r, num_context=7, num_blocks=2)
    # Four tokens need slots 8..11: a third block; without one the decode sits out.
    assert ws.plan(0.0, num_free_blocks=0).decodes == ()
    plan = ws.plan(0.0, num_free_blocks=1)
    assert plan.decodes == ("a",)
    assert plan.predicted_s == pytest.approx(4 * (0.01 + 0.02))  # four decode iterations
    ws.commit(plan, 0.12, seconds=None, blocks={"a": 3})
    assert ws.local["a"].num_computed == 11 and r.num_output_tokens == 5


def test_multi_step_decode_stops_at_its_last_token() -> None:
    ws = make_worker_scheduler(num_decode_steps=4)
    r = decoding("a", 1, context=8, out=3)  # one token out, two to go
    ws.add_decode(r, num_context=7, num_blocks=2)
    plan = ws.plan(0.0, num_free_blocks=1)  # two tokens need slots 7 and 8: a third block
    assert plan.decodes == ("a",)
    assert plan.predicted_s == pytest.approx(4 * (0.01 + 0.02))
    ws.commit(plan, 0.1, seconds=None)
    assert r.num_output_tokens == 3 and ws.local["a"].num_computed == 9


def test_kv_pressure_evicts_a_less_urgent_tier_for_a_multi_step_grower() -> None:
    ws = make_worker_scheduler(num_decode_steps=2)
    ws.add_decode(decoding("low", 3, context=8), num_context=7, num_blocks=2)
    ws.add_decode(decoding("top", 0, context=8), num_context=7, num_blocks=2)
    plan = ws.plan(0.0, num_free_blocks=1)  # both need a third block, one is free
    assert [v.req_id for v in plan.preempt] == ["low"] and plan.decodes == ("top",)


def test_growers_of_one_tier_get_blocks_in_policy_order_and_the_rest_sit_out() -> None:
    ws = make_worker_scheduler(num_decode_steps=2)
    ws.add_decode(decoding("late", 1, context=8, first_token_time=0.5), 7, 2)
    ws.add_decode(decoding("early", 1, context=8), 7, 2)  # its TPOT deadline comes first
    plan = ws.plan(0.0, num_free_blocks=1)
    assert plan.preempt == () and plan.decodes == ("early",)


def test_on_pick_reports_chunks_decodes_and_growers_with_who_was_passed_over() -> None:
    picks: list[Pick] = []
    ws = make_worker_scheduler()
    ws.on_pick = picks.append
    ws.add_decode(decoding("d", 1, context=8), 8, 2)  # its next token needs a third block
    for rid, tier in (("p1", 1), ("p0", 0)):
        ws.add_prefill(make_request(rid, tier=tier, prompt=40), 40, 0.0)
    plan = ws.plan(0.0, num_free_blocks=12)  # one for the grower, 11 for p0, none for p1
    sites = {p.site: p for p in picks}
    assert set(sites) == {PickSite.DECODE, PickSite.PREFILL}  # no grower went without
    assert plan.decodes == ("d",)
    offers = [(r.req_id, v) for r, v in sites[PickSite.PREFILL].offers]
    assert offers[0] == ("p0", Verdict.TAKE) and offers[1] == ("p1", Verdict.SKIP)
    picks.clear()
    ws2 = make_worker_scheduler()
    ws2.on_pick = picks.append
    ws2.add_decode(decoding("late", 1, context=8, first_token_time=0.5), 8, 2)
    ws2.add_decode(decoding("early", 1, context=8), 8, 2)
    ws2.plan(0.0, num_free_blocks=1)  # two growers of one tier, one block, no victim
    grow = next(p for p in picks if p.site is PickSite.GROW)
    assert [(r.req_id, v) for r, v in grow.offers] == [("early", Verdict.TAKE),
                                                       ("late", Verdict.SKIP)]
