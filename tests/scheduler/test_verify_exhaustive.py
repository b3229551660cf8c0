"""Exhaustive checking over the real drivers: clean in its scopes, and able to fail."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from scheduler.request import Decision
from scheduler.verify import cli
from scheduler.verify.exhaustive import explore
from scheduler.verify.faults import (
    OverbookingAccount,
    fixed_reserve_policy,
    inverting_policy,
    thrashing_policy,
)
from scheduler.verify.model import Event, EventKind, World
from scheduler.verify.scope import Scope, ScopeError, scope_tiers

SMALL = Scope(max_requests=3, arrival_ticks=1, starvation_s=(2.0, 4.0))
# One worker and arrivals over two ticks: a tier-0 arrival finds the worker full, and a
# preempted request comes back inside its anti-thrash window.
CROWDED = Scope(max_requests=3, num_workers=1, arrival_ticks=2, max_failures=0, max_stops=0,
                starvation_s=(2.0, 4.0))
# A failure's requests come back as the router's retries, after their tier-0 deadlines.
RETRIED = replace(SMALL, max_stops=0, retries=True)


def test_reduced_scope_is_clean_and_explores_preemption() -> None:
    res = explore(SMALL)
    assert res.complete and res.num_violations == 0, res.counterexamples
    assert res.states > 1000 and res.terminal_states > 0
    assert res.transitions > res.states  # some paths met an already seen state
    assert res.num_preemptions > 0  # KV pressure made the policy pick victims
    # Tier 1 waits (for decode room), within its bound; tier 0 never waits here: the
    # policy's headroom keeps room for it.
    assert 0 < res.max_wait_s[1] <= 4.0 and res.max_wait_s[0] <= 2.0
    assert res.num_tier_inversions == 0


def test_crowded_worker_is_clean_and_preempts_for_arrivals() -> None:
    res = explore(CROWDED)
    assert res.complete and res.num_violations == 0, res.counterexamples
    assert res.num_preemptions >= 2


def test_fixed_reserves_break_work_conservation_and_the_measured_ones_do_not() -> None:
    """Issue 22: the placement before it kept 5 % x tier of a worker plus growth room at
    the prior's step time free, so a request that fitted waited with blocks free; the
    measured reserve holds nothing for a tier nobody sends, and the checker says so."""
    assert explore(SMALL).violations["work_conservation"] == 0
    res = explore(SMALL, policy_factory=fixed_reserve_policy)
    assert res.violations["work_conservation"] > 0
    cex = res.counterexamples["work_conservation"]
    assert "fits w" in cex.detail and "was not placed" in cex.detail, cex.detail
    assert res.violations["kv_budget"] == 0


def _inversion_caught(res) -> None:  # type: ignore[no-untyped-def]
    assert res.violations["tier_inversion"] > 0
    cex = res.counterexamples["tier_inversion"]
    assert "(tier 0, slack -" in cex.detail and "taken before" in cex.detail, cex.detail
    assert res.violations["kv_budget"] == 0 and res.violations["starvation"] == 0


def test_retries_are_clean_and_hopeless_last_ordering_is_caught() -> None:
    res = explore(RETRIED)
    assert res.complete and res.num_violations == 0, res.counterexamples
    _inversion_caught(explore(RETRIED, policy_factory=inverting_policy))


@pytest.mark.slow
def test_default_scope_has_no_tier_inversion_and_catches_the_inversion_fault() -> None:
    scope = cli._exhaustive_scope(_args(exhaustive=True))
    res = explore(scope)
    assert res.complete and res.num_violations == 0, res.counterexamples
    assert res.violations["tier_inversion"] == 0 and res.num_tier_inversions == 0
    _inversion_caught(explore(scope, policy_factory=inverting_policy))


# Two requests on one worker: the second one's decode growth needs a block a full
# worker does not have (an overbooking account says it has one).
PAIR = Scope(max_requests=2, num_workers=1, arrival_ticks=1)


def test_overbooking_account_yields_a_kv_counterexample() -> None:
    res = explore(PAIR, account_factory=OverbookingAccount)
    assert res.violations["kv_budget"] > 0
    cex = res.counterexamples["kv_budget"]
    assert "> 8 blocks" in cex.detail
    assert cex.trace[0].startswith("t=0.000 arrive r0")


def test_thrashing_policy_yields_an_anti_thrash_counterexample() -> None:
    # Since a preemption's freed blocks are held for its arrival, no small exhaustive scope
    # lets a victim return fast enough to be preempted again; random workloads do.
    from scheduler.verify.trajectories import run_trajectories

    res = run_trajectories(300, seed=0, policy_factory=thrashing_policy, processes=1)
    assert res.violations["anti_thrash"] > 0
    cex = next(c for c in res.counterexamples if c["invariant"] == "anti_thrash")
    assert "preempted at" in cex["detail"]
    assert res.violations["kv_budget"] == 0


def test_counterexample_trace_replays_to_the_violation() -> None:
    res = explore(PAIR, account_factory=OverbookingAccount)
    trace = res.counterexamples["kv_budget"].trace
    world = World.initial(PAIR.with_default_shapes(), account_factory=OverbookingAccount)
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
        if world.plan_due:
            assert world.apply(Event(EventKind.PLAN)) == []
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


def test_failure_ends_prefills_and_the_router_retries_them() -> None:
    scope = Scope(max_requests=2, arrival_ticks=1, retries=True).with_default_shapes()
    world = World.initial(scope)
    for shape in scope.shapes:
        assert world.apply(Event(EventKind.ARRIVE, shape=shape)) == []
    assert world.apply(Event(EventKind.PLAN)) == []
    for w in range(scope.num_workers):
        if world.has_waiting(w):
            assert world.apply(Event(EventKind.STEP, worker=w)) == []
    states = {r.state.value for r in world.reqs}
    assert states == {"prefilling"}
    victim = world.reqs[0]
    failed = world.worker_index(victim.decode_worker_id)
    assert world.apply(Event(EventKind.FAIL, worker=failed)) == []
    assert victim.state.value == "aborted"
    assert victim.history[-1].decision is Decision.WORKER_FAILED
    assert world.accounts[failed].num_used == 0 and not world.ws[failed].local
    # The next plan tells the router, which submits the retry; a later plan places it.
    assert world.apply(Event(EventKind.PLAN)) == []
    retry = world.reqs[-1]
    assert retry.req_id == f"{victim.req_id}-r1" and retry.arrival_time == victim.arrival_time
    assert world.plan_due and world.apply(Event(EventKind.PLAN)) == []
    assert retry.state.value == "prefilling"


def test_a_worker_step_reports_through_the_cluster_scheduler() -> None:
    scope = Scope(max_requests=1, arrival_ticks=1).with_default_shapes()
    world = World.initial(scope)
    assert world.apply(Event(EventKind.ARRIVE, shape=scope.shapes[0])) == []
    assert [e.kind for e in world.enabled()][:1] == [EventKind.PLAN]  # a plan is due
    assert EventKind.TICK not in {e.kind for e in world.enabled()}
    _run_until(world, "decoding")
    req = world.reqs[0]
    w = world.worker_index(req.decode_worker_id)
    assert req.first_token_time == scope.dt_s  # the step that ran the prompt ended then
    assert world.cs.workers[req.decode_worker_id].held == {req.req_id: 3}
    assert req.req_id in world.ws[w].decoding


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
    assert cli.run(_args(exhaustive=True, requests=2, workers=1, inject_fault="overbook",
                         json=bad)) == 1
    d = json.loads(bad.read_text())
    assert d["violations"]["kv_budget"] > 0 and d["counterexamples"][0]["trace"]


def test_cli_rejects_bad_input() -> None:
    assert cli.run(_args(exhaustive=True, requests=0)) == 2
    assert cli.run(_args(exhaustive=True, policy="nope")) == 2
    with pytest.raises(SystemExit):
        _args(exhaustive=True, starvation_s="1,-2")
