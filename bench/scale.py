"""``tierserve bench-scale``: a load step up and back down, against the SLO planner.

Starts a real local cluster (Ray, Serve, the router, the global scheduler actor with its
pool keeper and planner, decode workers) whose engines are *paced* stubs
(``model.stub_step_s``/``stub_token_s``, engine/stub.py): each worker has a capacity
of its own, set by that pace, so adding a worker adds capacity on a 2-core host and the
bench measures the control loop (planner decisions, worker start, drain), not the CPUs.
An open-loop client sends streaming completions (tier 0 and tier 1) at ``--base-rps``,
then ``--step-factor`` times that for ``--step-s``, then the base rate again::

    |-- before-s --|------ step-s (x factor) ------|---------- after-s ----------|

Every second it reads ``/health`` (live workers per pool). At the end it waits for the
cluster to go idle and reads ``/metrics`` (KV blocks still in use). It writes::

    {"tier0_recovery_s", "scale_down_s", "lost_requests", "leaked_blocks",
     "changes_in_steady_state", "attainment_by_tier", "requests", "timeline": [...]}

``tier0_recovery_s``: from the step to the earliest arrival from which every later
tier-0 arrival of the step phase meets its targets at >= 99 %. ``scale_down_s``: from
the fall back to the base rate until the decode pool is back at its minimum for good.
``changes_in_steady_state``: pool size changes after that, during the rest of the base
phase (run ``--after-s 720`` for the issue's ten steady minutes). ``lost_requests``: 5xx
answers, broken streams and timeouts (a 429 is admission's answer, counted as a miss).
``--plot PNG`` draws load, pool sizes and per-tier attainment over time (needs the
``bench`` extra: matplotlib). Bounded: traffic only to 127.0.0.1, a timeout on every
request, a fixed schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAMPLE_S = 1.0
BIN_S = 10.0


@dataclass
class Outcome:
    tier: int
    start_s: float  # from the start of the run
    ttft_s: float | None = None
    end_s: float | None = None
    status: int = 0
    error: str | None = None
    tokens: int = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-rps", type=float, default=3.0, help="base arrival rate (req/s)")
    p.add_argument("--step-factor", type=float, default=3.0, help="load multiplier of the step")
    p.add_argument("--before-s", type=float, default=30.0)
    p.add_argument("--step-s", type=float, default=90.0)
    p.add_argument("--after-s", type=float, default=180.0)
    p.add_argument("--tier0-fraction", type=float, default=0.3)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--stub-step-s", type=float, default=0.02,
                   help="each stub step's fixed time (s): a worker's capacity")
    p.add_argument("--stub-token-s", type=float, default=0.002,
                   help="each stub step's time per token computed (s)")
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=4)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="more configuration (planner.interval_s=5, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", metavar="OUT")
    p.add_argument("--plot", metavar="PNG", help="draw load, pool sizes and attainment")


def _schedule(args: argparse.Namespace) -> list[tuple[float, int]]:
    """(arrival s, tier) of every request: Poisson at each phase's rate."""
    rng = random.Random(args.seed)
    phases = [(0.0, args.before_s, args.base_rps),
              (args.before_s, args.before_s + args.step_s, args.base_rps * args.step_factor),
              (args.before_s + args.step_s, args.before_s + args.step_s + args.after_s,
               args.base_rps)]
    out = []
    for lo, hi, rate in phases:
        t = lo
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= hi:
                break
            out.append((t, 0 if rng.random() < args.tier0_fraction else 1))
    return out


async def _one(client: Any, o: Outcome, body: dict[str, Any], t0: float) -> None:
    """One streaming completion; its first token and its end, from the run's start."""
    try:
        async with client.stream("POST", "/v1/completions", json=body,
                                 headers={"x-tierserve-tier": str(o.tier)}) as r:
            o.status = r.status_code
            if r.status_code != 200:
                await r.aread()
                o.end_s = time.perf_counter() - t0
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    o.error = str(chunk["error"])[:200]
                    break
                if o.ttft_s is None:
                    o.ttft_s = time.perf_counter() - t0 - o.start_s
                o.tokens += 1
        o.end_s = time.perf_counter() - t0
    except Exception as e:  # a broken stream or a timeout: lost
        o.error = f"{type(e).__name__}: {e}"[:200]
        o.end_s = time.perf_counter() - t0


async def _sample(client: Any, t0: float, stop: asyncio.Event,
                  timeline: list[dict[str, Any]]) -> None:
    while not stop.is_set():
        live: dict[str, Any] = {}
        try:
            r = await client.get("/health", timeout=5.0)
            if r.status_code in (200, 503):
                live = dict(r.json().get("live_workers") or {})
        except Exception:  # not answering: an empty sample
            pass
        timeline.append({"t": round(time.perf_counter() - t0, 2),
                         "decode": live.get("decode"), "prefill": live.get("prefill")})
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_S)
        except TimeoutError:
            pass


async def _drive(url: str, args: argparse.Namespace) -> tuple[list[Outcome],
                                                               list[dict[str, Any]]]:
    import httpx

    schedule = _schedule(args)
    body = {"model": "stub", "prompt": list(range(1, args.prompt_tokens + 1)),
            "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    outcomes = [Outcome(tier, t) for t, tier in schedule]
    timeline: list[dict[str, Any]] = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120.0, connect=10.0),
                                 limits=limits) as client:
        t0 = time.perf_counter()
        sampler = asyncio.create_task(_sample(client, t0, stop, timeline))
        tasks = []
        for o in outcomes:
            delay = o.start_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, o, body, t0)))
        await asyncio.gather(*tasks)
        stop.set()
        await sampler
    return outcomes, timeline


def met(o: Outcome, ttft_s: tuple[float | None, ...]) -> bool:
    """Completed, within its tier's TTFT target (``ttft_s`` per tier; None: completed)."""
    if o.status != 200 or o.error is not None or o.ttft_s is None:
        return False
    target = ttft_s[o.tier] if o.tier < len(ttft_s) else None
    return target is None or o.ttft_s <= target


def lost(o: Outcome) -> bool:
    return o.status >= 500 or (o.status == 200 and o.error is not None) or (
        o.status == 0)


def tier0_recovery_s(outcomes: list[Outcome], ttft_s: tuple[float | None, ...],
                     step_at: float, step_end: float, bar: float = 0.99) -> float | None:
    """From the step to the earliest tier-0 arrival from which the step phase's later
    tier-0 arrivals meet their targets at >= ``bar`` (None: never within the phase)."""
    xs = sorted((o.start_s, met(o, ttft_s)) for o in outcomes
                if o.tier == 0 and step_at <= o.start_s < step_end)
    if not xs:
        return None
    n_met = sum(m for _, m in xs)
    for i, (t, _) in enumerate(xs):
        left = len(xs) - i
        if left < 10:
            return None  # too few arrivals left to judge
        if n_met / left >= bar:
            return round(t - step_at, 2)
        n_met -= xs[i][1]
    return None


def pool_changes(timeline: list[dict[str, Any]], pool: str, lo: float, hi: float
                 ) -> list[tuple[float, int]]:
    """(time, new size) each time the live size of ``pool`` changed within [lo, hi)."""
    out, last = [], None
    for s in timeline:
        n = s.get(pool)
        if n is None:
            continue
        if last is not None and n != last and lo <= s["t"] < hi:
            out.append((s["t"], n))
        last = n
    return out


def scale_down_s(timeline: list[dict[str, Any]], fall_at: float, minimum: int
                 ) -> float | None:
    """From the fall until the decode pool is at ``minimum`` for the rest of the run."""
    at = None
    for s in timeline:
        n = s.get("decode")
        if s["t"] < fall_at or n is None:
            continue
        if n <= minimum:
            at = s["t"] if at is None else at
        else:
            at = None
    return None if at is None else round(max(at - fall_at, 0.0), 2)


def attainment_bins(outcomes: list[Outcome], ttft_s: tuple[float | None, ...], end: float
                    ) -> list[dict[str, Any]]:
    bins = []
    t = 0.0
    while t < end:
        row: dict[str, Any] = {"t": t, "arrivals": 0}
        for tier in (0, 1):
            xs = [o for o in outcomes if o.tier == tier and t <= o.start_s < t + BIN_S]
            row["arrivals"] += len(xs)
            row[f"tier{tier}"] = (sum(met(o, ttft_s) for o in xs) / len(xs)) if xs else None
        bins.append(row)
        t += BIN_S
    return bins


def summarize(outcomes: list[Outcome], timeline: list[dict[str, Any]],
              args: argparse.Namespace, leaked: int | None,
              ttft_s: tuple[float | None, ...]) -> dict[str, Any]:
    """The figures of one run (``ttft_s``: each tier's TTFT target)."""
    step_at = args.before_s
    fall_at = args.before_s + args.step_s
    end = fall_at + args.after_s
    down = scale_down_s(timeline, fall_at, args.min_decode)
    steady_from = fall_at + (down if down is not None else args.after_s)
    by_tier = {}
    for tier in (0, 1):
        xs = [o for o in outcomes if o.tier == tier]
        by_tier[str(tier)] = round(sum(met(o, ttft_s) for o in xs) / len(xs), 4) if xs else None
    return {
        "tier0_recovery_s": tier0_recovery_s(outcomes, ttft_s, step_at, fall_at),
        "scale_down_s": down,
        "lost_requests": sum(map(lost, outcomes)),
        "rejected_429": sum(o.status == 429 for o in outcomes),
        "leaked_blocks": leaked,
        "changes_in_steady_state": len(pool_changes(timeline, "decode", steady_from, end)),
        "steady_s": round(max(end - steady_from, 0.0), 1),
        "attainment_by_tier": by_tier,
        "requests": len(outcomes),
        "max_decode_seen": max((s["decode"] or 0) for s in timeline) if timeline else None,
        "settings": {k: getattr(args, k) for k in (
            "base_rps", "step_factor", "before_s", "step_s", "after_s", "tier0_fraction",
            "prompt_tokens", "max_tokens", "stub_step_s", "stub_token_s", "min_decode",
            "max_decode", "seed")} | {"set": list(args.set)},
        "bins": attainment_bins(outcomes, ttft_s, end),
        "timeline": timeline,
    }


def plot(result: dict[str, Any], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("tierserve bench-scale --plot needs matplotlib: "
                         "pip install 'tierserve[bench]'") from None
    bins = result["bins"]
    tl = result["timeline"]
    fig, ax = plt.subplots(3, 1, figsize=(9, 7), sharex=True)
    ax[0].step([b["t"] for b in bins], [b["arrivals"] / BIN_S for b in bins], where="post")
    ax[0].set_ylabel("arrivals (req/s)")
    ax[1].plot([s["t"] for s in tl], [s["decode"] for s in tl], label="decode workers")
    ax[1].set_ylabel("live workers")
    ax[1].legend(loc="upper right")
    for tier in (0, 1):
        pts = [(b["t"], b[f"tier{tier}"]) for b in bins if b[f"tier{tier}"] is not None]
        ax[2].plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=f"tier {tier}")
    ax[2].axhline(0.99, color="grey", linestyle=":", linewidth=1)
    ax[2].set_ylabel(f"attainment ({BIN_S:.0f} s bins)")
    ax[2].set_xlabel("seconds")
    ax[2].legend(loc="lower right")
    s = result["settings"]
    fig.suptitle(f"bench-scale: {s['base_rps']} req/s x{s['step_factor']} for {s['step_s']} s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _bad(args: argparse.Namespace) -> str | None:
    if args.base_rps <= 0 or args.step_factor <= 0:
        return "--base-rps and --step-factor must be positive"
    if min(args.before_s, args.step_s, args.after_s) < 0:
        return "--before-s, --step-s and --after-s must be >= 0"
    if not 0.0 <= args.tier0_fraction <= 1.0:
        return "--tier0-fraction must be in [0, 1]"
    if args.prompt_tokens < 1 or args.max_tokens < 1:
        return "--prompt-tokens and --max-tokens must be >= 1"
    if not 1 <= args.min_decode <= args.max_decode:
        return "need 1 <= --min-decode <= --max-decode"
    return None


def run(args: argparse.Namespace) -> int:
    if (bad := _bad(args)) is not None:
        print(f"tierserve bench-scale: {bad}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    from bench.drill import _wait_idle
    from bench.drill_traffic import Endpoint
    from cluster.app import deploy, init_ray
    from cluster.config import ConfigError, load_config
    from cluster.testing import free_port

    try:
        cfg = load_config(None, [
            "model.path=stub", "model.served_name=stub", "pools.mode=aggregated",
            "pools.num_prefill=0", f"pools.num_decode={args.min_decode}",
            "pools.num_cpus_per_worker=0.1", "pools.max_num_seqs=64",
            "pools.max_num_batched_tokens=2048", "pools.prefill_chunk_size=2048",
            "pools.num_kv_blocks=4096", "tiers.preset=cpu",
            f"model.stub_step_s={args.stub_step_s}", f"model.stub_token_s={args.stub_token_s}",
            "planner.enabled=true", f"planner.min_decode={args.min_decode}",
            f"planner.max_decode={args.max_decode}", "planner.interval_s=5",
            "planner.cooldown_s=10", "planner.down_stable_s=30",
            f"router.port={free_port()}", *args.set])
    except ConfigError as e:
        print(f"tierserve bench-scale: configuration error: {e}", file=sys.stderr)
        return 2
    init_ray(None, direct_ingress_port=cfg.router.port if cfg.router.direct_ingress else None)
    cluster = deploy(cfg)
    try:
        total = args.before_s + args.step_s + args.after_s
        print(f"bench-scale: {args.base_rps} req/s, x{args.step_factor} at {args.before_s} s "
              f"for {args.step_s} s, {total:.0f} s in all ({cluster.url})", flush=True)
        outcomes, timeline = asyncio.run(_drive(cluster.url, args))

        async def idle() -> int | None:
            http = Endpoint(cluster.url, None)
            try:
                health = await http.health() or {}
                _, used = await _wait_idle(http, dict(health.get("live_workers") or {}))
                return used
            finally:
                await http.close()

        leaked = asyncio.run(idle())
    finally:
        cluster.shutdown()
    result = summarize(outcomes, timeline, args, leaked,
                       tuple(t.ttft_s for t in cfg.tier_config.tiers))
    brief = {k: v for k, v in result.items() if k not in ("bins", "timeline", "settings")}
    print(json.dumps(brief, indent=1))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)
    return 0


__all__ = ["Outcome", "add_arguments", "run", "summarize", "tier0_recovery_s",
           "scale_down_s", "pool_changes"]
