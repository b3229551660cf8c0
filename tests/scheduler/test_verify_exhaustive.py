"""Exhaustive checking over the real kernel: clean in a reduced scope, and able to fail."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from scheduler.verify import cli
from scheduler.verify.exhaustive import explore
from scheduler.verify.faults import OverbookingAccount, thrashing_policy
from scheduler.verify.model import Event, EventKind, World
from scheduler.verify.scope import Scope, ScopeError, scope_tiers

SMALL = Scope(max_requests=3, arrival_ticks=1, starvation_s=(2.0, 4.0))


def test_reduced_scope_is_clean_and_explores_preemption() -> None:
    res = explore(SMALL)
    assert res.complete and res.num_violations == 0, res.counterexamples
    assert res.states > 1000 and res.terminal_states > 0
    assert res.transitions > res.states  # some paths met an already seen state
    assert res.num_preemptions > 0  # KV pressure made the policy pick victims
    assert all(0 < w <= b for w, b in zip(res.max_wait_s, (2.0, 4.0), strict=True))


def test_overbooking_account_yields_a_kv_counterexample() -> None:
    res = explore(Scope(max_requests=2, arrival_ticks=1), account_factory=OverbookingAccount)
    assert res.violations["kv_budget"] > 0
    cex = res.counterexamples["kv_budget"]
    assert "> 8 blocks" in cex.detail
    assert cex.trace[0].startswith("t=0.000 arrive r0")


def test_thrashing_policy_yields_an_anti_thrash_counterexample() -> None:
    res = explore(SMALL, policy_factory=thrashing_policy)
    cex = res.counterexamples["anti_thrash"]
    assert res.violations["anti_thrash"] > 0 and "preempted at" in cex.detail
    assert res.violations["kv_budget"] == 0


def test_counterexample_trace_replays_to_the_violation() -> None:
    res = explore(Scope(max_requests=2, arrival_ticks=1), account_factory=OverbookingAccount)
    trace = res.counterexamples["kv_budget"].trace
    world = World.initial(Scope(max_requests=2, arrival_ticks=1).with_default_shapes(),
                          account_factory=OverbookingAccount)
    found = []
    for line in trace:
        ev = next(e for e in world.enabled() if world.describe(e) == line)
        found = world.apply(ev)
        if found:
            break
    assert found and found[0].invariant.value == "kv_budget"
    assert line == trace[-1]


def _run_until(world: World, state: str) -> None:
    for _ in range(10):
        if all(r.state.value == state for r in world.reqs):
            return
        for w in range(world.scope.num_workers):
            if world.has_waiting(w):
                assert world.apply(Event(EventKind.STEP, worker=w)) == []
        if not all(r.state.value == state for r in world.reqs):
            assert world.apply(Event(EventKind.TICK)) == []
    raise AssertionError(f"never reached {state}")


def test_failure_aborts_decodes() -> None:
    scope = Scope(max_requests=1, arrival_ticks=1).with_default_shapes()
    world = World.initial(scope)
    assert world.apply(Event(EventKind.ARRIVE, shape=scope.shapes[0])) == []
    _run_until(world, "decoding")
    failed = world.worker_index(world.reqs[0].decode_worker_id)
    assert world.apply(Event(EventKind.FAIL, worker=failed)) == []
    assert world.reqs[0].state.value == "aborted"
    assert world.accounts[failed].num_used == 0


def test_failure_retries_prefills() -> None:
    scope = Scope(max_requests=2, arrival_ticks=1).with_default_shapes()
    world = World.initial(scope)
    for shape in scope.shapes:
        assert world.apply(Event(EventKind.ARRIVE, shape=shape)) == []
    for w in range(scope.num_workers):
        if world.has_waiting(w):
            assert world.apply(Event(EventKind.STEP, worker=w)) == []
    states = {r.state.value for r in world.reqs}
    assert states == {"prefilling"}
    victim = world.reqs[0]
    failed = world.worker_index(victim.decode_worker_id)
    assert world.apply(Event(EventKind.FAIL, worker=failed)) == []
    assert victim.state.value == "preempted" and victim.num_computed_tokens == 0
    assert world.accounts[failed].num_used == 0


def test_scope_and_tier_validation() -> None:
    with pytest.raises(ScopeError, match="blocks_per_worker"):
        Scope(blocks_per_worker=0)
    with pytest.raises(ScopeError, match="starvation_s"):
        scope_tiers(2, (1.0,))
    tiers = scope_tiers(3)
    assert abs(sum(tiers.shares()) - 1.0) < 1e-12 and tiers.num_tiers == 3


def _args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    argv = []
    for k, v in kw.items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    return p.parse_args(argv)


def test_cli_writes_json_and_exit_code(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    assert cli.run(_args(exhaustive=True, requests=2, json=out)) == 0
    d = json.loads(out.read_text())
    assert set(d) >= {"states", "trajectories", "violations", "tier0_p99_ok_rate", "ci95"}
    assert d["states"] > 0 and sum(d["violations"].values()) == 0
    bad = tmp_path / "bad.json"
    assert cli.run(_args(exhaustive=True, requests=2, inject_fault="overbook", json=bad)) == 1
    d = json.loads(bad.read_text())
    assert d["violations"]["kv_budget"] > 0 and d["counterexamples"][0]["trace"]


def test_cli_rejects_bad_input() -> None:
    assert cli.run(_args(exhaustive=True, requests=0)) == 2
    assert cli.run(_args(exhaustive=True, policy="nope")) == 2
    with pytest.raises(SystemExit):
        _args(exhaustive=True, starvation_s="1,-2")
