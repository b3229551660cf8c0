"""``tierserve bench-control``: requests per second through router and global scheduler.

Starts a real local cluster (Ray, Serve's proxy, the router replica, the global scheduler
actor, decode workers) whose engines are stubs (``model.path: stub``, engine/stub.py: the
real engine's bookkeeping, no model), so every second a request spends is control
plane: HTTP, tokenizing, admission, placement, dispatch, step planning, the token batch,
the finish timings. A closed-loop client keeps ``--concurrency`` non-streaming
completions in flight for ``--requests`` requests and reports the throughput and latency::

    {"requests", "errors", "seconds", "requests_per_s", "latency_p50_s", "latency_p99_s",
     "concurrency", "max_tokens", "num_decode"}

Bounded: a fixed request count, every request with a timeout, traffic only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--tier", type=int, default=1)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", dest="json_out", metavar="OUT")


async def _drive(url: str, model: str, n: int, concurrency: int, max_tokens: int,
                 prompt_tokens: int, tier: int) -> tuple[list[float], int, float]:
    import httpx

    body = {"model": model, "prompt": list(range(1, prompt_tokens + 1)), "max_tokens": max_tokens,
            "temperature": 0.0}
    latencies: list[float] = []
    errors = 0
    left = [n]

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal errors
        while left[0] > 0:
            left[0] -= 1
            t = time.perf_counter()
            try:
                r = await client.post(f"{url}/v1/completions", json=body,
                                      headers={"x-tierserve-tier": str(tier)})
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t)
            else:
                errors += 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return latencies, errors, elapsed


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from cluster.app import deploy, init_ray
    from cluster.config import ConfigError, load_config
    from cluster.testing import free_port

    try:
        cfg = load_config(None, ["model.path=stub", "model.served_name=stub",
                                 "pools.mode=aggregated", "pools.num_prefill=0",
                                 f"pools.num_decode={args.num_decode}",
                                 "pools.num_cpus_per_worker=0.25", "pools.max_num_seqs=256",
                                 "pools.max_num_batched_tokens=8192",
                                 "pools.prefill_chunk_size=8192", "pools.num_kv_blocks=16384",
                                 f"router.port={free_port()}", *args.set])
    except ConfigError as e:
        print(f"tierserve bench-control: configuration error: {e}", file=sys.stderr)
        return 2
    init_ray(None, direct_ingress_port=cfg.router.port if cfg.router.direct_ingress else None)
    cluster = deploy(cfg)
    try:
        print(f"warming up ({cluster.url})", flush=True)
        asyncio.run(_drive(cluster.url, "stub", 50, 8, args.max_tokens, args.prompt_tokens,
                           args.tier))
        print(f"{args.requests} requests, {args.concurrency} in flight", flush=True)
        lat, errors, elapsed = asyncio.run(_drive(cluster.url, "stub", args.requests,
                                                  args.concurrency, args.max_tokens,
                                                  args.prompt_tokens, args.tier))
    finally:
        cluster.shutdown()
    out: dict[str, Any] = {
        "requests": args.requests, "errors": errors, "seconds": elapsed,
        "requests_per_s": len(lat) / elapsed if elapsed else 0.0,
        "latency_p50_s": float(np.percentile(lat, 50)) if lat else None,
        "latency_p99_s": float(np.percentile(lat, 99)) if lat else None,
        "concurrency": args.concurrency, "max_tokens": args.max_tokens,
        "num_decode": args.num_decode,
    }
    print(json.dumps(out, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0 if not errors else 1
