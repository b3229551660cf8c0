"""router/metrics.py: the /metrics text moves as preemptions, transfers and finishes happen."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import CONTENT_TYPE, METRIC_NAMES, MetricsRecorder, reason_label, slo_met
from scheduler.tiers import default_tiers


def scrape(rec: MetricsRecorder) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """sample name + sorted labels -> value, parsed the way Prometheus reads it."""
    out = {}
    for fam in text_string_to_metric_families(rec.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_forced_preemption_moves_preemption_and_decision_counters(scenario) -> None:
    rec = MetricsRecorder(default_tiers())
    before = scrape(rec)
    assert value(before, "tierserve:num_preemptions_total", tier="3", reason="tier0_arrival",
                 mode="swap") == 0
    for req in scenario.requests.values():
        for record in req.history:
            rec.on_decision(record, req.tier)
    after = scrape(rec)
    assert value(after, "tierserve:num_preemptions_total", tier="3", reason="tier0_arrival",
                 mode="swap") == 1
    # The tier-0 request was never preempted.
    assert not any(k[0] == "tierserve:num_preemptions_total" and ("tier", "0") in k[1]
                   for k in after)
    assert value(after, "tierserve:scheduler_decisions_total", tier="3",
                 decision="resume_swap_in") == 1
    assert value(after, "tierserve:scheduler_decisions_total", tier="0",
                 decision="schedule_prefill") == 1


def test_cross_domain_transfer_counts_bytes_and_seconds_by_class(scenario) -> None:
    rec = MetricsRecorder()
    t = scenario.transfer
    rec.on_transfer(t.topology_class, t.num_bytes, t.seconds)
    rec.on_transfer("same_domain", 1000, 0.002)
    s = scrape(rec)
    assert value(s, "tierserve:kv_transfer_bytes_total", topology="same_node") == t.num_bytes
    assert value(s, "tierserve:kv_transfer_seconds_count", topology="same_node") == 1
    assert value(s, "tierserve:kv_transfer_seconds_sum", topology="same_node") == pytest.approx(
        t.seconds)
    assert value(s, "tierserve:kv_transfer_bytes_total", topology="same_domain") == 1000
    assert value(s, "tierserve:kv_transfer_bytes_total", topology="cross_node") == 0


def test_finished_requests_feed_latency_attainment_and_goodput() -> None:
    rec = MetricsRecorder(default_tiers())
    # tier 0: TTFT 200 ms, TPOT 50 ms.
    assert rec.on_request_finished(0, 0.15, 0.04, 1.0, num_output_tokens=10, queue_s=0.1)
    assert not rec.on_request_finished(0, 0.47, 0.05, 1.2, num_output_tokens=5)
    assert rec.on_request_finished(3, None, None, 2.0, met_slo=True, num_output_tokens=20,
                                   finished_reason="length")
    s = scrape(rec)
    assert value(s, "tierserve:time_to_first_token_seconds_count", tier="0") == 2
    assert value(s, "tierserve:time_to_first_token_seconds_bucket", tier="0", le="0.25") == 1
    assert value(s, "tierserve:time_to_first_token_seconds_bucket", tier="0", le="0.5") == 2
    assert value(s, "tierserve:slo_met_total", tier="0") == 1
    assert value(s, "tierserve:slo_missed_total", tier="0") == 1
    assert value(s, "tierserve:goodput_tokens_total", tier="0") == 10
    assert value(s, "tierserve:generation_tokens_total", tier="0") == 15
    assert value(s, "tierserve:request_success_total", tier="3", finished_reason="length") == 1
    assert value(s, "tierserve:request_queue_time_seconds_count", tier="0") == 1
    assert value(s, "tierserve:time_to_first_token_seconds_count", tier="3") == 0


def test_gauges_snapshot_kv_queue_shares_and_prefix_hits() -> None:
    rec = MetricsRecorder()
    rec.set_kv_usage("decode-1", 30, 32)
    rec.set_queue_depth(0, 4)
    rec.set_request_counts(3, running=1, preempted=2, swapped=1)
    rec.set_shares([0.4, 0.4, 0.1, 0.1])
    rec.on_prefix_lookup(10, 4)
    rec.on_admission_rejected(2, "queue_full")
    s = scrape(rec)
    assert value(s, "tierserve:kv_cache_usage_perc", worker_id="decode-1") == pytest.approx(30 / 32)
    assert value(s, "tierserve:kv_cache_total_blocks", worker_id="decode-1") == 32
    assert value(s, "tierserve:num_requests_waiting", tier="0") == 4
    assert value(s, "tierserve:num_requests_preempted", tier="3") == 2
    assert value(s, "tierserve:num_requests_swapped", tier="3") == 1
    assert value(s, "tierserve:tier_share", tier="0") == pytest.approx(0.4)
    assert value(s, "tierserve:prefix_cache_hits_total") == 4
    assert value(s, "tierserve:prefix_cache_queries_total") == 10
    assert value(s, "tierserve:admission_rejections_total", tier="2", reason="queue_full") == 1
    rec.set_kv_usage("decode-1", 8, 32)
    assert value(scrape(rec), "tierserve:kv_cache_usage_perc", worker_id="decode-1") == 0.25


def test_work_conservation_counter_follows_the_kernels_running_totals() -> None:
    rec = MetricsRecorder(default_tiers())
    rec.set_work_conservation([0.0, 0.0, 0.0, 0.0])
    s = scrape(rec)
    assert all(value(s, "tierserve:work_conservation_seconds_total", tier=str(t)) == 0
               for t in range(4))
    rec.set_work_conservation([0.0, 1.5, 0.0, 0.25])
    rec.set_work_conservation([0.0, 2.0, 0.0, 0.25])  # a total, not an increment
    s = scrape(rec)
    assert value(s, "tierserve:work_conservation_seconds_total", tier="1") == pytest.approx(2.0)
    assert value(s, "tierserve:work_conservation_seconds_total", tier="3") == pytest.approx(0.25)
    assert value(s, "tierserve:work_conservation_seconds_total", tier="0") == 0
    # A total that went down is a restarted kernel's: the counter never goes back.
    rec.set_work_conservation([0.0, 0.5, 0.0, 0.25])
    assert value(scrape(rec), "tierserve:work_conservation_seconds_total",
                 tier="1") == pytest.approx(2.5)
    assert "tierserve:work_conservation_seconds" in METRIC_NAMES


def test_ttft_hops_are_histograms_read_back_and_summarised_over_a_window() -> None:
    from bench.http_replay import parse_ttft_parts
    from router.metrics import histogram_quantile, parts_summary

    rec = MetricsRecorder(default_tiers())
    rec.on_ttft_parts(0, {"queued": 0.003, "handoff": 0.002, "step_wait": 0.5, "prefill": 0.1})
    before = rec.ttft_parts()
    for wait in (0.01, 0.03, 0.03, 0.07):
        rec.on_ttft_parts(0, {"queued": 0.003, "handoff": 0.002, "step_wait": wait,
                              "prefill": 0.1})
    rec.on_ttft_parts(2, {"step_wait": 2.0})
    after = rec.ttft_parts()
    # What /metrics says is what the recorder says (the HTTP benches read the former).
    assert parse_ttft_parts(rec.render().decode()) == after
    assert parse_ttft_parts("vllm:num_requests_running 2.0\n") is None  # a peer
    s = parts_summary(before, after)
    wait = s["0"]["step_wait"]
    # The window holds the four later samples only: the 0.5 s before it is not in them.
    assert wait["n"] == 4 and wait["mean_ms"] == pytest.approx(35.0)
    assert 20.0 <= wait["p50_ms"] <= 40.0 and 60.0 <= wait["p99_ms"] <= 80.0
    assert s["2"]["step_wait"]["n"] == 1 and s["2"]["step_wait"]["mean_ms"] == 2000.0
    assert set(s["2"]) == {"step_wait"}  # a hop never measured has no entry
    # A histogram that went down was reset: all of the later reading is new.
    assert parts_summary(after, before)["0"]["step_wait"]["n"] == 1
    assert parts_summary(before, None) is None
    # Prometheus' interpolation: half of the samples in (0, 1], half in (1, 2].
    assert histogram_quantile(0.5, [[1.0, 5], [2.0, 10]], 10) == pytest.approx(1.0)
    assert histogram_quantile(0.75, [[1.0, 5], [2.0, 10]], 10) == pytest.approx(1.5)
    assert histogram_quantile(0.99, [[1.0, 5], [2.0, 5]], 10) == 2.0  # past the last bound
    assert histogram_quantile(0.5, [[1.0, 0]], 0) is None
    assert "tierserve:ttft_part_seconds" in METRIC_NAMES


def test_recorders_do_not_share_a_registry() -> None:
    a, b = MetricsRecorder(), MetricsRecorder()
    a.on_transfer("cross_node", 10, 0.1)
    assert value(scrape(b), "tierserve:kv_transfer_bytes_total", topology="cross_node") == 0
    assert CONTENT_TYPE.startswith("text/plain")


def test_every_family_is_prefixed_and_listed() -> None:
    names = {fam.name for fam in text_string_to_metric_families(MetricsRecorder().render()
                                                                .decode())}
    assert {n for n in names if not n.endswith("_created")} <= METRIC_NAMES
    assert all(n.startswith("tierserve:") for n in METRIC_NAMES)
    assert len(METRIC_NAMES) >= 20


@pytest.mark.parametrize(
    "call",
    [
        lambda r: r.set_kv_usage("w", 5, 4),
        lambda r: r.set_kv_usage("w", 0, 0),
        lambda r: r.on_transfer("same_node", -1, 0.1),
        lambda r: r.on_prefix_lookup(2, 3),
        lambda r: r.set_shares([1.5, -0.5]),
        lambda r: r.set_work_conservation([0.0, -1.0]),
        lambda r: r.set_work_conservation([float("nan")]),
        lambda r: r.on_ttft_parts(0, {"queued": -0.1}),
        lambda r: r.on_ttft_parts(0, {"decode": 0.1}),  # not a hop of a first token
        lambda r: r.on_request_finished(0, -1.0, None, 1.0, met_slo=True),
        lambda r: r.on_request_finished(0, 0.1, None, 1.0),  # no TierConfig, no met_slo
    ],
)
def test_bad_figures_are_refused(call) -> None:
    with pytest.raises(ValueError):
        call(MetricsRecorder())


def test_slo_judgement_and_reason_labels() -> None:
    t0 = default_tiers()[0]
    assert slo_met(t0, 0.1, 0.04, 3.0)
    assert not slo_met(t0, 0.3, 0.04, 3.0)
    assert not slo_met(t0, None, None, 3.0)
    assert slo_met(t0, 0.1, None, 3.0)
    t2 = default_tiers()[2]
    assert slo_met(t2, None, None, 29.0) and not slo_met(t2, 1.0, 0.01, 31.0)
    assert reason_label("kv_full:decode-1") == "kv_full"
    assert reason_label("") == "unknown"
    assert reason_label("admission:no_kv") == "admission:no_kv"
    assert reason_label("router:abort:req-17") == "router:abort"


def test_rejection_records_count_as_admission_rejections() -> None:
    from scheduler.request import Decision, Request, RequestState, transition

    rec = MetricsRecorder()
    r = Request("R", tier=1, arrival_time=0.0, prompt_len=8, max_new_tokens=4)
    rec.on_decision(transition(r, RequestState.REJECTED, decision=Decision.REJECT,
                               triggered_by="admission:no_kv", now=0.1), r.tier)
    s = scrape(rec)
    assert value(s, "tierserve:admission_rejections_total", tier="1", reason="admission:no_kv") == 1
    assert value(s, "tierserve:scheduler_decisions_total", tier="1", decision="reject") == 1
