"""KV memory decisions of the kernel: victims priced by where their blocks are and could
come back from (swap space left, a peer with room, blocks another request shares), link
costs learned from the workers' measurements, and a migration's life in the cluster
scheduler (ordered, promised on the target, handed off in either order of reports,
refused, failed, or lost with its target)."""

from __future__ import annotations

from scheduler.cluster_scheduler import ClusterScheduler, NewRequest
from scheduler.links import LinkModel
from scheduler.messages import (
    KVMemoryReport,
    LinkKind,
    LinkSample,
    ReqEvent,
    RunningReq,
    WorkerEvent,
    WorkerReport,
)
from scheduler.preemption import PreemptMode, VictimView, choose_victims
from scheduler.request import Decision, RequestState
from scheduler.testing import EST, make_costs, make_request, make_worker
from scheduler.tiers import default_tiers
from scheduler.topology import TopologyClass, WorkerInfo, WorkerRole

TIERS = default_tiers()
COSTS = make_costs()
BS = 16


def _pick(cands, need=10, **kw):
    return choose_victims(need, cands, requester_tier=0, now=10.0, tiers=TIERS, costs=COSTS,
                          est=EST, **kw)


def test_a_swap_that_does_not_fit_the_swap_space_is_never_chosen() -> None:
    w = make_worker("d0")
    big = make_request("big", tier=3, prompt=4000, state=RequestState.DECODING)
    assert _pick([VictimView(big, w, 40)]).victims[0].mode is PreemptMode.SWAP
    plan = _pick([VictimView(big, w, 40, swap_room=39)])
    assert [v.mode for v in plan.victims] == [PreemptMode.RECOMPUTE]


def test_victims_of_one_plan_share_the_swap_space_and_the_peers_room() -> None:
    w, peer = make_worker("d0"), make_worker("d1", domain="d0")
    reqs = [make_request(f"v{i}", tier=3, prompt=4000, state=RequestState.DECODING)
            for i in range(3)]
    plan = _pick([VictimView(r, w, 30, swap_room=40) for r in reqs], need=90)
    modes = sorted(v.mode.value for v in plan.victims)
    assert modes == ["recompute", "recompute", "swap"]  # only one fits the 40 blocks
    plan = _pick([VictimView(r, w, 30, peer=peer, peer_room=70, swap_room=0) for r in reqs],
                 need=90)
    modes = sorted(v.mode.value for v in plan.victims)
    assert modes == ["migrate", "migrate", "recompute"]  # the peer holds two of them
    assert {v.peer_id for v in plan.victims if v.mode is PreemptMode.MIGRATE} == {"d1"}


def test_the_victim_with_the_most_slack_per_second_of_restore_goes_first() -> None:
    """Issue 22: victims were priced by tier weight x restore cost alone, so of two
    batch requests with the same restore the one nearer its 30 s target could be taken;
    now the one with more slack goes, and a victim the restore would make late costs
    most."""
    w = make_worker("d0")
    late = make_request("late", tier=2, arrival=-18.0, prompt=1000, out=10,
                        state=RequestState.DECODING)  # 30 s target, 2 s left at t=10
    fresh = make_request("fresh", tier=2, arrival=9.5, prompt=1000, out=10,
                         state=RequestState.DECODING)
    modes = frozenset({PreemptMode.RECOMPUTE})
    plan = _pick([VictimView(late, w, 40), VictimView(fresh, w, 40)], need=10, modes=modes)
    assert [v.req_id for v in plan.victims] == ["fresh"]
    # A more urgent tier with far more slack still goes after a batch request only if
    # its weight per second of slack is higher: tier 3 (weight 1) with its 600 s target
    # before the fresh tier-2 request (weight 2, 30 s).
    best = make_request("best", tier=3, arrival=9.5, prompt=1000, out=10,
                        state=RequestState.DECODING)
    plan = _pick([VictimView(fresh, w, 40), VictimView(best, w, 40)], need=10, modes=modes)
    assert [v.req_id for v in plan.victims] == ["best"]
    # One whose restore (a 1,000-token recompute) would take longer than the slack it
    # has left costs many times more than the same restore with time to spare.
    ends = make_request("ends", tier=2, arrival=-19.97, prompt=1000, out=10,
                        state=RequestState.DECODING)
    cost = _pick([VictimView(ends, w, 40)], need=10, modes=modes).victims[0].cost
    assert cost > _pick([VictimView(fresh, w, 40)], need=10, modes=modes).victims[0].cost * 5


def test_a_victim_sharing_its_prefix_frees_less_and_recomputes_cheaper() -> None:
    w = make_worker("d0")
    alone = make_request("alone", tier=3, prompt=1000, state=RequestState.DECODING)
    shared = make_request("shared", tier=3, prompt=1000, state=RequestState.DECODING)
    cands = [VictimView(alone, w, 64), VictimView(shared, w, 64, num_shared_blocks=48)]
    plan = _pick(cands, need=60, modes=frozenset({PreemptMode.RECOMPUTE}))
    # Per block freed, the shared one costs more (it frees 16 of its 64): "alone" goes.
    assert [(v.req_id, v.num_blocks) for v in plan.victims] == [("alone", 64)]
    plan = _pick([VictimView(shared, w, 64, num_shared_blocks=48)], need=10,
                 modes=frozenset({PreemptMode.RECOMPUTE}))
    assert plan.num_freed == 16
    full = _pick([VictimView(alone, w, 64)], need=10, modes=frozenset({PreemptMode.RECOMPUTE}))
    assert plan.victims[0].cost < full.victims[0].cost  # 3/4 of it stays cached


def test_link_model_moves_off_its_prior_with_measured_moves() -> None:
    links = LinkModel(COSTS)
    prior = links.move_s(10, TopologyClass.SAME_NODE)
    assert prior == COSTS.move_s(10, TopologyClass.SAME_NODE)
    nbytes = 10 * COSTS.bytes_per_block
    links.observe_move(TopologyClass.SAME_NODE, nbytes, 2.0)  # ~50x slower than the prior
    assert abs(links.move_s(10, TopologyClass.SAME_NODE) - 2.0) < 1e-6
    assert links.move_s(10, TopologyClass.SAME_DOMAIN) == COSTS.move_s(10,
                                                                       TopologyClass.SAME_DOMAIN)
    # Moves of several sizes separate the fixed cost from the bandwidth: 5 ms + 1 GB/s.
    for n in (1, 4, 16, 64, 2, 32):
        links.observe_move(TopologyClass.CROSS_NODE, n << 20, 0.005 + (n << 20) / 1e9)
    est = links.links[TopologyClass.CROSS_NODE]
    assert abs(est.latency_s - 0.005) < 1e-4 and abs(est.bw / 1e9 - 1.0) < 0.01
    # Several sizes at one time (a busy host's fixed cost, not the wire's): the latency
    # takes it, the bandwidth stays the prior's, so a big move is not priced as if every
    # byte had paid it.
    for n in (4, 64, 16, 128, 8, 96):
        links.observe_move(TopologyClass.SAME_DOMAIN, n * COSTS.bytes_per_block, 0.3)
    est = links.links[TopologyClass.SAME_DOMAIN]
    assert est.bw == COSTS.bw[TopologyClass.SAME_DOMAIN] and 0.25 < est.latency_s <= 0.3
    links.observe_swap(nbytes, 0.5)
    assert abs(links.swap_s(10) - 0.5) < 0.01
    assert links.snapshot()["same_node"]["num_samples"] == 1


# -- the cluster scheduler -------------------------------------------------------------


def _cluster(migration: bool = True) -> ClusterScheduler:
    """A prefill worker and d0 in domain A, d1 in domain B, 64 blocks each."""
    cs = ClusterScheduler(TIERS, "tierserve", BS, COSTS, migration=migration)
    cs.add_worker(WorkerInfo("p0", WorkerRole.PREFILL, "n", "cuda:0", "A", 256), 256,
                  can_prefill=True, can_decode=False)
    for wid, dev, dom in (("d0", "cuda:1", "A"), ("d1", "cuda:2", "B")):
        cs.add_worker(WorkerInfo(wid, WorkerRole.DECODE, "n", dev, dom, 64), 64,
                      can_prefill=False, can_decode=True)
    return cs


def _held(cs: ClusterScheduler, worker: str, free: int, running: dict[str, int],
          now: float, events=(), memory: KVMemoryReport | None = None) -> None:
    cs.on_report(WorkerReport(worker, free, 64, events=tuple(events),
                              running=tuple(RunningReq(r, n, 1) for r, n in running.items()),
                              memory=memory), now)


def _decoding(cs: ClusterScheduler, rid: str, tier: int, prompt: int, worker: str,
              free: int, running: dict[str, int], now: float) -> None:
    """Submit ``rid`` and walk it to DECODING on ``worker``, which then holds
    ``running`` with ``free`` blocks free."""
    assert cs.submit(NewRequest(rid, tier, now, prompt, 512), now).accepted
    for d in cs.plan(now).dispatches:
        assert d.req_id == rid and d.decode_worker_id == worker, d
        cs.on_dispatch_result(rid, True, now)
    cs.on_report(WorkerReport("p0", 256, 256, events=(
        ReqEvent(rid, WorkerEvent.PREFILL_DONE, now),)), now)
    _held(cs, worker, free, running, now,
          events=(ReqEvent(rid, WorkerEvent.DECODE_START, now),))
    assert cs.get(rid).state is RequestState.DECODING


def _pressure(cs: ClusterScheduler) -> None:
    """d0 holds two tier-3 decodes (20 + 30 blocks, 14 free); d1 has 40 free; a tier-0
    arrival needs 44 blocks: no decode worker has them."""
    _decoding(cs, "low", 3, 300, "d0", 44, {"low": 20}, 0.0)
    _decoding(cs, "low2", 3, 460, "d0", 14, {"low": 20, "low2": 30}, 0.1)
    _held(cs, "d1", 40, {}, 0.1)
    assert cs.submit(NewRequest("top", 0, 5.0, 700, 16), 5.0).accepted


def test_a_victim_migrates_to_a_peer_with_room_and_its_blocks_are_promised_there() -> None:
    cs = _cluster()
    _pressure(cs)
    plan = cs.plan(5.0)
    assert not plan.dispatches
    orders = [(p.req_id, p.worker_id, p.mode, p.target_worker_id, p.for_req_id)
              for p in plan.preempts]
    assert orders == [("low2", "d0", PreemptMode.MIGRATE, "d1", "top")]
    d1 = cs.workers["d1"]
    assert d1.held["low2"] == 30 and d1.free_blocks == 10  # promised until reserved there
    assert not cs.plan(5.01).preempts  # the need is being met: no second victim
    cs.on_preempt_result("low2", "d0", True, 5.02)
    _held(cs, "d1", 10, {"low2": 30}, 5.03)  # the target's report shows it reserved
    assert d1.num_promised == 0 and d1.free_blocks == 10
    # The target says it decodes before the source says it let go: one preemption.
    _held(cs, "d1", 9, {"low2": 31}, 5.1, events=(ReqEvent("low2", WorkerEvent.RESUMED_MIGRATE,
                                                           5.1),))
    req = cs.get("low2")
    assert req.state is RequestState.DECODING and req.decode_worker_id == "d1"
    _held(cs, "d0", 44, {"low": 20}, 5.2, events=(
        ReqEvent("low2", WorkerEvent.PREEMPTED_MIGRATE, 5.2, for_req_id="top",
                 peer_worker_id="d1"),))
    decisions = [r.decision for r in req.history]
    assert decisions.count(Decision.PREEMPT_MIGRATE) == 1
    assert decisions[-3:] == [Decision.PREEMPT_MIGRATE, Decision.PREEMPT_DONE,
                              Decision.RESUME_MIGRATE]
    assert "low2" not in cs.workers["d0"].held and cs.num_preemptions == 1
    assert [d.req_id for d in cs.plan(5.3).dispatches] == ["top"]  # room on d0 now


def test_the_usual_order_of_reports_walks_the_same_states() -> None:
    cs = _cluster()
    _pressure(cs)
    cs.plan(5.0)
    cs.on_preempt_result("low2", "d0", True, 5.02)
    _held(cs, "d0", 44, {"low": 20}, 5.1, events=(
        ReqEvent("low2", WorkerEvent.PREEMPTED_MIGRATE, 5.1, for_req_id="top",
                 peer_worker_id="d1"),))
    assert cs.get("low2").state is RequestState.PREEMPTED
    assert cs.get("low2").decode_worker_id == "d1"  # handed off: the target owns it
    _held(cs, "d1", 9, {"low2": 31}, 5.2, events=(ReqEvent("low2", WorkerEvent.RESUMED_MIGRATE,
                                                           5.2),))
    req = cs.get("low2")
    assert req.state is RequestState.DECODING and req.decode_worker_id == "d1"
    assert cs.workers["d1"].num_promised == 0


def test_a_refused_migration_frees_the_blocks_promised_on_the_target() -> None:
    cs = _cluster()
    _pressure(cs)
    cs.plan(5.0)
    cs.on_preempt_result("low2", "d0", False, 5.02)
    d1 = cs.workers["d1"]
    assert "low2" not in d1.held and d1.num_promised == 0 and d1.free_blocks == 40
    assert cs.get("low2").state is RequestState.DECODING
    assert cs.get("low2").decode_worker_id == "d0"


def test_a_source_that_falls_back_to_recompute_cancels_the_migration() -> None:
    cs = _cluster()
    _pressure(cs)
    cs.plan(5.0)
    cs.on_preempt_result("low2", "d0", True, 5.02)
    _held(cs, "d0", 44, {"low": 20, "low2": 0}, 5.1, events=(
        ReqEvent("low2", WorkerEvent.PREEMPTED_RECOMPUTE, 5.1, for_req_id="top",
                 reason="transfer failed"),))
    assert cs.get("low2").state is RequestState.PREEMPTED
    assert "low2" not in cs.workers["d1"].held and cs.workers["d1"].num_promised == 0


def test_a_target_that_dies_mid_migration_sends_the_request_back_to_recompute() -> None:
    cs = _cluster()
    _pressure(cs)
    cs.plan(5.0)
    cs.on_preempt_result("low2", "d0", True, 5.02)
    assert cs.remove_worker("d1", 5.1) == []  # the request is still the source's
    plan = cs.plan(5.1)
    assert [(p.req_id, p.worker_id, p.mode, p.for_req_id) for p in plan.preempts] == [
        ("low2", "d0", PreemptMode.RECOMPUTE, None)]
    assert cs.get("low2") is not None
    # The source no longer had it (it had handed it off to the dead target): it ends with
    # a retryable error, so its router retries it by recompute on the live workers.
    cs.on_preempt_result("low2", "d0", False, 5.2)
    assert cs.get("low2") is None
    aborts = cs.plan(5.2).aborts
    assert [(a.req_id, a.error) for a in aborts] == [("low2", "worker_failed")]


def test_a_target_that_dies_after_the_handoff_takes_the_request_with_it() -> None:
    """The source handed the request off and freed its blocks; the target died before it
    said it decodes: the request ends with worker_failed (its router retries it)."""
    cs = _cluster()
    _pressure(cs)
    cs.plan(5.0)
    cs.on_preempt_result("low2", "d0", True, 5.02)
    _held(cs, "d0", 44, {"low": 20}, 5.1, events=(
        ReqEvent("low2", WorkerEvent.PREEMPTED_MIGRATE, 5.1, for_req_id="top",
                 peer_worker_id="d1"),))
    assert cs.remove_worker("d1", 5.2) == ["low2"]
    assert [(a.req_id, a.error) for a in cs.plan(5.2).aborts] == [("low2", "worker_failed")]


def test_a_handoff_to_a_worker_already_gone_ends_the_request() -> None:
    cs = _cluster()
    _pressure(cs)
    cs.remove_worker("d1", 5.0)
    _held(cs, "d0", 44, {"low": 20}, 5.1, events=(
        ReqEvent("low2", WorkerEvent.PREEMPTED_MIGRATE, 5.1, peer_worker_id="d1"),))
    assert cs.get("low2") is None
    assert [(a.req_id, a.error) for a in cs.plan(5.1).aborts] == [("low2", "worker_failed")]


def test_the_source_dying_mid_migration_frees_the_target_reservation() -> None:
    cs = _cluster()
    _pressure(cs)
    cs.plan(5.0)
    cs.on_preempt_result("low2", "d0", True, 5.02)
    assert set(cs.remove_worker("d0", 5.1)) == {"low", "low2"}
    aborts = {a.req_id: a for a in cs.plan(5.1).aborts}
    assert "d1" in aborts["low2"].worker_ids and aborts["low2"].error == "worker_failed"
    assert "low2" not in cs.workers["d1"].held and cs.workers["d1"].num_promised == 0


def test_without_migration_a_victim_is_swapped_or_recomputed() -> None:
    cs = _cluster(migration=False)
    _pressure(cs)
    plan = cs.plan(5.0)
    assert plan.preempts and all(p.mode is not PreemptMode.MIGRATE for p in plan.preempts)
    assert all(p.target_worker_id is None for p in plan.preempts)


def test_a_full_swap_space_and_no_peer_room_leave_recompute() -> None:
    cs = _cluster()
    _pressure(cs)
    full = KVMemoryReport(num_swap_blocks=8, num_swap_used=8, num_swap_peak=8)
    _held(cs, "d0", 14, {"low": 20, "low2": 30}, 4.9, memory=full)
    _held(cs, "d1", 12, {}, 4.9)  # no room for either victim there
    plan = cs.plan(5.0)
    assert plan.preempts and all(p.mode is PreemptMode.RECOMPUTE for p in plan.preempts)
    assert cs.workers["d0"].swap_room == 0


def test_measured_moves_and_swaps_reach_the_link_model() -> None:
    cs = _cluster()
    nbytes = 20 * COSTS.bytes_per_block
    before = cs.links.move_s(20, TopologyClass.SAME_NODE)
    _held(cs, "d0", 64, {}, 1.0, memory=KVMemoryReport(
        None, 0, 0, link_samples=(LinkSample(LinkKind.MOVE, nbytes, 3.0, "d1"),
                                  LinkSample(LinkKind.SWAP_IN, nbytes, 1.5))))
    # d0 (domain A) to d1 (domain B) on one node: the same-node link learned it.
    assert cs.links.move_s(20, TopologyClass.SAME_NODE) > 100 * before
    assert abs(cs.links.swap_s(20) - 1.5) < 0.05
    assert cs.workers["d0"].swap_room is None  # unbounded: not reported
    assert cs.policy.ctx.costs is cs.links  # the policy prices with the measured links


def test_blocks_a_worker_reports_shared_are_priced_as_shared() -> None:
    """low2's 30 blocks are mostly a prefix another request there holds too: preempting
    it would free 2, so low and low2 together cannot make the 30 blocks the arrival
    needs, and nothing is preempted for nothing."""
    cs = _cluster()
    _pressure(cs)
    cs.on_report(WorkerReport("d0", 14, 64, running=(
        RunningReq("low", 20, 1), RunningReq("low2", 30, 1, num_shared_blocks=28))), 4.9)
    assert cs.workers["d0"].shared == {"low2": 28}
    assert not cs.plan(5.0).preempts
    cs.on_report(WorkerReport("d0", 14, 64, running=(RunningReq("low", 20, 1),
                                                     RunningReq("low2", 30, 1))), 5.1)
    assert cs.workers["d0"].shared == {}
    assert [p.req_id for p in cs.plan(5.2).preempts] == ["low2"]
