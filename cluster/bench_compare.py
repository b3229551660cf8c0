"""Same cluster, same trace, two policies: ``python -m cluster.bench_compare``.

For each policy (default ``tierserve`` then ``vllm-fcfs``) this starts a local Ray,
deploys the cluster of ``--config`` with ``scheduling.policy`` set, replays the trace
over HTTP exactly as ``tierserve bench`` does (same seed: same arrivals, lengths,
tiers), and shuts the cluster down. It prints both summaries and writes them to
``--json`` as ``{"runs": [summary, ...], "tier0_attainment": {policy: value}}``.

On a small shared machine the first cluster of a process runs measurably slower than
the next, whatever its policy. ``--rounds N`` repeats the comparison with the order
reversed every other round (A B, B A, ...) and reports each policy's mean over its
runs (``tier0_attainment``), with every run in ``runs``.
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
    p = argparse.ArgumentParser(prog="python -m cluster.bench_compare", description=__doc__)
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

    from cluster.app import deploy, init_ray
    from cluster.config import load_config
    from cluster.http_replay import replay, summarize
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
            outcomes, elapsed, model = asyncio.run(replay(
                url, args.trace, duration=args.duration, load=args.load,
                max_prompt=args.max_prompt_tokens, max_output=args.max_output_tokens,
                max_requests=0, timeout=args.request_timeout, seed=args.seed,
                api_key="unused"))
            summary = summarize(outcomes, cfg.tier_config, min(elapsed, args.duration),
                                policy, url)
            summary["model"] = model
            summary["wall_s"] = time.time() - t0
            runs.append(summary)
            print(json.dumps({"policy": policy, "requests": summary["requests"],
                              "errors": summary["errors"],
                              "tiers": {t: {k: s[k] for k in ("attainment", "ttft_p50",
                                                              "ttft_p99", "tpot_p50")}
                                        for t, s in summary["tiers"].items()}}, indent=1),
                  flush=True)
        finally:
            cluster.shutdown()
            serve.shutdown()
            ray.shutdown()
    result = {"runs": runs, "order": order,
              "tier0_attainment": {p: statistics.fmean(r["tiers"]["0"]["attainment"]
                                                        for r in runs if r["policy"] == p)
                                   for p in policies}}
    print(json.dumps(result["tier0_attainment"]))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
