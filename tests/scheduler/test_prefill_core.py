"""A prefill worker's core stepped by hand: a prompt queued, its chunks run, its first
token out to its decode worker, its blocks released once its KV is sent. No engine."""

from __future__ import annotations

import pytest

from scheduler.messages import GenerationSpec, SamplingSpec, TokenDelta, WorkerEvent
from scheduler.policies import make_policy
from scheduler.policy import PolicyContext
from scheduler.prefill_core import PrefillCore, PrefillOutput, PrefillStage
from scheduler.request import Request, RequestState
from scheduler.step_costs import StepCosts
from scheduler.step_planner import WorkerScheduler
from scheduler.testing import make_costs
from scheduler.tiers import cpu_tiers
from scheduler.topology import WorkerInfo, WorkerRole

BS = 16


def make_core(chunk: int = 512) -> PrefillCore:
    costs = StepCosts((0.02, 2e-3, 0.0, 3e-3, 0.0), prior_weight=1e9)
    pol = make_policy("tierserve", PolicyContext(cpu_tiers(), costs, make_costs(), BS))
    info = WorkerInfo("p0", WorkerRole.PREFILL, "n", "cpu", "A", 256)
    return PrefillCore("p0", WorkerScheduler(info, pol, costs, block_size=BS, max_num_seqs=64,
                                             max_num_batched_tokens=chunk, chunk_tokens=chunk))


def start(core: PrefillCore, rid: str, prompt: int, n: int = 1, now: float = 1.0) -> None:
    spec = GenerationSpec(rid, tuple(range(prompt)), SamplingSpec(max_tokens=8, n=n), 1, "t",
                          0.0, router_id="r")
    assert core.start(spec, Request(rid, 1, 0.0, prompt, 8), "d0", now) is None


def test_a_prompt_is_prefilled_in_chunks_and_its_first_token_goes_to_its_decode_worker() -> None:
    core = make_core(chunk=32)
    start(core, "a", 48)
    assert core.jobs["a"].stage is PrefillStage.PREFILLING
    assert core.jobs["a"].req.state is RequestState.PREFILLING
    plan = core.plan(1.0, 100)
    assert plan.chunks == (("a", 32),)
    core.began(plan, 1.01)
    out = core.step_ran(plan, 1.0, seconds=0.05, refused=[], blocks={"a": 3}, computed={"a": 32},
                        outputs=[PrefillOutput("a", (0, 1))], t=1.06)
    assert out.pushes == [("a", (0, 1))] and out.firsts == {} and core.events == []
    plan = core.plan(1.1, 100)
    assert plan.chunks == (("a", 16),)
    core.began(plan, 1.11)  # not its first chunk: its start stays
    delta = TokenDelta("a", (9,))
    out = core.step_ran(plan, 1.1, seconds=0.03, refused=[], blocks={"a": 3},
                        computed={"a": 48}, outputs=[PrefillOutput("a", (2,), True, 9, None,
                                                                   delta)], t=1.14)
    assert out.pushes == [("a", (2,))]
    (item,) = out.firsts["d0"]
    assert (item.req_id, item.first_token, item.finish, item.deltas) == ("a", 9, None, (delta,))
    (ev,) = core.events
    assert (ev.event, ev.received, ev.started) == (WorkerEvent.PREFILL_DONE, 1.0, 1.01)
    assert core.jobs["a"].stage is PrefillStage.SENDING and "a" not in core.planner.local
    rep = core.report(10, 16, None)  # type: ignore[arg-type]
    assert rep.running == () and rep.step_seconds == pytest.approx(0.08)
    core.end("a", "sent", 1.2)
    assert core.jobs == {}


def test_a_first_token_that_is_the_last_finishes_only_a_one_sequence_request() -> None:
    core = make_core()
    start(core, "one", 16)
    start(core, "two", 16, n=2)
    plan = core.plan(1.0, 100)
    outs = [PrefillOutput("one", (), True, 5, "stop"), PrefillOutput("two", (), True, 5, "stop"),
            PrefillOutput("two", (), True, 6, "stop")]
    out = core.step_ran(plan, 1.0, seconds=0.05, refused=[], blocks={}, computed={},
                        outputs=outs, t=1.1)
    assert [(p.req_id, p.finish) for p in out.firsts["d0"]] == [("one", "stop"), ("two", None)]


def test_a_request_that_fails_the_step_alone_ends_with_its_error() -> None:
    core = make_core()
    start(core, "bad", 16)
    start(core, "good", 16)
    plan = core.plan(1.0, 100)
    out = core.step_ran(plan, 1.0, seconds=0.05, refused=[], blocks={}, computed={},
                        outputs=[PrefillOutput("bad", error="nan"), PrefillOutput("good", (0,))],
                        t=1.1)
    assert out.dropped == ["bad"] and "bad" not in core.jobs
    assert [p.error for p in out.firsts["d0"]] == ["step_failed: nan"]
    assert core.planner.costs.num_observed == 0  # it ran twice: no cost sample
    assert core.start(core.jobs["good"].spec, Request("good", 1, 0.0, 16, 8), "d0", 2.0) \
        == "invalid: duplicate request id"


def test_an_undelivered_report_keeps_its_events() -> None:
    core = make_core()
    start(core, "a", 16)
    plan = core.plan(1.0, 100)
    core.step_ran(plan, 1.0, seconds=0.05, refused=[], blocks={}, computed={},
                  outputs=[PrefillOutput("a", (), True, 3)], t=1.1)
    rep = core.report(10, 16, None)  # type: ignore[arg-type]
    core.delivered(rep, False)
    assert len(core.events) == 1
    core.delivered(rep, True)
    assert core.events == []
    assert core.fail("zz", "x", 2.0) is None
