"""Placement and victim choice through the public API."""

from __future__ import annotations

import dataclasses

from scheduler.placement import DecodeView, PrefillView, choose_decode, choose_prefill
from scheduler.preemption import PreemptMode, VictimScorer, VictimView, choose_victims
from scheduler.request import RequestState
from scheduler.testing import EST, make_costs, make_request, make_worker
from scheduler.tiers import default_tiers
from scheduler.topology import TopologyClass, WorkerRole, topology_class

TIERS = default_tiers()
COSTS = make_costs()


def test_topology_classes() -> None:
    a = make_worker("0", domain="d0")
    assert topology_class(a, make_worker("1", domain="d0")) is TopologyClass.SAME_DOMAIN
    assert topology_class(a, make_worker("2", domain="d1")) is TopologyClass.SAME_NODE
    assert topology_class(a, make_worker("3", node="n1", domain="d2")) is TopologyClass.CROSS_NODE
    assert topology_class(a, make_worker("x", device="cuda:0")) is TopologyClass.SAME_DEVICE
    assert COSTS.move_s(10, TopologyClass.CROSS_NODE) > COSTS.move_s(10, TopologyClass.SAME_DOMAIN)


def test_prefill_prefers_prefix_hit_unless_queue_outweighs_it() -> None:
    p0 = make_worker("p0", WorkerRole.PREFILL)
    p1 = make_worker("p1", WorkerRole.PREFILL)
    hit = PrefillView(p0, backlog_s=0.05, match_blocks=60)  # saves 0.096 s of 0.1 s
    idle = PrefillView(p1, backlog_s=0.0, match_blocks=0)
    assert choose_prefill(1000, 16, [hit, idle], EST) is hit
    swamped = dataclasses.replace(hit, backlog_s=1.0)
    assert choose_prefill(1000, 16, [swamped, idle], EST) is idle
    assert choose_prefill(1000, 16, [], EST) is None


def test_decode_prefers_same_domain_with_headroom() -> None:
    pre = make_worker("p", WorkerRole.PREFILL, domain="d0")
    near = DecodeView(make_worker("near", domain="d0"), num_free_blocks=50)
    far = DecodeView(make_worker("far", domain="d1"), num_free_blocks=90)
    choice = choose_decode(10, [far, near], pre, COSTS)
    assert choice is not None and choice.view is near
    assert choice.move_class is TopologyClass.SAME_DOMAIN and choice.move_s > 0
    tight = DecodeView(make_worker("near", domain="d0"), num_free_blocks=12)
    assert choose_decode(10, [far, tight], pre, COSTS).view is far
    assert choose_decode(100, [far, near], pre, COSTS) is None


def _victims(now: float = 10.0) -> list[VictimView]:
    w = make_worker("d0", domain="d0")
    peer = make_worker("d1", domain="d0")
    reqs = [
        make_request("t0", tier=0, prompt=1000, state=RequestState.DECODING),
        make_request("t2", tier=2, prompt=1000, state=RequestState.DECODING),
        make_request("t3", tier=3, prompt=1000, state=RequestState.DECODING),
        make_request("t3-recent", tier=3, prompt=1000, state=RequestState.DECODING,
                     last_preempt_time=now - 0.5),
    ]
    return [VictimView(r, w, num_blocks=40, peer=peer if r.tier == 2 else None,
                       peer_room=100 if r.tier == 2 else 0) for r in reqs]


def test_victims_are_lower_tier_cheapest_and_outside_the_anti_thrash_window() -> None:
    plan = choose_victims(30, _victims(), requester_tier=0, now=10.0, tiers=TIERS,
                          costs=COSTS, est=EST)
    # t2 can migrate over NVLink to a peer: cheaper than swapping t3 even at twice the weight.
    assert [v.req_id for v in plan.victims] == ["t2"] and plan.covers(30)
    plan = choose_victims(70, _victims(), requester_tier=0, now=10.0, tiers=TIERS,
                          costs=COSTS, est=EST)
    assert {v.req_id for v in plan.victims} == {"t2", "t3"}
    assert "t0" not in {v.req_id for v in plan.victims}
    plan = choose_victims(500, _victims(), requester_tier=0, now=10.0, tiers=TIERS,
                          costs=COSTS, est=EST)
    assert not plan.covers(500) and plan.num_freed == 80


def test_mode_is_the_cheapest_restore_path() -> None:
    plan = choose_victims(70, _victims(), requester_tier=0, now=10.0, tiers=TIERS,
                          costs=COSTS, est=EST)
    modes = {v.req_id: v.mode for v in plan.victims}
    assert modes["t2"] is PreemptMode.MIGRATE  # a peer in its NVLink domain has room
    assert modes["t3"] is PreemptMode.SWAP  # swap-in beats re-prefilling 1000 tokens


def test_design_notes_scorer_prefers_little_progress() -> None:
    w = make_worker("d0")
    fresh = make_request("fresh", tier=3, prompt=1000, out=100, state=RequestState.DECODING)
    done = make_request("done", tier=3, prompt=1000, out=100, state=RequestState.DECODING,
                        num_output_tokens=90)
    cands = [VictimView(done, w, 40), VictimView(fresh, w, 40)]
    plan = choose_victims(10, cands, requester_tier=0, now=0.0, tiers=TIERS, costs=COSTS,
                          est=EST, scorer=VictimScorer.DESIGN_NOTES)
    assert [v.req_id for v in plan.victims] == ["fresh"]


def test_kv_pressure_never_evicts_a_more_urgent_tier_than_the_grower() -> None:
    """A tier-3 request that needs a block may not push out a tier-0 one, even when the
    only other victim sits in its anti-thrash window."""
    from scheduler.policies import make_policy
    from scheduler.policy import PolicyContext

    policy = make_policy("tierserve", PolicyContext(TIERS, EST, COSTS, 16))
    w = make_worker("d0")
    t0 = make_request("t0", tier=0, prompt=20, state=RequestState.DECODING)
    t3 = make_request("t3", tier=3, prompt=4000, state=RequestState.DECODING)
    t3_recent = make_request("t3", tier=3, prompt=4000, state=RequestState.DECODING,
                             last_preempt_time=9.5)
    cands = [VictimView(t0, w, 2), VictimView(t3_recent, w, 250)]
    assert policy.on_kv_pressure(1, cands, 10.0, requester_tier=3).victims == ()
    cands = [VictimView(t0, w, 2), VictimView(t3, w, 250)]
    assert policy.on_kv_pressure(1, cands, 10.0, requester_tier=3).victims == ()
    assert [v.req_id for v in policy.on_kv_pressure(1, cands, 10.0, 0).victims] == ["t3"]
    assert [v.req_id for v in policy.on_kv_pressure(1, cands, 10.0, 2).victims] == ["t3"]
