"""``tierserve bench-pressure``: KV memory pressure on a real Ray cluster, per policy.

What runs: a local Ray on this machine with the cluster's own actors (global scheduler,
one prefill worker, two decode workers declared in two NVLink domains), a tiny Llama
(fp32, a 4k context) and a KV budget per decode worker that holds about two dozen requests
of the mix,
a bounded host swap space per decode worker, and ``pools.mode: disaggregated``. An
open-loop tiered load (Poisson arrivals; tiers 0 and 1 short answers, tiers 2 and 3 long
ones, some prompts sharing a system prefix) is driven through the router's cluster
backend in this process (the router's own code, without HTTP) until every request ended.
It runs once per policy (``--policies``, default ``tierserve`` and ``vllm-priority``) and
per arrival rate (``--rates``), the order of the policies turning with each rate.

What it writes (``--json OUT``), per rate and policy: tier attainment (and TTFT / TPOT
percentiles) under the cluster's tier targets for this machine, the weighted miss
objective over them (``weighted_miss``, ``scheduler.objective``, the config's tier weights),
goodput, when the last request ended (``last_end_s``, from the first arrival), the
kernel's work-conservation seconds per tier during the run (``work_conservation_s``),
each tier's time to first token split into hops (``ttft_parts``),
preemptions by mode,
restore time by mode and by topology class (as the workers timed them: swap-in copy,
recompute from its first chunk to its next token, migration from the target's
reservation to decoding there), the pause from preemption to the next decode step, the
peak of each swap space against its budget, the prefix hit rate per worker, the link
model's measured figures, and the blocks still held once the cluster is idle again
(leaked). ``policies`` holds the headline rate: the lowest one at which a peer's tier-0
attainment falls below 90 % (else the highest). After each run a probe migrates one
``--probe-tokens`` request between the two decode workers mid-decode and then recomputes
it, and records both restore times (``migration_probe``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TIER_MIX = (0.2, 0.2, 0.3, 0.3)
# (prompt tokens low, high), (output tokens low, high) per tier, as DESIGN §5 names the
# tiers: live chat (short), agents and tools (long contexts, short answers), batch and
# best effort (long answers).
SHAPES = (((64, 256), (24, 48)), ((512, 2048), (32, 96)),
          ((128, 512), (320, 640)), ((128, 512), (320, 640)))
SYSTEM_PREFIXES = 4  # tier 0/1 prompts start with one of these 64-token prefixes
PREFIX_TOKENS = 64
PROGRESS_S = 10.0  # a progress line this often while a run's requests are live


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write the figures here")
    p.add_argument("--policies", default="tierserve,vllm-priority")
    p.add_argument("--rates", default="2.5,4",
                   help="arrival rates to run, requests per second (comma-separated)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    p.add_argument("--num-kv-blocks", type=int, default=512,
                   help="KV blocks per worker (16 tokens each)")
    p.add_argument("--swap-blocks", type=int, default=128,
                   help="host swap space of each decode worker, in blocks")
    p.add_argument("--probe-tokens", type=int, default=2000,
                   help="prompt of the migration-vs-recompute probe (0: no probe)")
    p.add_argument("--model", default="", help="checkpoint (default: a tiny Llama, 4k context)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other cluster setting")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--num-cpus", type=int, default=4, help="CPUs Ray may schedule on")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiers", choices=("cpu", "gpu"), default="cpu",
                   help="the tier targets' preset (DESIGN §5)")


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    tier: int
    prompt: tuple[int, ...]
    max_tokens: int


def workload(rate: float, duration_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals at ``rate`` for ``duration_s``: tier by TIER_MIX, lengths uniform
    in SHAPES, tier 0/1 prompts behind one of the shared system prefixes."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(256) for _ in range(PREFIX_TOKENS))
                for _ in range(SYSTEM_PREFIXES)]
    out = []
    t = rng.expovariate(rate)
    while t < duration_s:
        tier = rng.choices(range(len(TIER_MIX)), TIER_MIX)[0]
        (plo, phi), (olo, ohi) = SHAPES[tier]
        n = rng.randint(plo, phi)
        head = prefixes[rng.randrange(SYSTEM_PREFIXES)] if tier <= 1 else ()
        body = tuple(rng.randrange(256) for _ in range(n - len(head)))
        out.append(Arrival(t, tier, head + body, rng.randint(olo, ohi)))
        t += rng.expovariate(rate)
    return out


def tiny_model(root: Path) -> Path:
    from engine.testing import make_tiny_checkpoint

    return make_tiny_checkpoint("llama", root / "tiny-llama-4k", max_position_embeddings=4096)


def cluster_config(args: argparse.Namespace, model: str, policy: str,
                   extra: list[str] | tuple[str, ...] = ()) -> Any:
    from cluster.config import load_config

    return load_config(overrides=[
        # The tiny model takes ~50 ms to a first token and ~6 ms a token on an idle core,
        # but this machine's cores are shared: ``--tiers gpu`` (200 ms / 50 ms for tier 0)
        # binds on an idle host, the CPU preset (1 s / 250 ms) on a busy one.
        f"tiers.preset={args.tiers}",
        "pools.mode=disaggregated", f"model.path={model}", "model.dtype=float32",
        "pools.num_prefill=1", "pools.num_decode=2", "pools.num_cpus_per_worker=0.5",
        f"pools.num_kv_blocks={args.num_kv_blocks}",
        f"pools.num_swap_blocks={args.swap_blocks}",
        "topology.prefill=[{node: n0, nvlink_domain: nvl-a}]",
        "topology.decode=[{node: n0, nvlink_domain: nvl-a}, {node: n0, nvlink_domain: nvl-b}]",
        *args.set, *extra, f"scheduling.policy={policy}"], environ={}).resolve_presets()


async def drive(backend: Any, arrivals: list[Arrival], timeout_s: float, tag: str,
                status: Callable[[], Awaitable[str]] | None = None) -> list[Any]:
    """Every arrival at its time (open loop) through the backend; one Outcome each.
    ``status``: more for each progress line (the cluster's queue and memory)."""
    from bench.http_replay import Outcome
    from router.backend import BackendError, GenerationSpec, SamplingSpec

    async def one(i: int, a: Arrival) -> Outcome:
        await asyncio.sleep(max(0.0, start + a.at_s - time.perf_counter()))
        sent = time.perf_counter() - start
        o = await attempt(i, a)
        o.sent_s, o.end_s = sent, time.perf_counter() - start
        return o

    async def attempt(i: int, a: Arrival) -> Outcome:
        spec = GenerationSpec(f"{tag}-{i}", a.prompt, SamplingSpec(a.max_tokens, 0.0),
                              tier=a.tier, tenant="bench", arrival_time=time.time())
        t0 = time.perf_counter()
        first = last = None
        n = 0

        async def stream() -> None:
            nonlocal first, last, n
            async for d in backend.generate(spec):
                now = time.perf_counter()
                if d.token_ids:
                    first = first or now
                    last = now
                    n += len(d.token_ids)

        try:
            await asyncio.wait_for(stream(), timeout_s)
        except asyncio.TimeoutError:
            await backend.abort(spec.req_id)
            return Outcome(a.tier, False, error="timeout", req_id=spec.req_id)
        except BackendError as e:
            status = 429 if e.kind.value == "rejected" else None
            return Outcome(a.tier, False, error=str(e), status=status, req_id=spec.req_id)
        if first is None:
            return Outcome(a.tier, False, error="no tokens", req_id=spec.req_id)
        tpot = (last - first) / (n - 1) if n > 1 else None
        return Outcome(a.tier, True, first - t0, tpot, last - t0, n, req_id=spec.req_id)

    async def progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            done = sum(t.done() for t in tasks)
            more = ""
            if status is not None:
                try:
                    more = f"; {await status()}"
                except Exception as e:  # a slow answer costs the line its detail only
                    more = f"; (no status: {type(e).__name__})"
            print(f"  {tag}: {done}/{len(tasks)} requests ended after "
                  f"{time.perf_counter() - start:.0f} s{more}", flush=True)

    start = time.perf_counter()
    tasks = [asyncio.ensure_future(one(i, a)) for i, a in enumerate(arrivals)]
    ticker = asyncio.ensure_future(progress())
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        ticker.cancel()


async def _status_line(handles: Any) -> str:
    """Queued requests (by tier), live ones, those the prefill workers hold, and per decode
    worker its free and promised blocks and the swap space in use."""
    stats = await asyncio.wait_for(_stats(handles), 5)
    swap = stats["kv_memory"]["workers"]
    parts = [f"{wid} free {w['free']} promised {w['promised']} swap "
             f"{swap.get(wid, {}).get('swap_used') or 0} reserve "
             f"{'/'.join(str(x) for x in w.get('reserve') or ())}"
             for wid, w in sorted(stats["workers"].items()) if w["role"] == "decode"]
    by_tier = "/".join(str(stats.get("queued_by_tier", {}).get(str(t), 0)) for t in range(4))
    pre = sum(w["num_prefilling"] for w in stats["workers"].values() if w["role"] == "prefill")
    wc = sum(stats.get("work_conservation_s") or ())
    return (f"queued {stats['num_queued']} (by tier {by_tier}), live {stats['num_live']}, "
            f"prefilling {pre}; " + ", ".join(parts) + f"; work conservation {wc:.1f} s")


def _leaked(stats: dict[str, Any]) -> int:
    """Blocks held with nothing live: pool blocks not free, plus swapped blocks."""
    pools = sum(w["total"] - w["free"] for w in stats["workers"].values())
    swap = sum(w["swap_used"] or 0 for w in stats["kv_memory"]["workers"].values())
    return pools + swap


async def _stats(handles: Any) -> dict[str, Any]:
    from cluster.messages import unpack

    return unpack(await asyncio.wait_for(handles.scheduler.stats.remote(), 30))


async def _idle(handles: Any, timeout_s: float) -> dict[str, Any]:
    """The scheduler's stats once nothing is live and every block is back (or at the
    timeout, whatever they show then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await _stats(handles)
        if (stats["num_live"] == 0 and _leaked(stats) == 0) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.5)


PROBE_MOVES = 4  # migrations back and forth: each direction's first builds its gloo pair
PROBE_RECOMPUTES = 2
PROBE_OUTPUT = 400  # tokens: enough for every move and recompute to happen mid-decode


async def probe_migration(handles: Any, backend: Any, tokens: int, seed: int) -> dict[str, Any]:
    """A ``tokens``-token request is first run undisturbed, then again while it is migrated
    between the two decode workers (its KV over their gloo pair) PROBE_MOVES times, then
    recomputed where it is PROBE_RECOMPUTES times, each mid-decode; every restore time as
    the workers timed it (migrate: from the target's reservation to decoding there;
    recompute: from its first chunk to its next token), and whether the disturbed run's
    tokens are the undisturbed run's. Run on a cluster without prefix caching, so that a
    recompute computes the whole context as it does once its blocks were taken."""
    from router.backend import GenerationSpec, SamplingSpec
    from scheduler.messages import PreemptCall, PreemptMode, encode

    rng = random.Random(seed)
    prompt = tuple(rng.randrange(256) for _ in range(tokens))

    def spec(rid: str) -> Any:
        return GenerationSpec(rid, prompt, SamplingSpec(PROBE_OUTPUT, 0.0), tier=2,
                              tenant="bench", arrival_time=time.time())

    undisturbed: list[int] = []
    async for d in backend.generate(spec(f"probe-{seed}-ref")):
        undisturbed.extend(d.token_ids)
    rid = f"probe-{seed}"
    got: list[int] = []
    progress = asyncio.Event()

    async def run() -> None:
        async for d in backend.generate(spec(rid)):
            got.extend(d.token_ids)
            progress.set()

    async def after(n: int) -> None:
        while len(got) < n:
            progress.clear()
            await asyncio.wait_for(progress.wait(), 120)

    async def restores(mode: str) -> list[tuple[str, float, int]]:
        return [(r[2], float(r[3]), int(r[4]))
                for r in (await _stats(handles))["kv_memory"]["recent_restores"]
                if r[0] == rid and r[1] == mode]

    async def next_restore(mode: str, seen: int) -> tuple[str, float, int] | None:
        for _ in range(400):
            rs = await restores(mode)
            if len(rs) > seen:
                return rs[-1]
            await asyncio.sleep(0.05)
        return None

    task = asyncio.create_task(run())
    out: dict[str, Any] = {"tokens": tokens, "output_tokens": PROBE_OUTPUT,
                           "migrate": [], "recompute": []}
    try:
        await after(8)
        for _ in range(PROBE_MOVES):
            seen = len(await restores("migrate"))
            for wid, h in handles.decode.items():
                other = next(w for w in handles.decode if w != wid)
                if await h.preempt.remote(encode(PreemptCall(rid, PreemptMode.MIGRATE, None, other))):
                    break
            r = await next_restore("migrate", seen)
            if r is not None:
                out["migrate"].append({"class": r[0], "ms": r[1]})
            await after(len(got) + 8)
        for _ in range(PROBE_RECOMPUTES):
            seen = len(await restores("recompute"))
            for h in handles.decode.values():
                if await h.preempt.remote(encode(PreemptCall(rid, PreemptMode.RECOMPUTE))):
                    break
            r = await next_restore("recompute", seen)
            if r is not None:
                out["recompute"].append({"class": r[0], "ms": r[1], "cached_tokens": r[2]})
            await after(len(got) + 8)
        await asyncio.wait_for(task, 300)
    finally:
        if not task.done():
            task.cancel()
            await backend.abort(rid)
    out["identical"] = got == undisturbed
    # Each direction's first move also builds that pair's gloo group (once per pair in a
    # cluster's life); the later ones are what a migration costs afterwards.
    warm = [m["ms"] for m in out["migrate"][2:]]
    rec = [r["ms"] for r in out["recompute"]]
    out["migrate_ms"] = statistics.fmean(warm) if warm else None
    out["migrate_first_ms"] = [m["ms"] for m in out["migrate"][:2]]
    out["recompute_ms"] = statistics.fmean(rec) if rec else None
    if out["migrate_ms"] and out["recompute_ms"]:
        out["recompute_over_migrate"] = out["recompute_ms"] / out["migrate_ms"]
        out["migration_faster"] = out["migrate_ms"] < out["recompute_ms"]
    return out


def run_probe(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """The migration-vs-recompute probe on a cluster of its own (no prefix caching)."""

    from cluster.app import init_ray, start_workers
    from cluster.backend import ClusterBackend, HFTokenizer

    cfg = cluster_config(args, model, "tierserve", ["pools.prefix_caching=false"])
    init_ray(None, num_cpus=args.num_cpus)
    handles = start_workers(cfg)

    async def scenario() -> dict[str, Any]:
        backend = ClusterBackend(handles.scheduler, handles.decode, HFTokenizer.from_path(model),
                                 "bench", handles.max_model_len, 10.0, args.request_timeout)
        out = await probe_migration(handles, backend, args.probe_tokens, args.seed)
        out["kv_bytes"] = (args.probe_tokens * int(handles.infos[0]["bytes_per_block"])
                           // cfg.pools.block_size)
        out["leaked_blocks"] = _leaked(await _idle(handles, 60))
        return out

    try:
        return asyncio.run(scenario())
    finally:
        _stop(handles)


def _stop(handles: Any) -> None:
    import ray

    for actor in [*handles.decode.values(), *handles.prefill.values(), handles.scheduler]:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # already gone
            continue
    ray.shutdown()


def run_one(args: argparse.Namespace, model: str, policy: str, rate: float) -> dict[str, Any]:
    from bench.http_replay import summarize
    from cluster.app import init_ray, start_workers
    from cluster.backend import ClusterBackend, HFTokenizer

    cfg = cluster_config(args, model, policy)
    init_ray(None, num_cpus=args.num_cpus)
    handles = start_workers(cfg)

    async def scenario() -> dict[str, Any]:
        # One event loop for the whole run: the backend's token subscriptions live on it.
        backend = ClusterBackend(handles.scheduler, handles.decode, HFTokenizer.from_path(model),
                                 "bench", handles.max_model_len, 10.0, args.request_timeout)
        warm = workload(2.0, 2.0, args.seed + 1000)[:4]
        await drive(backend, warm, args.request_timeout, f"warm-{policy}")
        before = await _idle(handles, 60)
        arrivals = workload(rate, args.duration, args.seed)
        t0 = time.perf_counter()
        outcomes = await drive(backend, arrivals, args.request_timeout, f"{policy}-{rate}",
                               lambda: _status_line(handles))
        wall = time.perf_counter() - t0
        stats = await _idle(handles, 120)
        summary = summarize(outcomes, cfg.tier_config, args.duration, policy, "in-process")
        result = _figures(summary, stats["kv_memory"], before["kv_memory"], stats, before)
        reasons: dict[str, int] = {}
        for o in outcomes:
            if not o.ok:
                key = (o.error or "?")[:80]
                reasons[key] = reasons.get(key, 0) + 1
        result["error_reasons"] = reasons
        result["tier0_misses"] = await _explain_misses(handles, outcomes, cfg.tier_config)
        result.update(rate=rate, wall_s=wall, requests=len(outcomes))
        return result

    try:
        return asyncio.run(scenario())
    finally:
        _stop(handles)


MAX_EXPLAINED = 20  # tier-0 misses explained per run (``tierserve why``)


async def _explain_misses(handles: Any, outcomes: list[Any], tiers: Any) -> list[dict[str, Any]]:
    """Each tier-0 request that missed its target, why (its ``tierserve why`` text)."""
    from bench.http_replay import miss_reason
    from cluster.messages import unpack

    out = []
    for o in outcomes:
        reason = miss_reason(tiers[0], o) if o.tier == 0 else None
        if reason is None or len(out) >= MAX_EXPLAINED:
            continue
        report = unpack(await asyncio.wait_for(handles.scheduler.why.remote(o.req_id), 30))
        out.append({"req_id": o.req_id, "miss": reason, "ttft_s": o.ttft_s, "tpot_s": o.tpot_s,
                    "error": o.error, "why": report["text"] if report else None})
    return out


def _figures(summary: dict[str, Any], kv: dict[str, Any], base: dict[str, Any],
             stats: dict[str, Any], before: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run's figures from its ``http_replay.summarize`` summary and the scheduler's
    stats once idle (``stats``; ``kv`` its ``kv_memory``), less what the warm-up left
    (``base``: the warm-up's ``kv_memory``; ``before``: its whole stats)."""
    from bench.http_replay import counter_delta
    from router.metrics import parts_summary

    tiers = summary["tiers"]
    modes = ("swap", "recompute", "migrate")
    workers = kv["workers"]
    decode = [w for w, s in stats["workers"].items() if s["role"] == "decode"]
    return {
        "tier0_attainment": tiers["0"]["attainment"],
        "attainment": {t: s["attainment"] for t, s in tiers.items()},
        # The objective (scheduler.objective, tier weights from the run's config; a
        # rejection, an error and a timeout are misses), goodput, and when the last
        # request ended (seconds from the first arrival).
        "weighted_miss": summary["weighted_miss"],
        "goodput_rps": summary["goodput_rps"],
        "last_end_s": summary["last_end_s"],
        # Per tier, seconds past one planning interval that a waiting request fitted a
        # decode worker and was not placed, during the run (0 unless the policy claims
        # work conservation).
        "work_conservation_s": counter_delta(
            (before or {}).get("work_conservation_s"), stats.get("work_conservation_s")),
        # Per tier, the time to first token split into hops (the global queue, the hand-off
        # to the prefill worker, the wait there for a step, the prefill): n, mean, p50, p99 ms.
        "ttft_parts": parts_summary((before or {}).get("ttft_parts"), stats.get("ttft_parts")),
        "tiers": tiers,
        "errors": summary["errors"], "rejected": summary["rejected"],
        "preemptions": {m: kv["preemptions"][m] - base["preemptions"][m] for m in modes},
        # Of those, what the global scheduler ordered for waiting requests, by the
        # victim's "tier:mode" (the rest are the workers' own, for their decodes' growth).
        "preempted_for_arrivals": stats["preemptions"],
        "restore_ms": {m: kv["restore"][m].get("mean_ms") for m in modes},
        "restore": kv["restore"],
        "restore_by_class": kv["restore_by_class"],
        "paused": kv["paused"],
        "peak_swap_blocks": max((workers[w]["swap_peak"] for w in decode if w in workers),
                                default=0),
        "swap_budget_blocks": {w: workers[w]["swap_blocks"] for w in decode if w in workers},
        "leaked_blocks": _leaked(stats),
        "prefix_hit_rate": {w: s["prefix_hit_rate"] for w, s in workers.items()},
        "links": kv["links"],
    }


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import torch

    torch.set_num_threads(1)
    cache = Path(os.environ.get("TIERSERVE_CACHE", Path.home() / ".cache" / "tierserve"))
    model = args.model or str(tiny_model(cache / "bench-pressure"))
    policies = [p for p in args.policies.split(",") if p]
    rates = [float(r) for r in args.rates.split(",") if r]
    by_rate: dict[str, dict[str, Any]] = {}
    for i, rate in enumerate(rates):
        order = policies if i % 2 == 0 else policies[::-1]
        runs: dict[str, Any] = {}
        for policy in order:
            print(f"bench-pressure: {policy} at {rate} req/s", flush=True)
            runs[policy] = run_one(args, model, policy, rate)
            _print(policy, runs[policy])
            if args.json_out:  # what has run so far, should a later run not finish
                _write(args.json_out, {"partial": True, "by_rate": {**by_rate,
                                                                    str(rate): runs}})
        by_rate[str(rate)] = {p: runs[p] for p in policies}
    headline = _headline(by_rate, policies)
    probe = None
    if args.probe_tokens:
        print(f"bench-pressure: migration probe, {args.probe_tokens} tokens", flush=True)
        probe = run_probe(args, model)
        print(f"  probe: migrate {probe.get('migrate_ms')} ms (first moves "
              f"{probe.get('migrate_first_ms')}), recompute {probe.get('recompute_ms')} ms, "
              f"tokens identical: {probe.get('identical')}", flush=True)
    result = {"rates": rates, "headline_rate": headline,
              "policies": by_rate[str(headline)], "by_rate": by_rate,
              "migration_probe": probe,
              "model": model, "settings": {k: v for k, v in vars(args).items()
                                           if k != "json_out"},
              "tier_mix": TIER_MIX, "shapes": SHAPES}
    if args.json_out:
        _write(args.json_out, result)
    return 0


def _write(out: str, result: dict[str, Any]) -> None:
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2))


def _headline(by_rate: dict[str, dict[str, Any]], policies: list[str]) -> float:
    """The lowest rate at which a peer's tier-0 attainment is below 90 % (else the
    highest rate)."""
    peers = [p for p in policies if p != "tierserve"]
    for rate in sorted(by_rate, key=float):
        if any((by_rate[rate][p]["tier0_attainment"] or 0.0) < 0.9 for p in peers):
            return float(rate)
    return max(float(r) for r in by_rate)


def _print(policy: str, r: dict[str, Any]) -> None:
    from bench.http_replay import hops_line

    att = " ".join(f"t{t}={v:.3f}" if v is not None else f"t{t}=-"
                   for t, v in r["attainment"].items())
    restore = {m: (round(v, 2) if v is not None else None) for m, v in r["restore_ms"].items()}
    wm, last, wc = r.get("weighted_miss"), r.get("last_end_s"), r.get("work_conservation_s")
    print(f"  {policy} @ {r['rate']}/s: {att}  weighted miss "
          f"{'-' if wm is None else f'{wm:.3f}'}  goodput {r.get('goodput_rps', 0.0):.2f}/s  "
          f"last end {'-' if last is None else f'{last:.0f} s'}  work conservation "
          f"{'-' if wc is None else f'{sum(wc):.1f} s'}  preemptions {r['preemptions']}  "
          f"restore_ms {restore}  peak swap {r['peak_swap_blocks']}  leaked "
          f"{r['leaked_blocks']}  errors {r['errors']}  ({r['wall_s']:.0f} s)", flush=True)
    hops = hops_line(r.get("ttft_parts"))
    if hops:
        print(f"    {hops}", flush=True)
