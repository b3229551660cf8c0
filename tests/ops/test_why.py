"""cluster/why.py: the causal chain names the blocker, the preemption mode and the transfer."""

from __future__ import annotations

import dataclasses
import json

import msgpack
import pytest

from cluster.why import (
    PhaseKind,
    RequestLog,
    StepKind,
    WhyReport,
    explain,
    ms,
    phases,
)
from scheduler.request import Decision, Request, RequestState, transition
from scheduler.tiers import default_tiers


def test_late_tier0_request_names_blocker_mode_and_transfer(scenario) -> None:
    report = explain("X", scenario.logs, default_tiers())
    assert report is not None
    assert report.text.startswith("tier-0 request X waited 420 ms: KV full on decode-1; "
                                  "preempted tier-3 request Y (swap, 80 ms); ")
    assert "transfer crossed NVLink domains (30 ms, prefill-0 -> decode-1)" in report.text
    assert report.late is True
    assert report.waited_s == pytest.approx(0.42)
    assert report.ttft_s == pytest.approx(0.47)
    kinds = [s.kind for s in report.steps]
    assert kinds.index(StepKind.KV_FULL) < kinds.index(StepKind.PREEMPTED_OTHER) < kinds.index(
        StepKind.TRANSFER)
    pre = next(s for s in report.steps if s.kind is StepKind.PREEMPTED_OTHER)
    assert (pre.other_req_id, pre.detail["mode"]) == ("Y", "swap")
    assert pre.duration_s == pytest.approx(0.08)
    tr = next(s for s in report.steps if s.kind is StepKind.TRANSFER)
    assert tr.detail["topology_class"] == "same_node"
    # The blocker is the preempted victim, so it is not also reported as "waited on".
    assert not any(s.kind is StepKind.WAITED_ON for s in report.steps)
    assert report.steps[-1].text == "late: TTFT 470 ms vs 200 ms target"


def test_victim_is_told_who_preempted_it_and_how_it_resumed(scenario) -> None:
    report = explain("Y", scenario.logs, default_tiers())
    step = next(s for s in report.steps if s.kind is StepKind.PREEMPTED)
    assert step.text == "was preempted for tier-0 request X (swap, 400 ms), resumed by swap-in"
    assert step.other_req_id == "X"
    assert report.late is False and report.text.endswith("on time: end to end 2 s vs 10 min target")


def test_report_and_log_survive_json_and_msgpack(scenario) -> None:
    report = explain("X", scenario.logs, default_tiers())
    again = WhyReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report
    log = scenario.logs["X"]
    packed = msgpack.packb(log.to_dict())
    assert RequestLog.from_dict(msgpack.unpackb(packed)) == log


def test_phases_cut_the_victims_life_in_order(scenario) -> None:
    kinds = [p.kind for p in phases(scenario.logs["Y"])]
    assert kinds == [PhaseKind.QUEUE, PhaseKind.PREFILL, PhaseKind.TRANSFER, PhaseKind.DECODE,
                     PhaseKind.PREEMPTION, PhaseKind.DECODE]
    pre = phases(scenario.logs["Y"])[4]
    assert (pre.start, pre.end) == (1.30, 1.70)
    assert [r.decision for r in pre.records] == [Decision.PREEMPT_SWAP, Decision.PREEMPT_DONE]


def test_recompute_requeue_and_a_plain_waiting_blocker() -> None:
    tiers = default_tiers()
    z = Request("Z", tier=1, arrival_time=0.0, prompt_len=16, max_new_tokens=8)
    transition(z, RequestState.PREFILLING, decision=Decision.SCHEDULE_PREFILL,
               triggered_by="admission", now=0.5, blocking_req_id="W", mem_pressure=0.5)
    transition(z, RequestState.PREEMPTED, decision=Decision.PREEMPT_RECOMPUTE,
               triggered_by="kv_full:prefill-2", now=0.6, mem_pressure=1.0,
               blocking_req_id="V")
    transition(z, RequestState.QUEUED, decision=Decision.RESUME_RECOMPUTE,
               triggered_by="requeue", now=0.6)
    logs = {"Z": RequestLog.from_request(z)}
    report = explain("Z", logs, tiers, now=3.0)
    assert report.waited_s == pytest.approx(0.5 + 2.4)
    assert "waited on request W" in report.text  # W is unknown: named without a tier
    assert "was preempted for request V (recompute), resumed by recompute" in report.text
    assert report.state == "queued"
    assert report.late is None and report.steps[-1].text == "not finished"
    assert report.ttft_s is None


def test_rejected_request_and_unknown_ids() -> None:
    tiers = default_tiers()
    r = Request("R", tier=2, arrival_time=5.0, prompt_len=16, max_new_tokens=8)
    transition(r, RequestState.REJECTED, decision=Decision.REJECT,
               triggered_by="no_slo_headroom", now=5.001)
    logs = {"R": RequestLog.from_request(r)}
    report = explain("R", logs, tiers)
    assert "rejected (no_slo_headroom)" in report.text
    assert explain("nope", logs, tiers) is None
    bad = {"B": RequestLog("B", tier=7, arrival_time=0.0, records=())}
    with pytest.raises(ValueError, match="tier 7"):
        explain("B", bad, tiers)


def test_ms_reads_at_a_glance() -> None:
    assert (ms(0.42), ms(1.25), ms(600.0)) == ("420 ms", "1.25 s", "10 min")


def test_a_tenant_sees_its_own_requests_and_no_other_tenants_ids(scenario) -> None:
    # X is tenant a's, Y tenant b's (issue 13: a chain named other tenants' request ids).
    logs = {"X": dataclasses.replace(scenario.logs["X"], tenant="a"),
            "Y": dataclasses.replace(scenario.logs["Y"], tenant="b")}
    assert explain("X", logs, default_tiers(), viewer="b") is None
    assert explain("Y", logs, default_tiers(), viewer="a") is None
    mine = explain("X", logs, default_tiers(), viewer="a")
    assert mine is not None and "Y" not in json.dumps(mine.to_dict())
    assert "preempted a tier-3 request of another tenant (swap, 80 ms)" in mine.text
    pre = next(s for s in mine.steps if s.kind is StepKind.PREEMPTED_OTHER)
    assert pre.other_req_id is None
    victim = explain("Y", logs, default_tiers(), viewer="b")
    assert "request X" not in victim.text
    assert all(s.other_req_id is None for s in victim.steps)
    assert "was preempted for a tier-0 request of another tenant" in victim.text
    # No viewer (open access, the operator's CLI): every id, as before.
    assert "tier-3 request Y" in explain("X", logs, default_tiers()).text
    same = {"X": logs["X"], "Y": dataclasses.replace(logs["Y"], tenant="a")}
    assert "tier-3 request Y" in explain("X", same, default_tiers(), viewer="a").text
