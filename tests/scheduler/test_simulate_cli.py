"""`tierserve simulate`: flags, printed table, JSON shape, plot, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from scheduler.objective import tier_weights, weighted_miss
from scheduler.tiers import default_tiers

SPEC = "rate=8,duration=6,prompt=800,output=60,prefix_groups=2"
SMALL = "prefill=1,decode=1,gpus_per_node=2"


def test_json_shape_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "r.json", tmp_path / "p.png"
    rc = main(["simulate", "--trace", SPEC, "--format", "poisson", "--policies",
               "tierserve,vllm-fcfs", "--load", "1,2", "--cluster", SMALL,
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["policy"], r["load"]) for r in runs] == [
        ("tierserve", 1.0), ("tierserve", 2.0), ("vllm-fcfs", 1.0), ("vllm-fcfs", 2.0)]
    for r in runs:
        for key in ("goodput_rps", "throughput_tok_s", "preemptions", "prefix_hit_rate", "wall_s",
                    "weighted_miss", "last_end_s", "work_conservation_s"):
            assert key in r
        assert set(r["tiers"]) == {"0", "1", "2", "3"}
        # The objective from the run's attainment and the default tiers' weights.
        assert r["weighted_miss"] == pytest.approx(weighted_miss(
            {t: d["attainment"] for t, d in r["tiers"].items()}, tier_weights(default_tiers())))
        assert 0.0 < r["last_end_s"] <= r["sim_end_s"]
        assert len(r["work_conservation_s"]) == 4
        if r["policy"] != "tierserve":  # only a policy that claims it is held to it
            assert r["work_conservation_s"] == [0.0] * 4
        for t in r["tiers"].values():
            for key in ("attainment", "ttft_p50", "ttft_p99", "tpot_p99", "completed", "rejected"):
                assert key in t
    assert png.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "tierserve" in printed and "goodput" in printed
    assert "weighted miss" in printed and "last end" in printed


def test_unknown_policy_is_refused_with_the_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--trace", SPEC, "--format", "poisson", "--policies", "vllm-lifo"])
    err = capsys.readouterr().err
    assert rc == 2 and "vllm-lifo" in err and "sglang-lpm" in err and "tierserve" in err


def test_malformed_trace_names_file_and_line(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                 '{"timestamp": 5, "input_length": 10}\n')
    assert main(["simulate", "--trace", str(p)]) == 2
    assert f"{p}:2:" in capsys.readouterr().err


def test_mode_and_max_tokens_reach_the_json(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    assert main(["simulate", "--trace", SPEC, "--format", "poisson", "--policies", "tierserve",
                 "--cluster", SMALL, "--mode", "auto", "--max-tokens", "512",
                 "--json", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert run["mode"] == "auto" and run["max_tokens"] == 512


@pytest.mark.parametrize("flag, value, field", [
    ("--load", "0", "--load"), ("--cluster", "decode=0", "cluster.decode"),
    ("--tier-mix", "50,50", "--tier-mix"), ("--max-tokens", "0", "--max-tokens"),
])
def test_bad_flags_name_the_field(flag: str, value: str, field: str,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", SPEC, "--format", "poisson", flag, value]) == 2
    assert field in capsys.readouterr().err


def test_capacity_per_seed_and_best_tuned_peers_reach_the_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap.json"
    rc = main(["simulate", "--trace", "rate=6,duration=8,prompt=600,output=40", "--format",
               "poisson", "--policies", "tierserve,vllm-priority:max_num_batched_tokens=1024",
               "--load", "1,4", "--seeds", "0,1", "--capacity", "--bisect", "1",
               "--tune-peers", "--tune-load", "2", "--tune-window", "5", "--cluster", SMALL,
               "--json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["setup"]["tune_window"] == 5
    tuning_probes = [p for p in res["probes"] if p["policy"] not in res["slo_capacity"]]
    # Tuning replays the trace's first 5 of 8 seconds; the headline runs replay all of it.
    assert max(p["requests"] for p in tuning_probes) < min(r["requests"] for r in res["runs"])
    best = res["best_tuned"]["vllm-priority"]
    assert best.startswith("vllm-priority:max_num_batched_tokens=")
    tried = [t["policy"] for t in res["tuning"]["vllm-priority"]]
    assert len(tried) >= 6 and best in tried
    assert set(res["slo_capacity"]) == {"tierserve", best}
    for label, by_seed in res["slo_capacity_by_seed"].items():
        assert set(by_seed) == {"0", "1"}
        spread = res["slo_capacity_spread"][label]
        assert spread["min"] <= res["slo_capacity"][label] <= spread["max"]
    assert {(r["policy"], r["seed"]) for r in res["runs"]} == {
        (p, s) for p in ("tierserve", best) for s in (0, 1)}
    assert all("cleared" in r for r in res["runs"])


def test_bad_policy_settings_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["simulate", "--trace", SPEC, "--format", "poisson", "--policies",
               "vllm-priority:max_num_batched_tokens=lots"])
    assert rc == 2 and "max_num_batched_tokens" in capsys.readouterr().err
