#!/usr/bin/env python3
"""A lower bound on the tier-0 TTFT misses of any scheduler, from the trace alone.

Usage: scripts/tier0_bound.py TRACE [--loads 0.5,1,2] [--seeds 0,1,2,3,4]
                              [--workers 2] [--profile h200-llama3-8b] [--json OUT]

For each seed's tier draw and each load, it counts:

- infeasible: tier-0 requests whose prefill alone, on an idle worker with a cold cache,
  takes longer than the tier's TTFT (no scheduler serves them in time);
- burst misses: among the feasible ones, how many must miss in bursts. Tier-0 requests
  whose windows [arrival, arrival + TTFT] overlap form a burst; every request of a burst
  met in time had its prefill computed inside the burst's span, on at most ``--workers``
  prefill workers. If the burst's prefill work (compute only: no step overheads, no other
  tier, no transfer) exceeds workers x span, requests must miss; at least as many as it
  takes to remove, largest first, until the rest fits. Bursts are disjoint in time, so
  their bounds add up.

A prompt's work is the profile's prefill compute (scheduler.sim.costmodel), the same
model the simulator charges. The bound ignores every other cost, so any scheduler on
``--workers`` prefill workers of this profile misses at least this many; the tier-0 bar
(99 % by default) is out of reach where the bound exceeds 1 % of the tier's requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler.sim.costmodel import PROFILES, CostModel  # noqa: E402
from scheduler.sim.traces import guess_format, read_trace, scale_load  # noqa: E402
from scheduler.tiers import TierMix, default_tiers  # noqa: E402


def burst_misses(jobs: list[tuple[float, float]], ttft: float, workers: int) -> int:
    """``jobs``: (arrival, prefill compute s) of the feasible tier-0 requests."""
    jobs = sorted(jobs)
    misses = 0
    i = 0
    while i < len(jobs):
        start, end = jobs[i][0], jobs[i][0] + ttft
        works = [jobs[i][1]]
        j = i + 1
        while j < len(jobs) and jobs[j][0] <= end:
            end = max(end, jobs[j][0] + ttft)
            works.append(jobs[j][1])
            j += 1
        room = workers * (end - start)
        total = sum(works)
        for w in sorted(works, reverse=True):
            if total <= room:
                break
            total -= w
            misses += 1
        i = j
    return misses


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--loads", default="0.5,1,2")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--profile", default="h200-llama3-8b")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cost = CostModel(PROFILES[args.profile])
    spec = default_tiers()[0]
    assert spec.ttft_s is not None
    ttft = spec.ttft_s
    fmt = guess_format(args.trace)
    rows = []
    print("| seed | load | tier-0 requests | infeasible | burst misses (lower bound) | "
          "best possible tier-0 attainment | among feasible |")
    print("|---|---|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        base = read_trace(fmt, args.trace, TierMix(), seed)
        for load in (float(x) for x in args.loads.split(",")):
            tier0 = [r for r in scale_load(base, load) if r.tier == 0]
            work = [(r.arrival, cost.prefill_flops(r.prompt_len, 0) / cost.flops_rate)
                    for r in tier0]
            infeasible = sum(cost.prefill_s(r.prompt_len, 0) > ttft for r in tier0)
            feasible = [(a, w) for (a, w), r in zip(work, tier0, strict=True)
                        if cost.prefill_s(r.prompt_len, 0) <= ttft]
            burst = burst_misses(feasible, ttft, args.workers)
            n = len(tier0)
            best = (n - infeasible - burst) / n if n else None
            best_f = (len(feasible) - burst) / len(feasible) if feasible else None
            rows.append({"seed": seed, "load": load, "tier0": n, "infeasible": infeasible,
                         "burst_misses": burst, "best_attainment": best,
                         "best_attainment_feasible": best_f})
            print(f"| {seed} | {load:g} | {n} | {infeasible} | {burst} | "
                  f"{100 * (best or 0):.2f} % | {100 * (best_f or 0):.2f} % |")
    if args.json:
        Path(args.json).write_text(json.dumps({"trace": args.trace, "workers": args.workers,
                                               "profile": args.profile, "ttft_s": ttft,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
