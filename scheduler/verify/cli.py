"""`tierserve check`: model-check the scheduling kernel's invariants.

``--exhaustive`` explores every interleaving in a small scope
(:mod:`scheduler.verify.exhaustive`); ``--trajectories N`` runs N random
workloads (:mod:`scheduler.verify.trajectories`). Both print a summary, write
``--json OUT`` as ``{"states", "trajectories", "violations": {invariant: count},
"tier0_p99_ok_rate", "ci95", "counterexamples", ...}`` and exit 1 when any hard
invariant was violated (0 otherwise). ``--inject-fault`` plugs in a broken
policy or block account to show the checker catching it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from scheduler.ordering import UnknownPolicy
from scheduler.policies import POLICY_NAMES
from scheduler.verify.exhaustive import explore
from scheduler.verify.faults import FAULTS, fault
from scheduler.verify.model import World
from scheduler.verify.scope import Scope, ScopeError
from scheduler.verify.trajectories import WorkloadSpec, run_trajectories, trajectory_scope


def _floats(text: str) -> tuple[float, ...]:
    try:
        vals = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be positive")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--exhaustive", action="store_true",
                      help="explore every interleaving in the scope below")
    mode.add_argument("--trajectories", type=int, metavar="N",
                      help="statistical model checking over N random workloads")
    p.add_argument("--seed", type=int, default=0, help="trajectory seed base (default 0)")
    p.add_argument("--json", metavar="OUT", help="write the result as JSON here")
    p.add_argument("--policy", default="tierserve",
                   help=f"policy under check: {', '.join(POLICY_NAMES)}, with settings as "
                        "NAME:key=value,...")
    p.add_argument("--inject-fault", choices=sorted(FAULTS),
                   help="check a deliberately broken policy/account (the checker must fail)")
    s = p.add_argument_group("scope (exhaustive defaults; trajectories use a 4-tier cluster)")
    s.add_argument("--requests", type=int, default=4, help="most requests (exhaustive)")
    s.add_argument("--tiers", type=int, help="SLO tiers (default 2 exhaustive, 4 trajectories)")
    s.add_argument("--blocks", type=int, help="KV blocks per worker (default 8 / 24)")
    s.add_argument("--workers", type=int, default=2, help="workers (default 2)")
    s.add_argument("--failures", type=int, default=1, help="most worker failures per run")
    s.add_argument("--stops", type=int, default=1, help="most early stops per run (exhaustive)")
    s.add_argument("--dt", type=float, help="clock step in seconds (default 0.5 / 0.05)")
    s.add_argument("--arrival-ticks", type=int, default=1,
                   help="exhaustive: arrivals happen in the first N ticks (default 1)")
    s.add_argument("--retries", action=argparse.BooleanOptionalAction, default=None,
                   help="routers retry what a worker failure ended (default: off "
                        "exhaustive, on trajectories)")
    s.add_argument("--starvation-s", type=_floats, metavar="S0,S1,...",
                   help="per-tier starvation bounds (exhaustive default 4*dt*(tier+1))")
    s.add_argument("--max-states", type=int, help="stop exploring after this many states")
    s.add_argument("--processes", type=int, help="trajectory worker processes (default: cores)")


def _exhaustive_scope(args: argparse.Namespace) -> Scope:
    tiers = args.tiers or 2
    dt = args.dt or 0.5
    starvation = args.starvation_s or tuple(4 * dt * (t + 1) for t in range(tiers))
    return Scope(max_requests=args.requests, num_tiers=tiers, blocks_per_worker=args.blocks or 8,
                 num_workers=args.workers, max_failures=args.failures, max_stops=args.stops,
                 dt_s=dt, arrival_ticks=args.arrival_ticks, policy=args.policy,
                 starvation_s=starvation, retries=bool(args.retries)).with_default_shapes()


def _trajectory_scope(args: argparse.Namespace) -> Scope:
    scope = trajectory_scope(num_tiers=args.tiers or 4, policy=args.policy)
    changes: dict[str, object] = {"num_workers": args.workers, "max_failures": args.failures}
    if args.blocks:
        changes["blocks_per_worker"] = args.blocks
    if args.dt:
        changes["dt_s"] = args.dt
    if args.starvation_s:
        changes["starvation_s"] = args.starvation_s
    if args.retries is not None:
        changes["retries"] = args.retries
    return replace(scope, **changes)  # type: ignore[arg-type]


def run(args: argparse.Namespace) -> int:
    pf, af = fault(args.inject_fault) if args.inject_fault else (None, None)
    try:
        if args.exhaustive:
            scope = _exhaustive_scope(args)
            out = _run_exhaustive(scope, pf, af, args.max_states)
        else:
            if args.trajectories <= 0:
                print("tierserve check: --trajectories must be positive", file=sys.stderr)
                return 2
            scope = _trajectory_scope(args)
            tiers = scope.num_tiers
            mix = WorkloadSpec().tier_mix
            spec = WorkloadSpec(tier_mix=_mix_for(tiers, mix))
            out = _run_trajectories(args.trajectories, args.seed, scope, spec, pf, af,
                                    args.processes)
    except (ScopeError, UnknownPolicy, ValueError) as e:
        print(f"tierserve check: {e}", file=sys.stderr)
        return 2
    if args.inject_fault:
        out["injected_fault"] = args.inject_fault
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 1 if any(out["violations"].values()) else 0


def _mix_for(num_tiers: int, mix: tuple[float, ...]) -> tuple[float, ...]:
    base = [mix[min(i, len(mix) - 1)] for i in range(num_tiers)]
    total = sum(base)
    return tuple(x / total for x in base)


def _print_counterexamples(cexs: list[dict[str, object]]) -> None:
    for c in cexs:
        print(f"\ncounterexample: {c['invariant']}: {c['detail']}")
        if "seed" in c:
            print(f"  (trajectory seed {c['seed']})")
        for line in c["trace"]:  # type: ignore[attr-defined]
            print(f"  {line}")


def _run_exhaustive(scope: Scope, pf, af, max_states: int | None) -> dict[str, object]:  # type: ignore[no-untyped-def]
    print(f"exhaustive: policy {scope.policy}, {scope.max_requests} requests, "
          f"{scope.num_tiers} tiers, {scope.blocks_per_worker} blocks x {scope.num_workers} "
          f"workers, {scope.max_failures} failure(s){' retried' if scope.retries else ''}, "
          f"{scope.max_stops} early stop(s), dt {scope.dt_s}s, starvation bounds "
          f"{scope.starvation_s}")
    res = explore(scope, policy_factory=pf, account_factory=af, max_states=max_states,
                  progress=lambda n: print(f"  ... {n} states", flush=True))
    print(f"states {res.states}, transitions {res.transitions}, terminal {res.terminal_states}, "
          f"depth {res.max_depth}, {'complete' if res.complete else 'CUT SHORT'}, "
          f"{res.wall_s:.1f}s")
    print(f"longest wait per tier (s): {', '.join(f'{w:.2f}' for w in res.max_wait_s)}; "
          f"most preemptions on one path {res.num_preemptions} "
          f"(of a more urgent tier than the request served: {res.num_inversions})")
    print("violations: " + ", ".join(f"{k} {v}" for k, v in res.violations.items()))
    if res.num_tier_inversions and not _keeps_tier_order(scope, pf):
        print(f"tier inversions (allowed: {scope.policy} does not keep the tier order): "
              f"at most {res.num_tier_inversions} on one path")
    cexs = [c.to_dict() for c in res.counterexamples.values()]
    _print_counterexamples(cexs)
    return {"states": res.states, "trajectories": 0, "violations": res.violations,
            "tier0_p99_ok_rate": None, "ci95": None, "mode": "exhaustive",
            "transitions": res.transitions, "terminal_states": res.terminal_states,
            "max_depth": res.max_depth, "complete": res.complete,
            "max_wait_s": res.max_wait_s, "max_preemptions_per_path": res.num_preemptions,
            "max_priority_inversions_per_path": res.num_inversions,
            "max_tier_inversions_per_path": res.num_tier_inversions,
            "wall_s": res.wall_s, "scope": _scope_dict(scope), "counterexamples": cexs}


def _run_trajectories(n: int, seed: int, scope: Scope, spec: WorkloadSpec, pf, af,  # type: ignore[no-untyped-def]
                      processes: int | None) -> dict[str, object]:
    print(f"trajectories: {n} x policy {scope.policy}, {scope.num_tiers} tiers, "
          f"{scope.blocks_per_worker} blocks x {scope.num_workers} workers, dt {scope.dt_s}s, "
          f"seed {seed}")
    step = max(n // 10, 1)
    marks = iter(range(step, n + 1, step))
    mark = [next(marks, n + 1)]

    def progress(done: int) -> None:
        if done >= mark[0]:
            print(f"  ... {done} trajectories", flush=True)
            while mark[0] <= done:
                mark[0] = next(marks, n + 1)

    res = run_trajectories(n, seed=seed, scope=scope, spec=spec, policy_factory=pf,
                           account_factory=af, processes=processes, progress=progress)
    rate = res.tier0_p99_ok_rate
    ci = res.ci95
    print(f"trajectories {res.trajectories}, states {res.states}, {res.wall_s:.1f}s; "
          f"preemptions {res.preemptions} (of a more urgent tier: {res.inversions})")
    print("violations: " + ", ".join(f"{k} {v}" for k, v in res.violations.items()))
    if res.tier_inversions and not _keeps_tier_order(scope, pf):
        print(f"tier inversions (allowed: {scope.policy} does not keep the tier order): "
              f"{res.tier_inversions} selections in {res.tier_inversion_trajectories} "
              "trajectories")
    if rate is not None and ci is not None:
        print(f"tier-0 P99 TTFT within target: {rate:.4f} "
              f"(95% CI {ci[0]:.4f}-{ci[1]:.4f}, {res.tier0_trajectories} trajectories)")
    _print_counterexamples(res.counterexamples)
    return {"states": res.states, "trajectories": res.trajectories,
            "violations": res.violations, "tier0_p99_ok_rate": rate,
            "ci95": list(ci) if ci else None, "tier0_trajectories": res.tier0_trajectories,
            "preemptions": res.preemptions, "priority_inversions": res.inversions,
            "tier_inversions": res.tier_inversions,
            "tier_inversion_trajectories": res.tier_inversion_trajectories,
            "mode": "trajectories", "seed": seed, "wall_s": res.wall_s,
            "scope": _scope_dict(scope), "counterexamples": res.counterexamples}


def _keeps_tier_order(scope: Scope, pf) -> bool:  # type: ignore[no-untyped-def]
    return World.initial(scope.with_default_shapes(), pf).policy.keeps_tier_order


def _scope_dict(scope: Scope) -> dict[str, object]:
    return {"policy": scope.policy, "max_requests": scope.max_requests,
            "num_tiers": scope.num_tiers, "blocks_per_worker": scope.blocks_per_worker,
            "num_workers": scope.num_workers, "max_failures": scope.max_failures,
            "max_stops": scope.max_stops, "dt_s": scope.dt_s,
            "arrival_ticks": scope.arrival_ticks,
            "starvation_s": list(scope.starvation_s) if scope.starvation_s else None,
            "retries": scope.retries,
            "shapes": [s.label() for s in scope.shapes]}
