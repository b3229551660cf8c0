"""The state machine refuses illegal moves and records why; tier configs name bad fields."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.request import (
    ALLOWED_TRANSITIONS,
    Decision,
    IllegalTransition,
    Request,
    RequestState,
    transition,
)
from scheduler.tiers import ConfigError, TierConfig, TierSpec, default_tiers


def make_request(**kw: object) -> Request:
    base = dict(req_id="r1", tier=0, arrival_time=0.0, prompt_len=40, max_new_tokens=8)
    base.update(kw)
    return Request(**base)  # type: ignore[arg-type]


def test_happy_path_records_every_move() -> None:
    req = make_request()
    path = [
        (RequestState.PREFILLING, Decision.SCHEDULE_PREFILL),
        (RequestState.TRANSFERRING, Decision.START_TRANSFER),
        (RequestState.DECODING, Decision.START_DECODE),
        (RequestState.FINISHED_LENGTH, Decision.FINISH_LENGTH),
    ]
    for i, (to, decision) in enumerate(path):
        rec = transition(req, to, decision=decision, triggered_by="test", now=float(i),
                         mem_pressure=0.5, kv_reuse_hit=2)
        assert rec.to_state is to and rec.time == float(i)
    assert [r.to_state for r in req.history] == [to for to, _ in path]
    assert req.finish_time == 3.0
    assert RequestState.FINISHED_LENGTH.is_finished


def test_illegal_move_is_refused_and_changes_nothing() -> None:
    req = make_request()
    with pytest.raises(IllegalTransition):
        transition(req, RequestState.DECODING, decision=Decision.START_DECODE,
                   triggered_by="test", now=0.0)
    assert req.state is RequestState.QUEUED and req.history == []


def test_terminal_states_have_no_exit() -> None:
    for state in RequestState:
        if state.is_finished:
            assert ALLOWED_TRANSITIONS[state] == frozenset()
        else:
            assert RequestState.ABORTED in ALLOWED_TRANSITIONS[state]


def test_preemption_counts_once_per_preemption() -> None:
    req = make_request(state=RequestState.DECODING)
    transition(req, RequestState.PREEMPTING, decision=Decision.PREEMPT_SWAP, triggered_by="t", now=1.0)
    transition(req, RequestState.PREEMPTED, decision=Decision.PREEMPT_DONE, triggered_by="t", now=1.1)
    assert req.num_preemptions == 1 and req.last_preempt_time == 1.0
    transition(req, RequestState.DECODING, decision=Decision.RESUME_SWAP_IN, triggered_by="t", now=2.0)
    assert req.num_preemptions == 1


def test_decision_record_round_trips_through_plain_types() -> None:
    req = make_request()
    rec = transition(req, RequestState.PREFILLING, decision=Decision.SCHEDULE_PREFILL,
                     triggered_by="arrival", now=0.25, blocking_req_id="r0")
    assert type(rec).from_dict(rec.to_dict()) == rec


def test_default_tiers_follow_the_design() -> None:
    cfg = default_tiers()
    assert cfg.num_tiers == 4
    assert cfg[0].ttft_s == 0.2 and cfg[0].tpot_s == 0.05
    assert abs(sum(cfg.shares()) - 1.0) < 1e-9


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda t: t[:1], "tiers"),
        (lambda t: t + t + t, "tiers"),
        (lambda t: (dataclasses.replace(t[0], share=0.5),) + t[1:], "share"),
        (lambda t: (dataclasses.replace(t[0], ttft_s=-1.0),) + t[1:], "tiers[0].ttft_s"),
        (lambda t: (dataclasses.replace(t[0], ttft_s=None),) + t[1:], "tiers[0]"),
    ],
)
def test_invalid_tier_configs_name_the_field(change, field) -> None:  # type: ignore[no-untyped-def]
    tiers = default_tiers().tiers
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        TierConfig(tiers=change(tiers))


def test_tierspec_deadline_prefers_end_to_end() -> None:
    t = TierSpec("x", ttft_s=1.0, tpot_s=None, e2e_s=5.0, share=1.0, weight=1.0)
    assert t.deadline_s == 5.0
