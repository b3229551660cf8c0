"""`tierserve simulate`: replay a trace through the simulator for each policy and load.

Prints one table row per policy, load and tier; ``--json`` writes
``{"runs": [...]}`` (see :func:`scheduler.sim.metrics.summarize` for the fields);
``--plot`` draws tier-0 attainment and goodput against load. ``--mode`` picks where
prefills run (the cluster scheduler's ``PoolMode``); ``--max-tokens`` is every
request's max_tokens budget, what the kernel sees in place of the trace's output
length (which only decides where the simulated model emits EOS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scheduler.cluster_scheduler import PoolMode
from scheduler.ordering import UnknownPolicy
from scheduler.policies import POLICY_NAMES, make_policy
from scheduler.policy import PolicyContext
from scheduler.sim.cluster import DEFAULT_CLUSTER, ClusterSpecError, parse_cluster
from scheduler.sim.costmodel import PROFILES, CostModel
from scheduler.sim.metrics import summarize
from scheduler.sim.simulator import DEFAULT_MAX_TOKENS, Simulator
from scheduler.sim.traces import TraceError, guess_format, read_trace, scale_load
from scheduler.tiers import ConfigError, TierMix, default_tiers


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True,
                   help="trace file, or for --format poisson a spec like rate=5,duration=60")
    p.add_argument("--format", choices=("azure", "mooncake", "poisson"), default=None,
                   help="trace format (default: from the file name)")
    p.add_argument("--policies", default=",".join(POLICY_NAMES),
                   help="comma-separated policy names (tierserve[:utility|slack|wfq], peers)")
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
    p.add_argument("--tier-mix", default="10,40,30,20", help="tier percentages when the trace has none")
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON here")
    p.add_argument("--plot", default=None, help="write an attainment-vs-load PNG here")


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list of numbers") from None
    if not vals or any(not v > 0 for v in vals):
        raise ConfigError(f"{what}: needs positive numbers, got {text!r}")
    return vals


def _row(run: dict) -> list[str]:
    rows = []
    for t, d in run["tiers"].items():
        att = "-" if d["attainment"] is None else f"{100 * d['attainment']:.1f}"
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{1000 * x:.0f}"
        rows.append(f"{run['policy']:<18} {run['load']:>5g} {t:>4} {att:>6} {ms(d['ttft_p50']):>8} "
                    f"{ms(d['ttft_p99']):>8} {ms(d['tpot_p99']):>7} {d['completed']:>6} "
                    f"{d['rejected']:>5} {100 * d['token_share']:>6.1f}")
    hit = run["prefix_hit_rate"]
    rows.append(f"{'':<18} {'':>5} {'all':>4} goodput {run['goodput_rps']:.2f} req/s, "
                f"{run['throughput_tok_s']:.0f} tok/s, {run['preemptions']} preemptions, "
                f"prefix hit {'-' if hit is None else f'{100 * hit:.1f}%'}"
                + (f" (Belady {100 * run['belady_hit_rate']:.1f}%)"
                   if run.get("belady_hit_rate") is not None else "")
                + f", {run['wall_s']:.1f}s wall")
    return rows


def plot(runs: list[dict], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(11, 4))
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("v", "-."), ("D", "--"), ("x", ":")]
    for i, name in enumerate(dict.fromkeys(r["policy"] for r in runs)):
        rs = sorted((r for r in runs if r["policy"] == name), key=lambda r: r["load"])
        loads = [r["load"] for r in rs]
        marker, ls = styles[i % len(styles)]
        kw = {"marker": marker, "ls": ls, "label": name, "alpha": 0.85}
        a0.plot(loads, [100 * (r["tiers"]["0"]["attainment"] or 0) for r in rs], **kw)
        a1.plot(loads, [r["goodput_rps"] for r in rs], **kw)
    a0.axhline(99, color="grey", lw=0.8, ls="--")
    a0.axhline(90, color="grey", lw=0.8, ls=":")
    a0.set(xlabel="load (x trace rate)", ylabel="tier-0 SLO attainment (%)", ylim=(0, 101))
    a1.set(xlabel="load (x trace rate)", ylabel="goodput (req/s meeting their SLO)")
    a0.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    try:
        tiers = default_tiers()
        mix = TierMix(tuple(v / 100.0 for v in _floats(args.tier_mix, "--tier-mix")))
        if len(mix.fractions) != tiers.num_tiers:
            raise ConfigError(f"--tier-mix: {len(mix.fractions)} values for {tiers.num_tiers} tiers")
        loads = _floats(args.load, "--load")
        if args.max_tokens < 1:
            raise ConfigError(f"--max-tokens: must be at least 1, got {args.max_tokens}")
        mode = PoolMode(args.mode)
        profile = PROFILES[args.profile]
        cost = CostModel(profile)
        cluster = parse_cluster(args.cluster, profile.kv_blocks_per_worker)
        names = [n.strip() for n in args.policies.split(",") if n.strip()]
        for n in names:  # fail fast on a bad name, before any simulation
            make_policy(n, PolicyContext(tiers, cost, cost.links, cost.block_size))
        fmt = args.format or guess_format(args.trace)
        if fmt != "poisson" and not Path(args.trace).is_file():
            raise TraceError(f"{args.trace}: no such file")
        base = read_trace(fmt, args.trace, mix, args.seed)
    except (ConfigError, TraceError, ClusterSpecError, UnknownPolicy) as e:
        print(f"tierserve simulate: {e}", file=sys.stderr)
        return 2
    runs = []
    print(f"{'policy':<18} {'load':>5} {'tier':>4} {'att%':>6} {'ttft50':>8} {'ttft99':>8} "
          f"{'tpot99':>7} {'done':>6} {'rej':>5} {'tok%':>6}   (times in ms)")
    for load in loads:
        trace = scale_load(base, load, args.duration)
        for name in names:
            sim = Simulator(trace, name, cluster, cost, tiers, mode=mode,
                            max_tokens=args.max_tokens).run()
            r = summarize(sim, load, with_belady=(fmt != "azure"))
            runs.append(r)
            for line in _row(r):
                print(line, flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"runs": runs}, indent=1))
    if args.plot:
        plot(runs, args.plot)
    return 0
