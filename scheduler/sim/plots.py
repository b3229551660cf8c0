"""Figures of `tierserve simulate`: tier-0 attainment and goodput against load, per policy.

Each policy's line is its mean over the seeds run at each load, with the band from the
lowest to the highest seed; the legend carries the policy's SLO capacity (mean +- std
over seeds) when it was searched. matplotlib is imported only here, on demand.
"""

from __future__ import annotations

from collections import defaultdict


def plot_load_curves(runs: list[dict], out: str,
                     capacity: dict[str, dict[str, float]] | None = None,
                     title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4.4))
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("v", "-."), ("D", "--"), ("x", ":"),
              ("P", "-"), ("*", "--")]
    for i, name in enumerate(dict.fromkeys(r["policy"] for r in runs)):
        by_load: dict[float, list[dict]] = defaultdict(list)
        for r in runs:
            if r["policy"] == name:
                by_load[r["load"]].append(r)
        loads = sorted(by_load)
        marker, ls = styles[i % len(styles)]
        label = name
        if capacity and name in capacity:
            c = capacity[name]
            label += f"  (SLO capacity {c['mean']:.2f} +- {c['std']:.2f})"
        for ax, get in ((a0, lambda r: 100 * (r["tiers"]["0"]["attainment"] or 0.0)),
                        (a1, lambda r: r["goodput_rps"])):
            vals = [[get(r) for r in by_load[x]] for x in loads]
            mean = [sum(v) / len(v) for v in vals]
            line = ax.plot(loads, mean, marker=marker, ls=ls, label=label, alpha=0.9)[0]
            if any(len(v) > 1 for v in vals):
                ax.fill_between(loads, [min(v) for v in vals], [max(v) for v in vals],
                                color=line.get_color(), alpha=0.15, lw=0)
    a0.axhline(99, color="grey", lw=0.8, ls="--")
    a0.set(xlabel="load (x trace rate)", ylabel="tier-0 SLO attainment (%)", ylim=(0, 101))
    a1.set(xlabel="load (x trace rate)", ylabel="goodput (req/s meeting their SLO)")
    a1.legend(fontsize=7, loc="upper left")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


__all__ = ["plot_load_curves"]
