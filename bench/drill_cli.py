"""``tierserve drill``: an operator's chaos check of a running cluster.

Runs the fault drills of :mod:`bench.drill` (kill the decode worker, a prefill worker,
the global scheduler, a router replica; optionally hang a decode worker) against
``--url`` while streams are in flight, ``--runs`` times each, and prints one line per run
and a summary per drill; ``--json OUT`` keeps every figure. The faults go through Ray, so
the command joins the cluster (``--address``: the address ``tierserve serve`` prints, or
``auto`` on a node of a ``ray start`` cluster). Exit code 0 when every run met the bounds,
1 when one did not, 2 when the cluster could not be reached.

    tierserve drill --url http://127.0.0.1:8000 --address 127.0.0.1:6379 --runs 5 \\
        --json docs/results/drill/drill.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

from bench.drill import ClusterControl, DrillBounds, DrillLoad, DrillResult, Fault, run_drill

DEFAULT_DRILLS = ("decode", "prefill", "scheduler", "router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the endpoint under drill")
    p.add_argument("--address", required=True,
                   help="Ray address of the cluster (printed by `tierserve serve`), or auto")
    p.add_argument("--namespace", default="tierserve", help="the cluster's Ray namespace")
    p.add_argument("--drills", default=",".join(DEFAULT_DRILLS),
                   help=f"comma-separated, from {', '.join(f.value for f in Fault)} "
                        f"(default {','.join(DEFAULT_DRILLS)})")
    p.add_argument("--runs", type=int, default=1, help="runs of each drill (default 1)")
    p.add_argument("--streams", type=int, default=6, help="streams in flight (default 6)")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per stream (default 48)")
    p.add_argument("--identity", action="store_true",
                   help="also check each completed stream against its undisturbed greedy "
                        "answer (only meaningful where greedy answers do not depend on the "
                        "batch, e.g. fp32)")
    p.add_argument("--gap-bound", type=float, default=10.0,
                   help="the longest a stream in flight may go without a token, its finish or "
                        "a clear error after the fault (default 10 s)")
    p.add_argument("--recovery-bound", type=float, default=30.0,
                   help="seconds in which the service must answer again (default 30)")
    p.add_argument("--api-key", default=None, help="API key, when the endpoint needs one")
    p.add_argument("--json", metavar="OUT", help="write every figure as JSON here")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


HEADER = (f"{'drill':<12} {'run':>3}  {'target':<28} {'streams':>7} {'done':>4} {'failed':>6} "
          f"{'retried':>7} {'gap s':>6} {'ended s':>7} {'serving s':>9} {'back s':>6} "
          f"{'leaked':>6}  ok")


def format_run(name: str, run: int, r: DrillResult) -> str:
    target = r.target if len(r.target) <= 28 else "…" + r.target[-27:]
    retried = "-" if r.num_retried is None else str(r.num_retried)
    leaked = "-" if r.leaked_blocks is None else str(r.leaked_blocks)
    line = (f"{name:<12} {run:>3}  {target:<28} {r.num_streams:>7} {r.num_completed:>4} "
            f"{r.num_failed:>6} {retried:>7} {_fmt(r.max_gap_s):>6} {_fmt(r.clear_s):>7} "
            f"{_fmt(r.recovery_s):>9} {_fmt(r.healed_s):>6} {leaked:>6}  "
            f"{'yes' if r.ok else 'NO'}")
    return line + ("" if r.ok else "  (" + "; ".join(r.failures) + ")")


def summarize(results: list[DrillResult]) -> dict[str, Any]:
    def worst(xs: list[float | None]) -> float | None:
        return None if not xs or any(x is None for x in xs) else max(xs)  # type: ignore[type-var]

    return {
        "runs": len(results),
        "runs_ok": sum(r.ok for r in results),
        "streams": sum(r.num_streams for r in results),
        "completed": sum(r.num_completed for r in results),
        "failed": sum(r.num_failed for r in results),
        "unresolved": sum(r.num_unresolved for r in results),
        "max_gap_s": worst([r.max_gap_s for r in results]),
        "max_clear_s": worst([r.clear_s for r in results]),
        "max_recovery_s": worst([r.recovery_s for r in results]),
        "max_healed_s": worst([r.healed_s for r in results]),
        "leaked_blocks": sum(r.leaked_blocks or 0 for r in results),
        "errors": sorted({e for r in results for e in r.errors}),
    }


def run(args: argparse.Namespace) -> int:
    try:
        faults = [Fault(name.strip()) for name in args.drills.split(",") if name.strip()]
    except ValueError as e:
        print(f"tierserve drill: {e}; choose from {', '.join(f.value for f in Fault)}",
              file=sys.stderr)
        return 2
    import ray

    _use_local_token()
    try:
        ray.init(address=args.address, namespace=args.namespace, log_to_driver=False,
                 logging_level="WARNING")
    except Exception as e:  # no cluster there
        print(f"tierserve drill: cannot join the Ray cluster at {args.address}: {e}",
              file=sys.stderr)
        return 2
    control = ClusterControl(args.namespace)
    load = DrillLoad(num_streams=args.streams, max_tokens=args.max_tokens,
                     check_identity=args.identity)
    bounds = DrillBounds(gap_s=args.gap_bound, recovery_s=args.recovery_bound)
    report: dict[str, Any] = {"url": args.url, "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "host": platform.node(), "bounds": _plain(bounds),
                              "load": _plain(load), "drills": {}}
    print(HEADER, flush=True)
    all_ok = True
    try:
        for fault in faults:
            results: list[DrillResult] = []
            for i in range(1, args.runs + 1):
                try:
                    r = asyncio.run(run_drill(args.url, fault, control, load=load,
                                              bounds=bounds, api_key=args.api_key))
                except RuntimeError as e:
                    print(f"tierserve drill: {fault.value} run {i}: {e}", file=sys.stderr)
                    return 2
                results.append(r)
                all_ok &= r.ok
                print(format_run(fault.value, i, r), flush=True)
            s = summarize(results)
            report["drills"][fault.value] = {"summary": s, "runs": [r.to_dict() for r in results]}
            print(f"{fault.value}: {s['runs_ok']}/{s['runs']} runs within bounds; "
                  f"{s['completed']} completed, {s['failed']} failed, {s['unresolved']} "
                  f"unresolved of {s['streams']} streams; longest silence "
                  f"{_fmt(s['max_gap_s'])} s, all ended within {_fmt(s['max_clear_s'])} s, "
                  f"serving again within {_fmt(s['max_recovery_s'])} s, "
                  f"back within {_fmt(s['max_healed_s'])} s; {s['leaked_blocks']} blocks leaked",
                  flush=True)
    finally:
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        ray.shutdown()
    return 0 if all_ok else 1


def _use_local_token() -> None:
    """Join with token authentication when this machine has a Ray token (Ray 2.60 turns it
    on for the clusters it starts, ``~/.ray/auth_token``) and RAY_AUTH_MODE is unset."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _plain(obj: Any) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in obj.__dataclass_fields__}
