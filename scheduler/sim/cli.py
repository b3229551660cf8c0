"""`tierserve simulate`: replay a trace through the simulator for each policy, load and seed.

Prints one table row per policy, load, seed and tier; ``--json`` writes ``{"runs":
[...]}`` (see :func:`scheduler.sim.metrics.summarize` for the fields; each run also
carries its ``seed`` and whether it ``cleared`` the SLO bars); ``--plot`` draws tier-0
attainment and goodput against load (mean and range over seeds). ``--policies`` takes
specs with settings (``vllm-priority:max_num_batched_tokens=2048``,
:mod:`scheduler.policy_spec`).

``--capacity`` searches each policy's SLO capacity for each seed (the highest load with
tier 0 at least 99 % and every other tier at least 90 %, bisecting between sweep loads:
:mod:`scheduler.sim.capacity`); the JSON gains ``slo_capacity`` (policy as given -> mean
over seeds), ``slo_capacity_by_seed`` and ``slo_capacity_spread``. A bisection probe stops
as soon as a tier has missed more than its bar allows. ``--no-curves`` makes the sweep
loads such probes too (capacity only, no full runs). ``--tune-peers`` first sweeps every
peer over its documented step settings (:mod:`scheduler.sim.tuning`) on the first seed,
keeps each one's best by SLO capacity (the defaults on a tie) and runs that in its place
(``--tune-window``: ranked on the trace's first seconds only);
the JSON gains ``best_tuned`` (peer -> the spec that won) and ``tuning``.

``--mode`` picks where prefills run (the cluster scheduler's ``PoolMode``);
``--max-tokens`` is every request's max_tokens budget, what the kernel sees in place of
the trace's output length (which only decides where the simulated model emits EOS).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from scheduler.cluster_scheduler import PoolMode
from scheduler.ordering import UnknownPolicy
from scheduler.policies import POLICY_NAMES, check_policy
from scheduler.policy_spec import PolicySpecError, split_specs
from scheduler.sim.capacity import Spread, find_capacity
from scheduler.sim.cluster import DEFAULT_CLUSTER, ClusterSpec, ClusterSpecError, parse_cluster
from scheduler.sim.costmodel import PROFILES, CostModel
from scheduler.sim.metrics import summarize
from scheduler.sim.simulator import DEFAULT_MAX_TOKENS, Simulator
from scheduler.sim.slo import SloBars
from scheduler.sim.traces import TraceError, TraceRequest, guess_format, read_trace, scale_load
from scheduler.sim.tuning import peer_grid
from scheduler.tiers import ConfigError, TierConfig, TierMix, default_tiers


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True,
                   help="trace file, or for --format poisson a spec like rate=5,duration=60")
    p.add_argument("--format", choices=("azure", "mooncake", "poisson"), default=None,
                   help="trace format (default: from the file name)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help="comma-separated policy specs NAME[:key=value,...] "
                        f"({', '.join(POLICY_NAMES)})")
    p.add_argument("--load", default="1", help="comma-separated load multipliers (time compression)")
    p.add_argument("--duration", type=float, default=None,
                   help="simulate arrivals of the first S seconds (after scaling)")
    p.add_argument("--cluster", default=DEFAULT_CLUSTER, help="e.g. " + DEFAULT_CLUSTER)
    p.add_argument("--profile", choices=sorted(PROFILES), default="h200-llama3-8b")
    p.add_argument("--mode", choices=[m.value for m in PoolMode], default=PoolMode.DISAGGREGATED.value,
                   help="where prefills run: the prefill pool (disaggregated), the decode worker "
                        "itself (aggregated: every worker does both), or per request (auto)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="every request's max_tokens budget as the kernel sees it; a request ends at "
                        "the trace's output length (EOS) or at this budget, whichever comes first")
    p.add_argument("--seed", type=int, default=0, help="seed for the tier mix and synthetic traces")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds, each a run (overrides --seed)")
    p.add_argument("--tier-mix", default="10,40,30,20", help="tier percentages when the trace has none")
    p.add_argument("--capacity", action="store_true",
                   help="search each policy's SLO capacity per seed (bisecting between --load)")
    p.add_argument("--bisect", type=int, default=3, help="bisection steps of --capacity (3)")
    p.add_argument("--no-curves", action="store_true",
                   help="with --capacity: the sweep loads stop early too (no full runs)")
    p.add_argument("--tune-peers", action="store_true",
                   help="sweep each peer over its documented step settings, keep its best")
    p.add_argument("--tune-load", default=None,
                   help="sweep loads of --tune-peers (default: --load)")
    p.add_argument("--tune-bisect", type=int, default=None,
                   help="bisection steps of --tune-peers (default: --bisect)")
    p.add_argument("--tune-window", type=float, default=None,
                   help="--tune-peers replays only the trace's first S seconds (before "
                        "scaling): the settings are ranked on a part of the trace")
    p.add_argument("--bars", default="99,90",
                   help="attainment bars of --capacity in %%: tier 0, other tiers (99,90)")
    p.add_argument("--feasible", action="store_true",
                   help="the bars apply to each tier's feasible requests (those whose prefill "
                        "alone on an idle worker fits the tier's TTFT)")
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    p.add_argument("--plot", default=None, help="write an attainment/goodput-vs-load PNG here")


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list of numbers") from None
    if not vals or any(not v > 0 for v in vals):
        raise ConfigError(f"{what}: needs positive numbers, got {text!r}")
    return vals


def _ints(text: str, what: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list of integers") from None
    if not vals:
        raise ConfigError(f"{what}: needs at least one value")
    return vals


def _row(run: dict) -> list[str]:
    rows = []
    tag = f"{run['policy']}" + (f" s{run['seed']}" if "seed" in run else "")
    for t, d in run["tiers"].items():
        def pct(x: float | None) -> str:
            return "-" if x is None else f"{100 * x:.1f}"

        def ms(x: float | None) -> str:
            return "-" if x is None else f"{1000 * x:.0f}"
        rows.append(f"{tag:<24} {run['load']:>6g} {t:>4} {pct(d['attainment']):>6} "
                    f"{pct(d['attainment_feasible']):>6} {ms(d['ttft_p50']):>8} "
                    f"{ms(d['ttft_p99']):>8} {ms(d['tpot_p99']):>7} {d['completed']:>6} "
                    f"{d['rejected']:>5} {100 * d['token_share']:>6.1f}")
    hit = run["prefix_hit_rate"]
    wm, last = run.get("weighted_miss"), run.get("last_end_s")
    wc = run.get("work_conservation_s")
    rows.append(f"{'':<24} {'':>6} {'all':>4} weighted miss "
                f"{'-' if wm is None else f'{wm:.4f}'}, goodput {run['goodput_rps']:.2f} req/s, "
                f"last end {'-' if last is None else f'{last:.1f} s'}, "
                f"{run['throughput_tok_s']:.0f} tok/s, {run['preemptions']} preemptions, "
                f"prefix hit {'-' if hit is None else f'{100 * hit:.1f}%'}"
                + (f" (Belady {100 * run['belady_hit_rate']:.1f}%)"
                   if run.get("belady_hit_rate") is not None else "")
                + (f", work conservation {sum(wc):.2f} s" if wc is not None else "")
                + (", SLO bars cleared" if run.get("cleared") else "")
                + f", {run['wall_s']:.1f}s wall")
    return rows


class _Runner:
    """Simulates one policy at one load and seed, the way every run of this command is."""

    def __init__(self, args: argparse.Namespace, tiers: TierConfig, cost: CostModel,
                 cluster: ClusterSpec, bases: dict[int, list[TraceRequest]], fmt: str,
                 bars: SloBars) -> None:
        self.args = args
        self.tiers = tiers
        self.cost = cost
        self.cluster = cluster
        self.bases = bases
        self.fmt = fmt
        self.bars = bars
        self.mode = PoolMode(args.mode)
        self.probes: list[dict[str, object]] = []
        self.window: float | None = None  # replay only arrivals before this (trace seconds)

    def full(self, label: str, load: float, seed: int) -> dict:
        sim = self._sim(label, load, seed, stop=False)
        r = summarize(sim, load, with_belady=(self.fmt != "azure"))
        r["seed"] = seed
        r["cleared"] = self.bars.cleared(r)
        return r

    def probe(self, label: str, load: float, seed: int) -> bool:
        """Whether the run clears the bars; it stops as soon as it cannot."""
        sim = self._sim(label, load, seed, stop=True)
        attainment: dict[str, object] | None = None
        if sim.stopped_early:
            ok = False
        else:
            r = summarize(sim, load, with_belady=False)
            ok = self.bars.cleared(r)
            attainment = {t: (d["attainment"], d["attainment_feasible"])
                          for t, d in r["tiers"].items()}  # type: ignore[union-attr]
        self.probes.append({"policy": label, "load": load, "seed": seed, "cleared": ok,
                            "stopped_early": sim.stopped_early, "missed_tier": sim.missed_tier,
                            "attainment": attainment, "requests": len(sim.jobs),
                            "sim_end_s": sim.now,
                            "wall_s": sim.wall_s})
        print(f"{'probe ' + label + f' s{seed}':<40} load {load:>7.4g}: "
              f"{'clears' if ok else 'misses'} the SLO bars"
              + (f" (tier {sim.missed_tier}, stopped at {sim.now:.0f} s)"
                 if sim.stopped_early else "")
              + f", {sim.wall_s:.1f}s wall", flush=True)
        return ok

    def _sim(self, label: str, load: float, seed: int, *, stop: bool) -> Simulator:
        base = self.bases[seed]
        if self.window is not None:
            base = [r for r in base if r.arrival < self.window]
        trace = scale_load(base, load, self.args.duration)
        return Simulator(trace, label, self.cluster, self.cost, self.tiers, mode=self.mode,
                         max_tokens=self.args.max_tokens,
                         stop_below=self.bars if stop else None).run()


def _tune(runner: _Runner, peers: list[str], loads: list[float], seed: int,
          save: Callable[[], None], out: dict) -> dict[str, str]:
    """Each peer's best spec by SLO capacity on ``seed`` (the first tried on a tie)."""
    best: dict[str, str] = {}
    for name in peers:
        tried = []
        top: tuple[float, str] | None = None
        for spec in peer_grid(name):
            steps = runner.args.bisect if runner.args.tune_bisect is None else runner.args.tune_bisect
            res = find_capacity(lambda load, s=spec.label: runner.probe(s, load, seed), loads,
                                bisect_steps=steps)
            tried.append({"policy": spec.label, "slo_capacity": res.capacity,
                          "is_lower_bound": res.is_lower_bound})
            print(f"tune {spec.label}: SLO capacity {res.capacity:g}"
                  + (" (at least)" if res.is_lower_bound else ""), flush=True)
            if top is None or res.capacity > top[0]:
                top = (res.capacity, spec.label)
            out.setdefault("tuning", {})[name] = tried
            save()
        if top is not None:
            best[name] = top[1]
            out.setdefault("best_tuned", {})[name] = top[1]
            save()
    return best


def _headline(runner: _Runner, labels: list[str], seeds: list[int], loads: list[float],
              out: dict[str, object], save: Callable[[], None]) -> None:
    """Every policy at every seed: the sweep loads run in full (unless --no-curves),
    then, with --capacity, its SLO capacity bisected below the first that fails."""
    args = runner.args
    runs: list[dict] = out["runs"]  # type: ignore[assignment]
    print(f"{'policy':<24} {'load':>6} {'tier':>4} {'att%':>6} {'feas%':>6} {'ttft50':>8} "
          f"{'ttft99':>8} {'tpot99':>7} {'done':>6} {'rej':>5} {'tok%':>6}   (times in ms; "
          "feas%: attainment among requests an idle worker could serve in time)")
    by_seed: dict[str, dict[str, float]] = {}
    for label in labels:
        for seed in seeds:
            known: dict[float, bool] = {}
            if not (args.capacity and args.no_curves):
                for load in loads:
                    r = runner.full(label, load, seed)
                    runs.append(r)
                    known[load] = bool(r["cleared"])
                    for line in _row(r):
                        print(line, flush=True)
                    save()
            if not args.capacity:
                continue
            res = find_capacity(lambda load, lb=label, s=seed: runner.probe(lb, load, s),
                                loads, bisect_steps=args.bisect, known=known)
            by_seed.setdefault(label, {})[str(seed)] = res.capacity
            print(f"{label} seed {seed}: SLO capacity {res.capacity:g}"
                  + (" (at least: every sweep load cleared)" if res.is_lower_bound else ""),
                  flush=True)
            if res.is_lower_bound:
                out.setdefault("slo_capacity_is_lower_bound", {})[label] = True  # type: ignore[union-attr]
            spreads = {lb: Spread.of(list(v.values())) for lb, v in by_seed.items()}
            out["slo_capacity_by_seed"] = by_seed
            out["slo_capacity"] = {lb: sp.mean for lb, sp in spreads.items()}
            out["slo_capacity_spread"] = {lb: sp.to_dict() for lb, sp in spreads.items()}
            save()


def run(args: argparse.Namespace) -> int:
    try:
        tiers = default_tiers()
        mix = TierMix(tuple(v / 100.0 for v in _floats(args.tier_mix, "--tier-mix")))
        if len(mix.fractions) != tiers.num_tiers:
            raise ConfigError(f"--tier-mix: {len(mix.fractions)} values for {tiers.num_tiers} tiers")
        loads = _floats(args.load, "--load")
        tune_loads = _floats(args.tune_load, "--tune-load") if args.tune_load else loads
        seeds = _ints(args.seeds, "--seeds") if args.seeds else [args.seed]
        pct = _floats(args.bars, "--bars")
        if len(pct) != 2 or max(pct) > 100:
            raise ConfigError(f"--bars: two percentages in (0, 100], got {args.bars!r}")
        bars = SloBars(pct[0] / 100, pct[1] / 100, feasible_only=args.feasible)
        if args.max_tokens < 1:
            raise ConfigError(f"--max-tokens: must be at least 1, got {args.max_tokens}")
        if args.bisect < 0:
            raise ConfigError(f"--bisect: must be >= 0, got {args.bisect}")
        PoolMode(args.mode)
        profile = PROFILES[args.profile]
        cost = CostModel(profile)
        cluster = parse_cluster(args.cluster, profile.kv_blocks_per_worker)
        labels = split_specs(args.policies)
        for text in labels:  # fail fast on a bad spec, before any simulation
            check_policy(text)
        fmt = args.format or guess_format(args.trace)
        if fmt != "poisson" and not Path(args.trace).is_file():
            raise TraceError(f"{args.trace}: no such file")
        bases = {s: read_trace(fmt, args.trace, mix, s) for s in seeds}
    except (ConfigError, TraceError, ClusterSpecError, UnknownPolicy, PolicySpecError) as e:
        print(f"tierserve simulate: {e}", file=sys.stderr)
        return 2
    runner = _Runner(args, tiers, cost, cluster, bases, fmt, bars)
    out: dict[str, object] = {
        "setup": {"trace": args.trace, "format": fmt, "cluster": args.cluster,
                  "profile": args.profile, "mode": args.mode, "max_tokens": args.max_tokens,
                  "tier_mix": args.tier_mix, "loads": loads, "seeds": seeds,
                  "duration": args.duration, "bisect": args.bisect,
                  "tune_load": tune_loads if args.tune_peers else None,
                  "tune_bisect": args.tune_bisect, "tune_window": args.tune_window,
                  "bars": {"tier0": bars.first, "others": bars.others,
                           "feasible_only": bars.feasible_only}},
        "runs": []}

    def save() -> None:
        out["probes"] = runner.probes
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(out, indent=1))

    if args.tune_peers:
        peers = [t for t in labels if check_policy(t).name != "tierserve"]
        runner.window = args.tune_window
        best = _tune(runner, list(dict.fromkeys(check_policy(t).name for t in peers)),
                     tune_loads, seeds[0], save, out)
        runner.window = None
        labels = [best.get(check_policy(t).name, t) if t in peers else t for t in labels]
        labels = list(dict.fromkeys(labels))
    _headline(runner, labels, seeds, loads, out, save)
    save()
    runs: list[dict] = out["runs"]  # type: ignore[assignment]
    if args.plot and runs:
        from scheduler.sim.plots import plot_load_curves

        plot_load_curves(runs, args.plot, out.get("slo_capacity_spread"),  # type: ignore[arg-type]
                         title=f"{Path(args.trace).name}, {args.cluster}, seeds {seeds}")
    return 0
