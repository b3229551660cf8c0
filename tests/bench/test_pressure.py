"""bench-pressure's load and settings, without a cluster: the tiered open-loop workload,
the cluster it asks for, and which rate it reports as the headline."""

from __future__ import annotations

import argparse

import pytest

from bench.pressure import (
    PREFIX_TOKENS,
    SHAPES,
    _headline,
    add_arguments,
    cluster_config,
    workload,
)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_workload_is_seeded_open_loop_and_tiered() -> None:
    a = workload(3.0, 30.0, seed=7)
    assert a == workload(3.0, 30.0, seed=7)
    assert a != workload(3.0, 30.0, seed=8)
    assert all(0 <= x.at_s < 30.0 for x in a)
    assert [x.at_s for x in a] == sorted(x.at_s for x in a)
    assert {x.tier for x in a} == {0, 1, 2, 3}
    for x in a:
        (plo, phi), (olo, ohi) = SHAPES[x.tier]
        assert plo <= len(x.prompt) <= phi and olo <= x.max_tokens <= ohi
    # Tier 0 and 1 prompts open with one of a few shared system prefixes (prefix reuse).
    heads = {x.prompt[:PREFIX_TOKENS] for x in a if x.tier <= 1}
    assert 1 < len(heads) <= 4


def test_the_cluster_has_two_decode_domains_and_a_bounded_swap_space() -> None:
    cfg = cluster_config(_args("--swap-blocks", "48", "--num-kv-blocks", "256"), "/m",
                         "vllm-priority", ["pools.prefix_caching=false"])
    assert cfg.pools.num_prefill == 1 and cfg.pools.num_decode == 2
    assert cfg.pools.num_swap_blocks == 48 and cfg.pools.num_kv_blocks == 256
    assert not cfg.pools.prefix_caching
    assert cfg.scheduling.policy == "vllm-priority"
    assert len({d.nvlink_domain for d in cfg.topology.decode}) == 2


def test_the_headline_is_the_lowest_rate_where_a_peer_misses_tier_0() -> None:
    def runs(ts: float, vp: float) -> dict:
        return {"tierserve": {"tier0_attainment": ts}, "vllm-priority": {"tier0_attainment": vp}}

    by_rate = {"1.0": runs(1.0, 0.95), "2.0": runs(1.0, 0.8), "3.0": runs(0.9, 0.5)}
    assert _headline(by_rate, ["tierserve", "vllm-priority"]) == 2.0
    assert _headline({"1.0": runs(1.0, 1.0), "2.0": runs(1.0, 0.95)},
                     ["tierserve", "vllm-priority"]) == 2.0


def test_a_miss_is_named_by_the_first_target_it_broke() -> None:
    from bench.http_replay import REJECTED_STATUS, Outcome, miss_reason
    from scheduler.tiers import default_tiers

    top, batch = default_tiers()[0], default_tiers()[2]  # 200 ms / 50 ms; 30 s end to end
    assert miss_reason(top, Outcome(0, True, 0.1, 0.01, 1.0, 10)) is None
    assert miss_reason(top, Outcome(0, False, status=REJECTED_STATUS)) == "rejected"
    assert miss_reason(top, Outcome(0, False, error="timeout")) == "error"
    assert miss_reason(top, Outcome(0, True, 0.3, 0.09, 1.0, 10)) == "ttft"
    assert miss_reason(top, Outcome(0, True, 0.1, 0.09, 1.0, 10)) == "tpot"
    assert miss_reason(batch, Outcome(2, True, 5.0, 0.5, 31.0, 10)) == "e2e"


def _kv(preemptions: int) -> dict:
    modes = ("swap", "recompute", "migrate")
    return {"preemptions": {m: preemptions for m in modes},
            "restore": {m: {"mean_ms": None} for m in modes}, "restore_by_class": {},
            "paused": {}, "links": {},
            "workers": {"d-0": {"swap_peak": 3, "swap_blocks": 48, "swap_used": 0,
                                "prefix_hit_rate": None}}}


def _stats(kv: dict, work_conservation_s: list[float] | None) -> dict:
    out = {"workers": {"d-0": {"role": "decode", "total": 64, "free": 64},
                       "p-0": {"role": "prefill", "total": 64, "free": 64}},
           "preemptions": {}, "kv_memory": kv}
    if work_conservation_s is not None:
        out["work_conservation_s"] = work_conservation_s
    return out


def test_the_summary_carries_the_objective_last_end_and_work_conservation() -> None:
    from bench.http_replay import REJECTED_STATUS, Outcome, summarize
    from bench.pressure import _figures
    from scheduler.objective import tier_weights, weighted_miss
    from scheduler.tiers import default_tiers

    tiers = default_tiers()
    outcomes = [
        Outcome(0, True, 0.05, 0.01, 0.5, 10, sent_s=1.0, end_s=1.5),
        # A rejection, a timeout and an error each miss their tier.
        Outcome(0, False, status=REJECTED_STATUS, error="rejected", sent_s=2.0, end_s=2.0),
        Outcome(1, False, error="timeout", sent_s=3.0, end_s=123.0),
        Outcome(2, True, 1.0, 0.05, 20.0, 50, sent_s=4.0, end_s=24.0),
        Outcome(3, False, error="engine_error", sent_s=5.0, end_s=6.0),
    ]
    summary = summarize(outcomes, tiers, 10.0, "tierserve", "in-process")
    before, after = _kv(2), _kv(7)
    r = _figures(summary, after, before, _stats(after, [0.0, 1.5, 0.0, 4.0]),
                 _stats(before, [0.0, 0.5, 0.0, 0.0]))
    assert r["attainment"] == {"0": 0.5, "1": 0.0, "2": 1.0, "3": 0.0}
    w = tier_weights(tiers)
    assert r["weighted_miss"] == pytest.approx((w[0] * 0.5 + w[1] + w[3]) / sum(w))
    assert r["weighted_miss"] == pytest.approx(weighted_miss(r["attainment"], w))
    assert r["goodput_rps"] == pytest.approx(2 / 10.0)
    assert r["last_end_s"] == pytest.approx(122.0)  # first sent at 1 s, the timeout at 123 s
    # The run's own seconds: what the warm-up had counted is taken off.
    assert r["work_conservation_s"] == pytest.approx([0.0, 1.0, 0.0, 4.0])
    assert r["preemptions"] == {"swap": 5, "recompute": 5, "migrate": 5}
    assert r["leaked_blocks"] == 0
    # A scheduler from before the figure existed: None, not a crash.
    assert _figures(summary, after, before, _stats(after, None))["work_conservation_s"] is None


def test_no_request_timed_no_last_end_and_no_request_no_objective() -> None:
    from bench.http_replay import Outcome, last_end_s, summarize
    from scheduler.tiers import default_tiers

    assert last_end_s([Outcome(0, True, 0.1, None, 0.2, 1)]) is None
    s = summarize([], default_tiers(), 10.0, "p", "u")
    assert s["weighted_miss"] is None and s["last_end_s"] is None and s["goodput_rps"] == 0


def test_work_conservation_is_read_from_a_metrics_answer() -> None:
    from bench.http_replay import counter_delta, parse_work_conservation

    text = ('# HELP tierserve:work_conservation_seconds_total x\n'
            '# TYPE tierserve:work_conservation_seconds_total counter\n'
            'tierserve:work_conservation_seconds_total{tier="0"} 0.0\n'
            'tierserve:work_conservation_seconds_total{tier="2"} 3.5\n'
            'vllm:num_requests_running 2.0\n')
    assert parse_work_conservation(text) == [0.0, 0.0, 3.5]
    assert parse_work_conservation("vllm:num_requests_running 2.0\n") is None  # a peer
    assert counter_delta([0.0, 1.0], [0.5, 3.0, 2.0]) == [0.5, 2.0, 2.0]
    assert counter_delta([0.0, 5.0], [0.0, 1.0]) == [0.0, 1.0]  # reset: all of it is new
    assert counter_delta(None, [1.0]) == [1.0] and counter_delta([1.0], None) is None
