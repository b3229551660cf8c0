"""A decode worker's core stepped by hand, as vLLM's scheduler tests step theirs: hand-made
events in (dispatch, first token, transfer progress, step outputs, preempt and migrate
orders, the time), the core's answers and its request table checked after each. No
engine, no threads, no sleeps."""

from __future__ import annotations

import pytest

from scheduler.kv_ledger import KVCounters
from scheduler.messages import (
    GenerationSpec,
    MigrateIn,
    Prefilled,
    SamplingSpec,
    TokenDelta,
    WorkerEvent,
)
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext
from scheduler.preemption import PreemptMode
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import StepPlan, WorkerScheduler
from scheduler.testing import make_costs
from scheduler.tiers import cpu_tiers
from scheduler.topology import WorkerInfo, WorkerRole
from scheduler.worker_core import (
    ROUTER_GRACE_S,
    TOMBSTONE_S,
    DecodeCore,
    IllegalMove,
    KVVerdict,
    PreemptAction,
    Release,
    SendVerdict,
    Stage,
    StepResult,
    eviction_order,
)

BS = 16
E = WorkerEvent


def make_core(*, can_migrate: bool = False) -> DecodeCore:
    costs = StepCosts((0.02, 2e-3, 0.0, 3e-3, 0.0), prior_weight=1e9)
    pol = make_policy("tierserve", PolicyContext(cpu_tiers(), costs, make_costs(), BS))
    info = WorkerInfo("d0", WorkerRole.DECODE, "n", "cpu", "A", 256)
    ws = WorkerScheduler(info, pol, costs, block_size=BS, max_num_seqs=64,
                         max_num_batched_tokens=2048, chunk_tokens=512)
    core = DecodeCore("d0", ws, bytes_per_block=1024, can_migrate=can_migrate)
    core.router_joined("router-0")
    return core


def spec(rid: str, prompt: int = 40, tier: int = 1) -> GenerationSpec:
    return GenerationSpec(rid, tuple(range(prompt)), SamplingSpec(max_tokens=32), tier, "t",
                          0.0, router_id="router-0")


def request(rid: str, prompt: int = 40, tier: int = 1) -> Request:
    return Request(rid, tier, 0.0, prompt, 32)


def kinds(core: DecodeCore, rid: str) -> list[WorkerEvent]:
    return [ev.event for ev in core.events if ev.req_id == rid]


def received(core: DecodeCore, rid: str, now: float = 1.0) -> None:
    """``rid`` dispatched here with a prefill worker, its first token in, its KV all here."""
    core.receive(request(rid), (1, 2, 3), "p0", now, spec=spec(rid))
    assert core.first_token(Prefilled(rid, 7, None, now + 0.1), now + 0.1)
    assert core.kv_progress(rid, True, now + 0.2) is KVVerdict.JOIN
    core.joined(rid, now + 0.2)


def test_a_prefilled_request_receives_then_decodes() -> None:
    core = make_core()
    core.receive(request("a"), (4, 5, 6), "p0", 1.0, spec=spec("a"))
    assert core.entries["a"].stage is Stage.RECEIVING
    assert core.entries["a"].req.state is RequestState.PREFILLING
    # The KV is here before the first token: it waits for the token.
    assert core.kv_progress("a", True, 1.05) is KVVerdict.WAIT
    assert core.first_token(Prefilled("a", 7, None, 1.1), 1.1)
    # The first token goes to the router at once, before the KV is all here.
    assert core.take_outbox() == [("router-0", (TokenDelta("a", (7,)),))]
    assert core.entries["a"].req.state is RequestState.TRANSFERRING
    assert core.kv_progress("a", None, 1.15) is KVVerdict.WAIT
    assert core.kv_progress("a", True, 1.2) is KVVerdict.JOIN
    core.joined("a", 1.2)
    e = core.entries["a"]
    assert e.stage is Stage.DECODING and e.req.state is RequestState.DECODING
    assert "a" in core.planner.decoding and core.planner.local["a"].num_blocks == 3
    assert kinds(core, "a") == [E.DECODE_START]
    assert [m.to for m in e.history] == [Stage.RECEIVING, Stage.DECODING]


def test_a_first_token_that_is_the_last_ends_the_request_and_drains_its_blocks() -> None:
    core = make_core()
    core.receive(request("a"), (4, 5), "p0", 1.0, spec=spec("a"))
    core.first_token(Prefilled("a", 7, "length", 1.1), 1.1)
    assert core.take_outbox() == []  # the finish goes with the token, once
    assert core.kv_progress("a", None, 1.2) is KVVerdict.ENDED
    assert core.take_outbox() == [("router-0", (TokenDelta("a", (7,), "length"),))]
    assert kinds(core, "a") == [E.FINISHED_LENGTH]
    assert core.entries["a"].stage is Stage.DRAINING and core.get("a") is None
    assert core.is_waiting()
    core.drained("a", 1.3)
    assert "a" not in core.entries


def test_a_failed_transfer_ends_the_request_with_an_error_and_drains() -> None:
    core = make_core()
    core.receive(request("a"), (4, 5), "p0", 1.0, spec=spec("a"))
    core.first_token(Prefilled("a", 7, None, 1.1), 1.1)
    core.take_outbox()
    assert core.kv_progress("a", False, 1.2) is KVVerdict.FAILED
    assert core.abort("a", 1.2, error="transfer_failed") is Release.END_TRANSFER
    assert kinds(core, "a") == [E.TRANSFER_FAILED]
    assert core.take_outbox() == [("router-0", (TokenDelta("a", (), error="transfer_failed"),))]
    assert core.entries["a"].stage is Stage.DRAINING


def test_a_prefill_that_failed_on_the_request_aborts_it() -> None:
    core = make_core()
    core.receive(request("a"), (4,), "p0", 1.0, spec=spec("a"))
    assert not core.first_token(Prefilled("a", 0, None, 1.1, "step_failed: boom"), 1.1)
    assert core.events[-1].event is E.ABORTED and core.events[-1].reason == "step_failed"


def test_an_aborted_id_is_refused_until_its_tombstone_expires() -> None:
    core = make_core()
    received(core, "a")
    assert core.refusal("a") == "known id"
    assert core.abort("a", 2.0) is Release.FREE
    assert "a" not in core.planner.local and core.get("a") is None
    assert core.refusal("a") == "known id"
    core.expire(2.0 + TOMBSTONE_S + 1)
    assert core.refusal("a") is None
    assert core.abort("a", 9.0) is Release.NOTHING


def test_a_local_prefill_decodes_after_its_last_chunk() -> None:
    core = make_core()
    core.prefill_here(request("a", prompt=20), 2, 0, 1.0, spec=spec("a", prompt=20))
    plan = core.plan(1.0, 200)
    assert plan.chunks == (("a", 20),)
    core.step_ran(plan, 1.0, began=1.0, ended=1.05, seconds=0.05, refused=[], blocks={"a": 2},
                  computed={"a": 20}, results=[StepResult("a", TokenDelta("a", (9,)))])
    assert core.entries["a"].stage is Stage.DECODING
    assert core.entries["a"].req.first_token_time == 1.0  # the step's, as the planner commits
    assert kinds(core, "a") == [E.PREFILL_DONE] and core.events[-1].time == 1.05  # out then
    assert core.take_outbox() == [("router-0", (TokenDelta("a", (9,)),))]
    plan = core.plan(1.1, 200)
    assert plan.decodes == ("a",)
    core.step_ran(plan, 1.1, began=1.1, ended=1.12, seconds=0.02, refused=[], blocks={}, computed={},
                  results=[StepResult("a", TokenDelta("a", (3,), "stop"), "stop", True)])
    assert "a" not in core.entries and "a" not in core.planner.local
    assert kinds(core, "a") == [E.PREFILL_DONE, E.FINISHED_STOP]
    # The two steps' time, counted for the planner's busy fraction.
    assert core.step_seconds == pytest.approx(0.07)


def test_a_step_that_failed_on_one_request_ends_it_alone() -> None:
    core = make_core()
    received(core, "a")
    received(core, "b")
    core.take_outbox()
    plan = core.plan(2.0, 200)
    assert set(plan.decodes) == {"a", "b"}
    core.step_ran(plan, 2.0, began=2.0, ended=2.1, seconds=0.1, refused=[], blocks={}, computed={},
                  results=[StepResult("a", error="nan"), StepResult("b", TokenDelta("b", (1,)))])
    assert core.get("a") is None and core.get("b") is not None
    assert kinds(core, "a")[-1] is E.ABORTED
    assert ("router-0", (TokenDelta("a", (), error="step_failed: nan"), TokenDelta("b", (1,)))
            ) in core.take_outbox()
    assert core.planner.costs.num_observed == 0  # a step that ran twice is no cost sample


def test_a_swap_order_swaps_out_holds_the_room_and_swaps_back_in() -> None:
    core = make_core()
    received(core, "a")
    v = core.preempt_order("a", PreemptMode.SWAP, None)
    assert v.ok is None and v.action is PreemptAction.EVICT
    assert eviction_order(PreemptMode.SWAP, False) == (PreemptMode.SWAP, PreemptMode.RECOMPUTE)
    assert eviction_order(PreemptMode.RECOMPUTE, True) == (PreemptMode.SWAP,)
    assert core.evicted("a", PreemptMode.SWAP, "urgent", 3.0, num_blocks=3, seconds=0.01,
                        num_freed=3)
    e = core.entries["a"]
    assert e.stage is Stage.SWAPPED and e.req.state is RequestState.PREEMPTED
    assert "a" in core.planner.swapped and core.planner.num_held(3.0) == 3
    assert core.events[-1].event is E.PREEMPTED_SWAP and core.events[-1].for_req_id == "urgent"
    assert core.refusal("urgent") is None and core.planner.num_held(3.0) == 0
    core.swapped_in("a", 3, 0.01, 3.5)
    assert core.entries["a"].stage is Stage.DECODING and kinds(core, "a")[-1] is E.RESUMED_SWAP
    # A swap order for a request that is not decoding is refused.
    assert core.preempt_order("zz", PreemptMode.SWAP, None).ok is False


def test_a_recompute_prefills_prompt_and_output_again_then_resumes() -> None:
    core = make_core()
    received(core, "a")
    assert core.evicted("a", PreemptMode.RECOMPUTE, None, 3.0)
    e = core.entries["a"]
    assert e.stage is Stage.PREFILLING and e.req.state is RequestState.PREEMPTED
    # A second recompute order finds it recomputing already: done.
    assert core.preempt_order("a", PreemptMode.RECOMPUTE, None).ok is True
    plan = core.plan(3.1, 200)
    (rid, n), = plan.chunks
    assert rid == "a" and n == 41  # prompt (40) + its one output token
    core.step_ran(plan, 3.1, began=3.1, ended=3.3, seconds=0.2, refused=[], blocks={"a": 3},
                  computed={"a": 41}, results=[StepResult("a", TokenDelta("a", (5,)))])
    assert core.entries["a"].stage is Stage.DECODING
    assert kinds(core, "a")[-2:] == [E.PREEMPTED_RECOMPUTE, E.RESUMED_RECOMPUTE]
    (restore,) = core.ledger.report(KVCounters()).restores
    assert restore.mode is PreemptMode.RECOMPUTE and restore.seconds == pytest.approx(0.2)


def test_a_migration_hands_off_or_falls_back_to_a_recompute() -> None:
    core = make_core()
    received(core, "a")
    assert core.preempt_order("a", PreemptMode.MIGRATE, "d1").ok is False  # cannot migrate
    core = make_core(can_migrate=True)
    received(core, "a")
    received(core, "b")
    assert core.preempt_order("a", PreemptMode.MIGRATE, None).ok is False  # no target
    assert core.preempt_order("a", PreemptMode.MIGRATE, "d1").action is PreemptAction.MIGRATE
    core.migrating("a", 3.0)
    assert core.entries["a"].stage is Stage.MIGRATING and "a" not in core.planner.local
    assert core.migration_answered("a", "d1", "urgent", 41, (1, 2, 3), 3.1)
    assert core.send_progress("a", None) is SendVerdict.WAIT
    assert core.send_progress("a", True) is SendVerdict.HANDOFF
    core.handed_off("a", 3, 3.2)
    assert "a" not in core.entries
    ev = core.events[-1]
    assert (ev.event, ev.for_req_id, ev.peer_worker_id) == (E.PREEMPTED_MIGRATE, "urgent", "d1")
    # b: its target is lost mid-transfer: recomputed here, prompt and output.
    core.migrating("b", 4.0)
    assert core.migration_answered("b", "d1", None, 41, (4, 5, 6), 4.1)
    assert core.preempt_order("b", PreemptMode.RECOMPUTE, None).action is PreemptAction.FALL_BACK
    core.fell_back("b", "target_lost", 3, 4.2)
    assert core.entries["b"].stage is Stage.PREFILLING
    assert core.planner.local["b"].num_prefill_left == 42
    assert core.events[-1].event is E.PREEMPTED_RECOMPUTE


def test_a_refused_migration_reattaches_the_request() -> None:
    core = make_core(can_migrate=True)
    received(core, "a")
    blocks = core.planner.local["a"].num_blocks
    core.migrating("a", 3.0)
    assert not core.migration_answered("a", None, None, 41, (1, 2, 3), 3.1)
    core.reattached("a", 41, 3, 3.1)
    assert core.entries["a"].stage is Stage.DECODING
    assert core.planner.local["a"].num_blocks == blocks
    with pytest.raises(IllegalMove):  # a decoding request cannot be reattached again
        core.reattached("a", 41, 3, 3.2)


def test_a_migration_in_restreams_its_output_and_decodes() -> None:
    core = make_core()
    s = spec("m")
    msg = MigrateIn(s, (11, 12, 13), 42, "d1", 0.5)
    assert core.migration_refusal(msg) is None
    assert core.migration_refusal(MigrateIn(s, (), 0, "d1")) is not None
    core.receive(request("m"), (7, 8, 9), "d1", 2.0, spec=s, migrated_in=msg)
    assert core.held() == ()  # still its source's until the handoff
    assert core.kv_progress("m", True, 2.3) is KVVerdict.JOIN
    core.joined("m", 2.3)
    assert kinds(core, "m") == [E.RESUMED_MIGRATE]
    core.emit(core.entries["m"], TokenDelta("m", (14,)))
    assert core.take_outbox() == [("router-0", (TokenDelta("m", (11, 12, 13), start=0),
                                                TokenDelta("m", (14,), start=3)))]
    # A failed move in: dropped silently (the source recomputes it).
    core.receive(request("n"), (1,), "d1", 3.0, spec=spec("n"),
                 migrated_in=MigrateIn(spec("n"), (1,), 40, "d1"))
    assert core.kv_progress("n", False, 3.1) is KVVerdict.DROPPED
    assert [ev for ev in core.events if ev.req_id == "n"] == []


def test_a_request_the_engine_cannot_take_over_ends_alone() -> None:
    core = make_core()
    core.receive(request("a"), (1,), "p0", 1.0, spec=spec("a"))
    core.first_token(Prefilled("a", 1, None, 1.1), 1.1)
    assert core.cannot_join("a", "too long", 1.2) == "invalid: too long"
    core.receive(request("m"), (1,), "d1", 1.0, spec=spec("m"),
                 migrated_in=MigrateIn(spec("m"), (1,), 40, "d1"))
    assert core.cannot_join("m", "too long", 1.2) == "worker_failed"  # its router retries
    assert [(ev.req_id, ev.reason) for ev in core.events] == [("a", "invalid"),
                                                              ("m", "worker_failed")]


def test_a_dead_prefill_worker_takes_only_what_has_not_arrived() -> None:
    core = make_core()
    for rid in ("a", "b", "c"):
        core.receive(request(rid), (1,), "p0", 1.0, spec=spec(rid))
    core.first_token(Prefilled("a", 1, None, 1.1), 1.1)
    core.first_token(Prefilled("b", 1, None, 1.1), 1.1)
    arrived = {"a": True, "b": None, "c": True}
    assert core.lost_source("p0", None, arrived.get) == ["b", "c"]
    assert core.lost_source("p0", ("c",), arrived.get) == ["c"]
    assert core.lost_source("p9", None, arrived.get) == []


def test_a_router_that_stays_away_loses_its_requests() -> None:
    core = make_core()
    core.router_left("router-0", 1.0)
    received(core, "a", now=1.0)
    assert core.expire(1.0 + ROUTER_GRACE_S - 1) == []
    assert core.expire(1.0 + ROUTER_GRACE_S + 1) == ["a"]
    assert core.events[-1].reason == "reader_gone"
    assert core.take_outbox() == []  # nobody reads its tokens


def test_a_report_keeps_its_events_until_delivered() -> None:
    core = make_core()
    received(core, "a")
    rep = core.report(100, 256, KVCounters())
    assert [ev.event for ev in rep.events] == [E.DECODE_START]
    assert [(r.req_id, r.num_blocks) for r in rep.running] == [("a", 3)]
    core.delivered(rep, False)
    assert len(core.events) == 1
    core.abort("a", 5.0)
    core.delivered(core.report(100, 256, KVCounters()), True)
    assert core.events == []


def test_the_planner_victims_go_swap_else_recompute() -> None:
    from scheduler.preemption import Victim
    core = make_core()
    plan = StepPlan(preempt=(Victim("a", PreemptMode.SWAP, 2, 1.0),
                             Victim("b", PreemptMode.MIGRATE, 2, 1.0)))
    assert core.victims(plan) == [("a", PreemptMode.SWAP), ("b", PreemptMode.RECOMPUTE)]
