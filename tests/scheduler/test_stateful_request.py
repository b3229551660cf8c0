"""Stateful property test of the request state machine (scheduler.request).

Hypothesis drives a handful of requests through arbitrary attempted moves; a
model tracks what must hold: only moves in ALLOWED_TRANSITIONS succeed, an
illegal one raises IllegalTransition and changes nothing, terminal states absorb,
and preemptions are counted (entering PREEMPTING, or PREEMPTED straight from a
running state) with the time of the last one kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from scheduler.invariants import check_transitions
from scheduler.request import (
    ALLOWED_TRANSITIONS,
    Decision,
    IllegalTransition,
    Request,
    RequestState,
    transition,
)
from scheduler.testing import make_request

S = RequestState
STATES = list(RequestState)


@dataclass
class Expected:
    state: RequestState
    num_records: int = 0
    num_preemptions: int = 0
    last_preempt_time: float | None = None
    finish_time: float | None = None


def _snapshot(r: Request) -> tuple:
    return (r.state, len(r.history), r.num_preemptions, r.last_preempt_time, r.finish_time)


class RequestMachine(RuleBasedStateMachine):
    reqs = Bundle("reqs")

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.expected: dict[str, Expected] = {}
        self.live: dict[str, Request] = {}
        self.terminal_seen: set[str] = set()

    @rule(target=reqs, tier=st.integers(0, 3))
    def new_request(self, tier: int) -> Request:
        r = make_request(f"r{len(self.live)}", tier=tier, arrival=self.now)
        self.live[r.req_id] = r
        self.expected[r.req_id] = Expected(S.QUEUED)
        return r

    @rule(dt=st.floats(0.0, 2.0, allow_nan=False))
    def advance(self, dt: float) -> None:
        self.now += dt

    @rule(r=reqs, to=st.sampled_from(STATES), decision=st.sampled_from(list(Decision)))
    def attempt(self, r: Request, to: RequestState, decision: Decision) -> None:
        exp = self.expected[r.req_id]
        before = _snapshot(r)
        frm = r.state
        if to in ALLOWED_TRANSITIONS[frm]:
            rec = transition(r, to, decision=decision, triggered_by="test", now=self.now)
            assert (rec.from_state, rec.to_state, rec.decision, rec.time) == (frm, to, decision,
                                                                              self.now)
            assert r.history[-1] is rec
            exp.state = to
            exp.num_records += 1
            if to is S.PREEMPTING or (to is S.PREEMPTED and frm is not S.PREEMPTING):
                exp.num_preemptions += 1
                exp.last_preempt_time = self.now
            if to.is_finished:
                exp.finish_time = self.now
        else:
            try:
                transition(r, to, decision=decision, triggered_by="test", now=self.now)
            except IllegalTransition:
                pass
            else:
                raise AssertionError(f"{frm} -> {to} was allowed")
            assert _snapshot(r) == before, "a refused move changed the request"

    @rule(r=reqs)
    def terminal_absorbs(self, r: Request) -> None:
        if not r.state.is_finished:
            return
        self.terminal_seen.add(r.req_id)
        for to in STATES:
            try:
                transition(r, to, decision=Decision.ERROR, triggered_by="test", now=self.now)
            except IllegalTransition:
                continue
            raise AssertionError(f"terminal {r.state} moved to {to}")

    @invariant()
    def matches_model(self) -> None:
        for req_id, r in self.live.items():
            exp = self.expected[req_id]
            assert r.state is exp.state
            assert len(r.history) == exp.num_records
            assert r.num_preemptions == exp.num_preemptions
            assert r.last_preempt_time == exp.last_preempt_time
            assert r.finish_time == exp.finish_time
            assert check_transitions(r.history) == []
            # A request's records chain: each starts where the previous ended.
            states = [S.QUEUED] + [h.to_state for h in r.history]
            assert [h.from_state for h in r.history] == states[:-1]


TestRequestMachine = RequestMachine.TestCase
TestRequestMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
