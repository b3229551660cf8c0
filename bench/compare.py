"""Same cluster, same trace, two policies: ``python -m bench.compare``.

For each policy (default ``tierserve`` then ``vllm-fcfs``) this starts a local Ray,
deploys the cluster of ``--config`` with ``scheduling.policy`` set, replays the trace
over HTTP exactly as ``tierserve bench`` does (same seed: same arrivals, lengths,
tiers), and shuts the cluster down. It prints both summaries and writes them to
``--json`` as ``{"runs": [summary, ...], "tier0_attainment": {policy: value}}``.

On a small shared machine the first cluster of a process runs measurably slower than
the next, whatever its policy. ``--rounds N`` repeats the comparison with the order
reversed every other round (A B, B A, ...) and reports each policy's mean over its
runs (``tier0_attainment``), with every run in ``runs``. Each run's summary carries the
objective ``weighted_miss`` (``scheduler.objective``, the config's tier weights),
``goodput_rps``, ``last_end_s`` and ``work_conservation_s`` (per tier, what the cluster's
``tierserve:work_conservation_seconds_total`` grew during the run) and ``ttft_parts`` (per
tier, the time to first token split into hops, ``tierserve:ttft_part_seconds``); ``weighted_miss`` and
``last_end_s`` are also given per policy, as means over its runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    p.add_argument("--trace", required=True)
    p.add_argument("--config", help="cluster YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--policies", default="tierserve,vllm-fcfs")
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--load", type=float, default=1.0)
    p.add_argument("--max-prompt-tokens", type=int, default=0)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat, reversing the policy order every other round")
    p.add_argument("--json", dest="json_out")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")

    import ray
    from ray import serve

    from bench.http_replay import counters, counters_delta, replay, summarize
    from cluster.app import deploy, init_ray
    from cluster.config import load_config
    from cluster.testing import free_port

    runs: list[dict[str, Any]] = []
    policies = args.policies.split(",")
    order = [p for r in range(args.rounds) for p in (policies if r % 2 == 0 else policies[::-1])]
    for policy in order:
        cfg = load_config(args.config, [*args.set, f"scheduling.policy={policy}",
                                        f"router.port={free_port()}"])
        init_ray(None, num_cpus=args.num_cpus)
        cluster = deploy(cfg)
        try:
            url = cluster.url
            # Warm up the pair groups and the model before measuring.
            asyncio.run(replay(url, args.trace, duration=2.0, load=args.load,
                               max_prompt=args.max_prompt_tokens, max_output=4, max_requests=4,
                               timeout=args.request_timeout, seed=args.seed + 1,
                               api_key="unused"))
            t0 = time.time()
            before = counters(url)
            outcomes, elapsed, model = asyncio.run(replay(
                url, args.trace, duration=args.duration, load=args.load,
                max_prompt=args.max_prompt_tokens, max_output=args.max_output_tokens,
                max_requests=0, timeout=args.request_timeout, seed=args.seed,
                api_key="unused"))
            summary = summarize(outcomes, cfg.tier_config, min(elapsed, args.duration),
                                policy, url)
            summary["model"] = model
            summary["wall_s"] = time.time() - t0
            summary.update(counters_delta(before, counters(url)))
            runs.append(summary)
            print(json.dumps({"policy": policy, "requests": summary["requests"],
                              "errors": summary["errors"],
                              **{k: summary[k] for k in ("weighted_miss", "goodput_rps",
                                                         "last_end_s", "work_conservation_s")},
                              "tiers": {t: {k: s[k] for k in ("attainment", "ttft_p50",
                                                              "ttft_p99", "tpot_p50")}
                                        for t, s in summary["tiers"].items()}}, indent=1),
                  flush=True)
        finally:
            cluster.shutdown()
            serve.shutdown()
            ray.shutdown()
    def mean(key: str, p: str) -> float | None:
        xs = [r[key] for r in runs if r["policy"] == p and r.get(key) is not None]
        return statistics.fmean(xs) if xs else None

    result = {"runs": runs, "order": order,
              "tier0_attainment": {p: statistics.fmean(r["tiers"]["0"]["attainment"]
                                                        for r in runs if r["policy"] == p)
                                   for p in policies},
              "weighted_miss": {p: mean("weighted_miss", p) for p in policies},
              "last_end_s": {p: mean("last_end_s", p) for p in policies}}
    print(json.dumps({k: result[k] for k in ("tier0_attainment", "weighted_miss",
                                             "last_end_s")}))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
