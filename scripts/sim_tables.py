#!/usr/bin/env python3
"""Markdown tables from `tierserve simulate --json` output, for the results pages.

Usage: scripts/sim_tables.py RESULT.json [RESULT.json ...] [--plot OUT.png]

Prints, for each file: the SLO capacity per policy (mean +- std over seeds, range,
per seed), the peers' tuning (each setting's capacity on the tuning seed, the winner in
bold) and the load curves (goodput and attainment per tier, mean over seeds with the
range of tier 0, preemptions and requests turned away, mean over seeds). With several files (runs of one setup split over commands), also the
SLO capacities of all of them in one table, each against the best peer's. ``--plot``
draws tier-0 attainment and goodput against load for the runs of all the files
(:func:`scheduler.sim.plots.plot_load_curves`). Reads JSON only; every figure it prints
is in the files.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path


def _f(x: float | None, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def capacity(res: dict) -> list[str]:
    caps = res.get("slo_capacity_spread")
    if not caps:
        return []
    lower = res.get("slo_capacity_is_lower_bound", {})
    by_seed = res.get("slo_capacity_by_seed", {})
    out = ["| policy | SLO capacity (mean +- std) | range | per seed |", "|---|---|---|---|"]
    for label, s in sorted(caps.items(), key=lambda kv: -kv[1]["mean"]):
        seeds = ", ".join(f"{v:g}" for v in by_seed.get(label, {}).values())
        flag = " (at least)" if lower.get(label) else ""
        out.append(f"| `{label}` | {s['mean']:.2f} +- {s['std']:.2f}{flag} | "
                   f"{s['min']:g}-{s['max']:g} | {seeds} |")
    return out


def tuning(res: dict) -> list[str]:
    tuned = res.get("tuning")
    if not tuned:
        return []
    best = res.get("best_tuned", {})
    out = ["| peer | settings tried: SLO capacity on the tuning seed |", "|---|---|"]
    for peer, tried in tuned.items():
        cells = []
        for t in tried:
            spec = t["policy"].partition(":")[2] or "defaults"
            cell = f"{spec}: {t['slo_capacity']:g}"
            cells.append(f"**{cell}**" if t["policy"] == best.get(peer) else cell)
        out.append(f"| {peer} | " + "; ".join(cells) + " |")
    return out


def curves(res: dict) -> list[str]:
    runs = res.get("runs", [])
    if not runs:
        return []
    by: dict[tuple[str, float], list[dict]] = defaultdict(list)
    for r in runs:
        by[(r["policy"], r["load"])].append(r)
    out = ["| policy | load | goodput req/s | tier 0 (min-max) | tier 1 | tier 2 | tier 3 | "
           "tier-0 feasible | preemptions | turned away | seeds |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (label, load), rs in by.items():
        t0 = [100 * (r["tiers"]["0"]["attainment"] or 0) for r in rs]
        out.append(f"| `{label}` | {load:g} | {_f(_mean([r['goodput_rps'] for r in rs]))} | "
                   f"{_f(_att(rs, '0'), 1)} ({min(t0):.1f}-{max(t0):.1f}) | "
                   f"{_f(_att(rs, '1'), 1)} | {_f(_att(rs, '2'), 1)} | {_f(_att(rs, '3'), 1)} | "
                   f"{_f(_att(rs, '0', 'attainment_feasible'), 1)} | "
                   f"{_f(_mean([r['preemptions'] for r in rs]), 0)} | "
                   f"{_f(_mean([sum(t['rejected'] for t in r['tiers'].values()) for r in rs]), 0)}"
                   f" | {len(rs)} |")
    return out


def _mean(vals: list[float | None]) -> float | None:
    got = [v for v in vals if v is not None]
    return sum(got) / len(got) if got else None


def _att(rs: list[dict], tier: str, key: str = "attainment") -> float | None:
    m = _mean([r["tiers"][tier][key] for r in rs])
    return None if m is None else 100 * m


def combined(results: list[dict]) -> list[str]:
    """The SLO capacities of several files in one table; tierserve's and each policy's
    ratio to the best peer's (the peer with the highest mean)."""
    spread: dict[str, dict] = {}
    for res in results:
        spread.update(res.get("slo_capacity_spread", {}))
    peers = {k: v for k, v in spread.items() if not k.startswith("tierserve")}
    if not spread or not peers:
        return []
    best_label, best = max(peers.items(), key=lambda kv: kv[1]["mean"])
    out = [f"best peer: `{best_label}` ({best['mean']:.3g})", "",
           "| policy | SLO capacity (mean +- std) | seeds | / best peer |", "|---|---|---|---|"]
    for label, s in sorted(spread.items(), key=lambda kv: -kv[1]["mean"]):
        ratio = s["mean"] / best["mean"] if best["mean"] > 0 else float("nan")
        out.append(f"| `{label}` | {s['mean']:.2f} +- {s['std']:.2f} | {s['n']} | "
                   f"{ratio:.2f}x |")
    return out


def main(argv: list[str]) -> int:
    plot = None
    if "--plot" in argv:
        i = argv.index("--plot")
        plot = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    results = []
    for path in argv:
        with open(path) as f:
            res = json.load(f)
        results.append(res)
        print(f"## {path}\n")
        for block in (capacity(res), tuning(res), curves(res)):
            if block:
                print("\n".join(block) + "\n")
    if len(results) > 1:
        block = combined(results)
        if block:
            print("## all files\n\n" + "\n".join(block) + "\n")
    if plot:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from scheduler.sim.plots import plot_load_curves

        runs = [r for res in results for r in res.get("runs", [])]
        spread: dict[str, dict] = {}
        for res in results:
            spread.update(res.get("slo_capacity_spread", {}))
        setup = results[0].get("setup", {}) if results else {}
        plot_load_curves(runs, plot, spread,
                         title=f"{Path(str(setup.get('trace', ''))).name}, "
                               f"{setup.get('cluster', '')}, seeds {setup.get('seeds', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
