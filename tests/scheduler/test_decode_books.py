"""The decode workers' books kept across plans equal a recomputation after every event.

``ClusterScheduler`` keeps, per decode worker, what placement reads of its held requests
(release rate, growth, running count, the blocks its preempted requests need back) from
one plan to the next, and drops it whenever one of its inputs changes. A missed drop
would not fail any decision test until the stale view happened to matter; this drives
the real kernel through random event sequences (arrivals, plans, worker steps with their
reports, preemptions, stops, a worker failure) and compares every kept view with one
recomputed from the books after each event.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from scheduler.cluster_scheduler import ClusterScheduler, NewRequest
from scheduler.messages import ReqEvent, RunningReq, WorkerEvent, WorkerReport
from scheduler.preemption import PreemptMode
from scheduler.testing import make_costs
from scheduler.tiers import default_tiers
from scheduler.topology import WorkerInfo, WorkerRole
from scheduler.verify.model import Event, EventKind, World
from scheduler.verify.scope import Shape
from scheduler.verify.trajectories import trajectory_scope


def _random_shape(rng: random.Random, num_tiers: int, earlier: list[Shape]) -> Shape:
    prompt = rng.randint(16, 320)
    n = prompt // 16
    head = rng.choice(earlier).block_hashes[:n] if earlier and rng.random() < 0.3 else ()
    hashes = head + tuple(rng.randrange(2, 1 << 30) for _ in range(n - len(head)))
    return Shape(rng.randrange(num_tiers), prompt, rng.randint(1, 96), hashes)


def _walk(seed: int, num_events: int) -> tuple[int, int]:
    """Random events through a 2-worker World; returns (views compared, preemptions)."""
    rng = random.Random(seed)
    scope = trajectory_scope()
    world = World.initial(scope)
    cs = world.cs
    decode_ids = [wid for wid, w in cs.workers.items() if w.can_decode]
    shapes: list[Shape] = []
    compared = 0
    for _ in range(num_events):
        if world.num_arrived < scope.max_requests and rng.random() < 0.15:
            shapes.append(_random_shape(rng, scope.num_tiers, shapes))
            ev = Event(EventKind.ARRIVE, shape=shapes[-1])
        else:
            options = world.enabled()
            if not options:
                break
            ev = rng.choice(options)
        world.apply(ev)
        assert cs.stale_views() == [], f"seed {seed}: after {world.describe(ev)}"
        compared += len(decode_ids)
        for wid in decode_ids:  # keep every worker's view for the next event to test
            cs.decode_reserves(wid)
    return compared, world.num_preemptions


@pytest.mark.parametrize("seed", range(6))
def test_kept_decode_views_equal_a_recomputation(seed: int) -> None:
    compared, _ = _walk(seed, 600)
    assert compared > 0


def test_the_walks_preempt() -> None:
    """The walks reach the events that change a view most (preemptions), so the test
    above covers them."""
    assert sum(_walk(seed, 600)[1] for seed in range(6)) > 0


# -- migration (only the live path migrates; the walks above never do) -----------------


class _Checked:
    """A 2-decode-worker cluster with migration whose kept views are compared with a
    recomputation after every call (then kept again for the next)."""

    def __init__(self) -> None:
        cs = ClusterScheduler(default_tiers(), "tierserve", 16, make_costs(), migration=True)
        cs.add_worker(WorkerInfo("p0", WorkerRole.PREFILL, "n", "cuda:0", "A", 256), 256,
                      can_prefill=True, can_decode=False)
        for wid, dev, dom in (("d0", "cuda:1", "A"), ("d1", "cuda:2", "B")):
            cs.add_worker(WorkerInfo(wid, WorkerRole.DECODE, "n", dev, dom, 64), 64,
                          can_prefill=False, can_decode=True)
        self.cs = cs
        self.num_checks = 0

    def __call__(self, call: Callable[[], object]) -> None:
        call()
        assert self.cs.stale_views() == []
        self.num_checks += 1
        for wid, w in self.cs.workers.items():
            if w.is_alive and w.can_decode:
                self.cs.decode_reserves(wid)

    def report(self, worker: str, free: int, running: dict[str, int], now: float,
               *events: ReqEvent, num_output_tokens: int = 1) -> None:
        self(lambda: self.cs.on_report(WorkerReport(
            worker, free, 64, events=events,
            running=tuple(RunningReq(r, n, num_output_tokens) for r, n in running.items())),
            now))

    def decoding(self, rid: str, tier: int, prompt: int, worker: str, free: int,
                 running: dict[str, int], now: float) -> None:
        cs = self.cs
        self(lambda: cs.submit(NewRequest(rid, tier, now, prompt, 512), now))
        plan = cs.plan(now)
        assert [(d.req_id, d.decode_worker_id) for d in plan.dispatches] == [(rid, worker)]
        self(lambda: cs.on_dispatch_result(rid, True, now))
        self.report("p0", 256, {}, now, ReqEvent(rid, WorkerEvent.PREFILL_DONE, now))
        self.report(worker, free, running, now, ReqEvent(rid, WorkerEvent.DECODE_START, now))

    def pressure(self) -> None:
        """d0 holds two tier-3 decodes; a tier-0 arrival that fits nowhere migrates the
        larger one to d1."""
        self.decoding("low", 3, 300, "d0", 44, {"low": 20}, 0.0)
        self.decoding("low2", 3, 460, "d0", 14, {"low": 20, "low2": 30}, 0.1)
        self.report("d1", 40, {}, 0.1)
        self(lambda: self.cs.submit(NewRequest("top", 0, 5.0, 700, 16), 5.0))
        preempts = []
        self(lambda: preempts.extend(self.cs.plan(5.0).preempts))
        assert [(p.req_id, p.mode, p.target_worker_id) for p in preempts] == [
            ("low2", PreemptMode.MIGRATE, "d1")]


def _migrated(c: _Checked) -> None:
    # The source still decodes it a step (its growth counts on the target too).
    c.report("d0", 14, {"low": 20, "low2": 30}, 5.01, num_output_tokens=9)
    c(lambda: c.cs.on_preempt_result("low2", "d0", True, 5.02))
    c.report("d1", 10, {"low2": 30}, 5.03)
    c.report("d1", 9, {"low2": 31}, 5.1, ReqEvent("low2", WorkerEvent.RESUMED_MIGRATE, 5.1))
    c.report("d0", 44, {"low": 20}, 5.2, ReqEvent(
        "low2", WorkerEvent.PREEMPTED_MIGRATE, 5.2, for_req_id="top", peer_worker_id="d1"))
    c(lambda: c.cs.plan(5.3))
    c(lambda: c.cs.on_router_finish("low2", "stop", 5.4, num_output_tokens=40))


def _refused(c: _Checked) -> None:
    c(lambda: c.cs.on_preempt_result("low2", "d0", False, 5.02))
    c(lambda: c.cs.abort("low", 5.1))


def _fell_back(c: _Checked) -> None:
    c(lambda: c.cs.on_preempt_result("low2", "d0", True, 5.02))
    c.report("d0", 44, {"low": 20, "low2": 0}, 5.1, ReqEvent(
        "low2", WorkerEvent.PREEMPTED_RECOMPUTE, 5.1, for_req_id="top"))
    c(lambda: c.cs.plan(5.2))


def _target_died(c: _Checked) -> None:
    c(lambda: c.cs.on_preempt_result("low2", "d0", True, 5.02))
    c(lambda: c.cs.remove_worker("d1", 5.1))
    c(lambda: c.cs.plan(5.1))
    c(lambda: c.cs.on_preempt_result("low2", "d0", False, 5.2))


@pytest.mark.parametrize("ending", [_migrated, _refused, _fell_back, _target_died])
def test_kept_views_follow_a_migration(ending: Callable[[_Checked], None]) -> None:
    c = _Checked()
    c.pressure()
    ending(c)
    assert c.num_checks > 10
