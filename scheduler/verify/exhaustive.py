"""Exhaustive exploration: every interleaving of events in a small scope.

Depth-first over :class:`scheduler.verify.model.World` states from the empty
cluster: each state's enabled events (arrivals of every shape, the cluster
scheduler's plan, each worker's step, early stops, worker failures, clock
ticks) are applied to a copy, the invariants checked, and the new state kept
only if its key (everything that decides the future, hashed) has not been
seen. A violating state is not expanded further; the first (shortest found)
trace of events reaching each violated invariant is the counterexample.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.invariants import HARD_INVARIANTS, Violation
from scheduler.verify.model import AccountFactory, PolicyFactory, World
from scheduler.verify.scope import Scope


@dataclass(frozen=True, slots=True)
class Counterexample:
    invariant: str
    detail: str
    trace: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"invariant": self.invariant, "detail": self.detail, "trace": list(self.trace)}


@dataclass(slots=True)
class ExploreResult:
    states: int = 0
    transitions: int = 0
    terminal_states: int = 0
    max_depth: int = 0
    violations: dict[str, int] = field(
        default_factory=lambda: {inv.value: 0 for inv in HARD_INVARIANTS})
    counterexamples: dict[str, Counterexample] = field(default_factory=dict)
    max_wait_s: list[float] = field(default_factory=list)
    # Most preemptions, and most priority inversions (victim more urgent than the
    # request it made room for), on one path.
    num_preemptions: int = 0
    num_inversions: int = 0
    # Most selections on one path that passed a hopeless request over for a less urgent
    # tier's feasible work (violations for a policy that keeps the tier order).
    num_tier_inversions: int = 0
    # False when max_states cut the search short.
    complete: bool = True
    wall_s: float = 0.0

    @property
    def num_violations(self) -> int:
        return sum(self.violations.values())


_Trace = tuple[str, "_Trace"] | None


def _unwind(node: _Trace) -> tuple[str, ...]:
    out: list[str] = []
    while node is not None:
        out.append(node[0])
        node = node[1]
    return tuple(reversed(out))


def explore(scope: Scope, *, policy_factory: PolicyFactory | None = None,
            account_factory: AccountFactory | None = None, max_states: int | None = None,
            progress: Callable[[int], None] | None = None) -> ExploreResult:
    """Visit every state reachable in ``scope``; count and explain violations."""
    start = time.perf_counter()
    scope = scope.with_default_shapes()
    res = ExploreResult()
    root = World.initial(scope, policy_factory, account_factory)
    res.max_wait_s = [0.0] * scope.num_tiers
    seen: set[int] = {hash(root.key())}
    res.states = 1
    bad_seen: set[int] = set()
    stack: list[tuple[World, _Trace, int]] = [(root, None, 0)]
    while stack:
        world, trace, depth = stack.pop()
        events = world.enabled()
        if not events:
            res.terminal_states += 1
            continue
        for n, ev in enumerate(events):
            nxt = world if n == len(events) - 1 else world.clone()
            label = nxt.describe(ev)
            found = nxt.apply(ev)
            nxt.compact()
            res.transitions += 1
            node: _Trace = (label, trace)
            key = hash(nxt.key())
            for t, w in enumerate(nxt.max_wait_s):
                res.max_wait_s[t] = max(res.max_wait_s[t], w)
            res.num_preemptions = max(res.num_preemptions, nxt.num_preemptions)
            res.num_inversions = max(res.num_inversions, nxt.num_inversions)
            res.num_tier_inversions = max(res.num_tier_inversions, nxt.sink.num_inversions)
            if found:
                if key not in bad_seen:
                    bad_seen.add(key)
                    _record(res, found, node)
                continue
            if key in seen:
                continue
            seen.add(key)
            res.states += 1
            res.max_depth = max(res.max_depth, depth + 1)
            if progress is not None and res.states % 10000 == 0:
                progress(res.states)
            if max_states is not None and res.states >= max_states:
                res.complete = False
                stack.clear()
                break
            stack.append((nxt, node, depth + 1))
    res.wall_s = time.perf_counter() - start
    return res


def _record(res: ExploreResult, found: list[Violation], node: _Trace) -> None:
    trace = _unwind(node)
    for v in found:
        inv = v.invariant.value
        res.violations[inv] += 1
        old = res.counterexamples.get(inv)
        if old is None or len(trace) < len(old.trace):
            res.counterexamples[inv] = Counterexample(inv, v.detail, trace)
