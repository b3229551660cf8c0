"""Statistical model checking: many short random workloads through the real kernel.

Each trajectory draws a workload from a seed (3 to 10 requests across the
tiers, prompt and output lengths, Poisson-like gaps with bursts), then drives a
:class:`scheduler.verify.model.World` tick by tick: random early stops and at
most one worker failure at the tick start, due arrivals, the cluster
scheduler's plan when one is due, sometimes a failure after it (and its plan),
then the clock tick (every worker's step). The invariants are checked after
every event; the first violation ends the trajectory and is kept as a
counterexample (seed and event trace).

The soft invariant is tier 0's P99 TTFT within its target, per trajectory that
has tier-0 requests (a request still without a first token at the end counts
with its time so far). Its rate across trajectories comes with a Wilson 95 %
interval. Large counts run in worker processes (fork), each a range of seeds;
they report back msgpack-encoded tallies.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack

from scheduler.invariants import HARD_INVARIANTS, Violation
from scheduler.verify.model import AccountFactory, Event, EventKind, PolicyFactory, World
from scheduler.verify.scope import Scope, Shape

Z95 = 1.959963984540054
MAX_KEPT_COUNTEREXAMPLES = 5


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """How random workloads are drawn."""

    min_requests: int = 3
    max_requests: int = 10
    # Tier fractions (default DESIGN's 10/40/30/20 mix); must match the scope's tiers.
    tier_mix: tuple[float, ...] = (0.10, 0.40, 0.30, 0.20)
    min_prompt: int = 16
    max_prompt: int = 320
    max_output: int = 96
    mean_gap_ticks: float = 2.0
    burst_prob: float = 0.25  # an arrival brings 2 to 4 requests at once
    stop_prob: float = 0.05  # per decoding request per tick
    fail_prob: float = 0.02  # per tick, while the scope allows a failure
    plan_first_prob: float = 0.7  # the plan runs before the workers step (else among them)
    shared_prefix_prob: float = 0.6  # the prompt starts with the common system block
    follow_up_prob: float = 0.3  # the prompt extends an earlier request's prompt

    def __post_init__(self) -> None:
        if not 0 < self.min_requests <= self.max_requests:
            raise ValueError("min_requests/max_requests: need 0 < min <= max")
        if abs(sum(self.tier_mix) - 1.0) > 1e-6 or any(f < 0 for f in self.tier_mix):
            raise ValueError(f"tier_mix: fractions must be >= 0 and sum to 1, got {self.tier_mix}")


def trajectory_scope(num_tiers: int = 4, policy: str = "tierserve") -> Scope:
    """A small 2-worker cluster on a 50 ms clock: tier 0's 200 ms TTFT is 4 ticks,
    the 1 s anti-thrash window 20 ticks; 24 KV blocks per worker of 16 tokens; the
    routers retry what a worker failure ends."""
    return Scope(max_requests=64, num_tiers=num_tiers, blocks_per_worker=24, num_workers=2,
                 max_failures=1, max_stops=64, dt_s=0.05, arrival_ticks=10_000,
                 max_ticks=600, block_size=16, tokens_per_tick=10, step_budget_tokens=512,
                 policy=policy, prefill_per_token_s=2e-4, decode_per_token_s=0.005,
                 retries=True)


@dataclass(slots=True)
class TrajectoryOutcome:
    num_events: int
    num_preemptions: int
    num_inversions: int
    # Selections that passed a hopeless request over for a less urgent tier's feasible
    # work (a violation for a policy that keeps the tier order; counted for the others).
    num_tier_inversions: int
    violations: list[Violation]
    trace: list[str]
    tier0_ok: bool | None


@dataclass(slots=True)
class TrajectoryResult:
    trajectories: int = 0
    states: int = 0
    violations: dict[str, int] = field(
        default_factory=lambda: {inv.value: 0 for inv in HARD_INVARIANTS})
    tier0_trajectories: int = 0
    tier0_ok: int = 0
    preemptions: int = 0
    inversions: int = 0  # preemptions of a more urgent tier than the request served
    tier_inversions: int = 0  # selections that passed over a hopeless more urgent request
    tier_inversion_trajectories: int = 0  # trajectories with at least one
    counterexamples: list[dict[str, object]] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def num_violations(self) -> int:
        return sum(self.violations.values())

    @property
    def tier0_p99_ok_rate(self) -> float | None:
        return self.tier0_ok / self.tier0_trajectories if self.tier0_trajectories else None

    @property
    def ci95(self) -> tuple[float, float] | None:
        if not self.tier0_trajectories:
            return None
        return wilson_interval(self.tier0_ok, self.tier0_trajectories)

    def merge(self, other: TrajectoryResult) -> None:
        self.trajectories += other.trajectories
        self.states += other.states
        for k, v in other.violations.items():
            self.violations[k] = self.violations.get(k, 0) + v
        self.tier0_trajectories += other.tier0_trajectories
        self.tier0_ok += other.tier0_ok
        self.preemptions += other.preemptions
        self.inversions += other.inversions
        self.tier_inversions += other.tier_inversions
        self.tier_inversion_trajectories += other.tier_inversion_trajectories
        room = MAX_KEPT_COUNTEREXAMPLES - len(self.counterexamples)
        self.counterexamples.extend(other.counterexamples[:max(room, 0)])

    def to_wire(self) -> bytes:
        return msgpack.packb({"trajectories": self.trajectories, "states": self.states,
                              "violations": self.violations,
                              "tier0_trajectories": self.tier0_trajectories,
                              "tier0_ok": self.tier0_ok, "preemptions": self.preemptions,
                              "inversions": self.inversions,
                              "tier_inversions": self.tier_inversions,
                              "tier_inversion_trajectories": self.tier_inversion_trajectories,
                              "counterexamples": self.counterexamples})

    @classmethod
    def from_wire(cls, data: bytes) -> TrajectoryResult:
        d = msgpack.unpackb(data)
        return cls(trajectories=d["trajectories"], states=d["states"],
                   violations=dict(d["violations"]),
                   tier0_trajectories=d["tier0_trajectories"], tier0_ok=d["tier0_ok"],
                   preemptions=d["preemptions"], inversions=d["inversions"],
                   tier_inversions=d["tier_inversions"],
                   tier_inversion_trajectories=d["tier_inversion_trajectories"],
                   counterexamples=list(d["counterexamples"]))


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion."""
    if n <= 0:
        raise ValueError(f"n: must be positive, got {n}")
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # At p = 0 or 1 the bound is exactly that end (rounding must not leave p outside).
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    hi = 1.0 if successes == n else min(1.0, centre + half)
    return lo, hi


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(0.99 * len(s)) - 1)]


def _draw_workload(rng: random.Random, spec: WorkloadSpec,
                   num_tiers: int) -> list[tuple[int, Shape]]:
    n = rng.randint(spec.min_requests, spec.max_requests)
    mix = list(spec.tier_mix[:num_tiers])
    out: list[tuple[int, Shape]] = []
    tick = 0
    while len(out) < n:
        k = rng.randint(2, 4) if rng.random() < spec.burst_prob else 1
        for _ in range(min(k, n - len(out))):
            tier = rng.choices(range(num_tiers), weights=mix)[0]
            prompt = rng.randint(spec.min_prompt, spec.max_prompt)
            nblocks = prompt // 16
            if out and rng.random() < spec.follow_up_prob:
                # A conversation's next turn: an earlier prompt, then new blocks.
                head = rng.choice(out)[1].block_hashes[:nblocks]
            else:
                head = (1,) if nblocks and rng.random() < spec.shared_prefix_prob else ()
            hashes = head + tuple(rng.randrange(2, 1 << 30) for _ in range(nblocks - len(head)))
            out.append((tick, Shape(tier, prompt, rng.randint(1, spec.max_output), hashes)))
        tick += int(rng.expovariate(1.0 / spec.mean_gap_ticks)) if spec.mean_gap_ticks > 0 else 0
    return out


def run_one(seed: int, scope: Scope, spec: WorkloadSpec, *,
            policy_factory: PolicyFactory | None = None,
            account_factory: AccountFactory | None = None) -> TrajectoryOutcome:
    rng = random.Random(seed)
    if len(spec.tier_mix) < scope.num_tiers:
        raise ValueError(f"tier_mix: {len(spec.tier_mix)} fractions for {scope.num_tiers} tiers")
    arrivals = _draw_workload(rng, spec, scope.num_tiers)
    world = World.initial(scope, policy_factory, account_factory)
    events: list[tuple[float, Event]] = []
    nxt = 0
    found: list[Violation] = []

    def do(ev: Event) -> bool:
        events.append((world.now, ev))
        found.extend(world.apply(ev))
        return bool(found)

    def settle(order: list[Event]) -> bool:
        """Run ``order`` where enabled, then whatever must happen before the tick (a due
        plan, the steps of workers that have work). True: a violation."""
        for ev in order:
            due = world.plan_due if ev.kind is EventKind.PLAN else world.has_waiting(ev.worker)
            if due and do(ev):
                return True
        while world.plan_due or any(world.has_waiting(w) for w in range(scope.num_workers)):
            ev = (Event(EventKind.PLAN) if world.plan_due else
                  Event(EventKind.STEP, worker=next(w for w in range(scope.num_workers)
                                                    if world.has_waiting(w))))
            if do(ev):
                return True
        return False

    while True:
        if world.failures_left() and rng.random() < spec.fail_prob / 2:
            busy = [w for w in range(scope.num_workers) if world.worker_busy(w)]
            if busy and do(Event(EventKind.FAIL, worker=rng.choice(busy))):
                break
        for i in range(len(world.reqs)):
            if world.can_stop(i) and rng.random() < spec.stop_prob:
                if do(Event(EventKind.STOP, req=i)):
                    break
        if found:
            break
        while nxt < len(arrivals) and arrivals[nxt][0] <= world.tick:
            if do(Event(EventKind.ARRIVE, shape=arrivals[nxt][1])):
                break
            nxt += 1
        if found:
            break
        # The plan and the workers' steps in random order (a worker that steps before
        # the plan leaves its new dispatches for the next tick).
        order = [Event(EventKind.STEP, worker=w) for w in range(scope.num_workers)]
        rng.shuffle(order)
        order.insert(0 if rng.random() < spec.plan_first_prob else rng.randint(1, len(order)),
                     Event(EventKind.PLAN))
        if settle(order):
            break
        if world.failures_left() and rng.random() < spec.fail_prob / 2:
            busy = [w for w in range(scope.num_workers) if world.worker_busy(w)]
            if busy and do(Event(EventKind.FAIL, worker=rng.choice(busy))):
                break
            if settle([]):
                break
        if (nxt >= len(arrivals) and not world.live()) or world.tick >= scope.max_ticks:
            break
        if do(Event(EventKind.TICK)):
            break
    return TrajectoryOutcome(len(events), world.num_preemptions, world.num_inversions,
                             world.sink.num_inversions, found,
                             _labels(events, scope) if found else [],
                             _tier0_ok(world))


def _labels(events: list[tuple[float, Event]], scope: Scope) -> list[str]:
    out = []
    n_arrived = 0
    for now, ev in events:
        t = f"t={now:.3f}"
        if ev.kind is EventKind.ARRIVE and ev.shape is not None:
            out.append(f"{t} arrive r{n_arrived} {ev.shape.label()}")
            n_arrived += 1
        elif ev.kind is EventKind.TICK:
            out.append(f"{t} tick")
        elif ev.kind is EventKind.STOP:
            out.append(f"{t} stop r{ev.req}")
        elif ev.kind is EventKind.PLAN:
            out.append(f"{t} plan")
        elif ev.kind is EventKind.STEP:
            out.append(f"{t} step w{ev.worker}")
        else:
            out.append(f"{t} {ev.kind.value} w{ev.worker}")
    return out


def _tier0_ok(world: World) -> bool | None:
    target = world.tiers[0].ttft_s or world.tiers[0].deadline_s
    ttfts = list(world.ttfts[0])
    for r, a in zip(world.reqs, world.aux, strict=True):
        if (r.tier == 0 and r.first_token_time is None and not r.state.is_finished
                and not a.streamed):
            ttfts.append(world.now - r.arrival_time)
    if not ttfts:
        return None
    return p99(ttfts) <= target + 1e-9


def run_range(start: int, count: int, scope: Scope, spec: WorkloadSpec, *,
              policy_factory: PolicyFactory | None = None,
              account_factory: AccountFactory | None = None) -> TrajectoryResult:
    res = TrajectoryResult()
    for seed in range(start, start + count):
        out = run_one(seed, scope, spec, policy_factory=policy_factory,
                      account_factory=account_factory)
        res.trajectories += 1
        res.states += out.num_events
        res.preemptions += out.num_preemptions
        res.inversions += out.num_inversions
        res.tier_inversions += out.num_tier_inversions
        res.tier_inversion_trajectories += int(out.num_tier_inversions > 0)
        if out.violations:
            for inv in {v.invariant.value for v in out.violations}:
                res.violations[inv] += 1
            if len(res.counterexamples) < MAX_KEPT_COUNTEREXAMPLES:
                v = out.violations[0]
                res.counterexamples.append({"invariant": v.invariant.value, "detail": v.detail,
                                            "seed": seed, "trace": out.trace})
        if out.tier0_ok is not None:
            res.tier0_trajectories += 1
            res.tier0_ok += int(out.tier0_ok)
    return res


# Set before forking the pool; children inherit it (nothing pickled but seed ranges).
_JOB: tuple[Scope, WorkloadSpec, PolicyFactory | None, AccountFactory | None] | None = None


def _run_chunk(bounds: tuple[int, int]) -> bytes:
    assert _JOB is not None
    scope, spec, pf, af = _JOB
    return run_range(bounds[0], bounds[1], scope, spec, policy_factory=pf,
                     account_factory=af).to_wire()


def run_trajectories(n: int, *, seed: int = 0, scope: Scope | None = None,
                     spec: WorkloadSpec | None = None,
                     policy_factory: PolicyFactory | None = None,
                     account_factory: AccountFactory | None = None,
                     processes: int | None = None,
                     parallel_min: int = 2000,
                     progress: Callable[[int], None] | None = None) -> TrajectoryResult:
    """Run ``n`` trajectories (seeds ``seed * 10**9 + i``), in ``processes`` worker
    processes once ``n`` reaches ``parallel_min``."""
    global _JOB
    if n <= 0:
        raise ValueError(f"trajectories: must be positive, got {n}")
    start_t = time.perf_counter()
    scope = scope or trajectory_scope()
    spec = spec or WorkloadSpec()
    base = seed * 10**9
    procs = processes if processes is not None else min(os.cpu_count() or 1, 8)
    if procs <= 1 or n < parallel_min:
        res = run_range(base, n, scope, spec, policy_factory=policy_factory,
                        account_factory=account_factory)
    else:
        chunk = max(1, min(500, n // (procs * 4)))
        bounds = [(base + i, min(chunk, n - i)) for i in range(0, n, chunk)]
        _JOB = (scope, spec, policy_factory, account_factory)
        try:
            with multiprocessing.get_context("fork").Pool(procs) as pool:
                res = TrajectoryResult()
                for data in pool.imap_unordered(_run_chunk, bounds):
                    res.merge(TrajectoryResult.from_wire(data))
                    if progress is not None:
                        progress(res.trajectories)
        finally:
            _JOB = None
    res.wall_s = time.perf_counter() - start_t
    return res
