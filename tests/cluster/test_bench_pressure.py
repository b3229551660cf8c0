"""bench-pressure's load and settings, without a cluster: the tiered open-loop workload,
the cluster it asks for, and which rate it reports as the headline."""

from __future__ import annotations

import argparse

from cluster.bench_pressure import (
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
    from cluster.http_replay import REJECTED_STATUS, Outcome, miss_reason
    from scheduler.tiers import default_tiers

    top, batch = default_tiers()[0], default_tiers()[2]  # 200 ms / 50 ms; 30 s end to end
    assert miss_reason(top, Outcome(0, True, 0.1, 0.01, 1.0, 10)) is None
    assert miss_reason(top, Outcome(0, False, status=REJECTED_STATUS)) == "rejected"
    assert miss_reason(top, Outcome(0, False, error="timeout")) == "error"
    assert miss_reason(top, Outcome(0, True, 0.3, 0.09, 1.0, 10)) == "ttft"
    assert miss_reason(top, Outcome(0, True, 0.1, 0.09, 1.0, 10)) == "tpot"
    assert miss_reason(batch, Outcome(2, True, 5.0, 0.5, 31.0, 10)) == "e2e"
