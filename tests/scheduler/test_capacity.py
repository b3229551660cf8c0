"""SLO capacity: the bisection search, the attainment bars, the simulator's early stop and
the peers' tuning grids."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.request import RequestState
from scheduler.sim.capacity import Spread, find_capacity
from scheduler.sim.cluster import parse_cluster
from scheduler.sim.costmodel import PROFILES, CostModel
from scheduler.sim.metrics import summarize
from scheduler.sim.simulator import Simulator
from scheduler.sim.slo import SloBars, met_slo
from scheduler.sim.traces import poisson, scale_load
from scheduler.sim.tuning import peer_grid
from scheduler.testing import make_request
from scheduler.tiers import default_tiers

TIERS = default_tiers()


def test_capacity_walks_the_sweep_then_bisects_below_the_first_failure() -> None:
    calls: list[float] = []

    def probe(load: float) -> bool:
        calls.append(load)
        return load <= 5.3

    res = find_capacity(probe, [6, 2, 4, 8], bisect_steps=3, known={2.0: True})
    assert calls == [4, 6, 5.0, 5.5, 5.25]  # 2 was known; 8 is never run
    assert res.capacity == 5.25 and not res.is_lower_bound
    assert res.probes == [(4, True), (6, False), (5.0, True), (5.5, False), (5.25, True)]


def test_capacity_is_a_lower_bound_when_every_load_clears_and_zero_when_none_does() -> None:
    top = find_capacity(lambda load: True, [1, 2], bisect_steps=2)
    assert top.capacity == 2 and top.is_lower_bound
    none = find_capacity(lambda load: load < 0.2, [1, 2], bisect_steps=2)
    assert none.capacity == 0.0 and [p for p, _ in none.probes] == [1, 0.5, 0.25]


def test_spread_over_seeds() -> None:
    s = Spread.of([4.0, 5.0, 6.0])
    assert (s.mean, s.min, s.max, s.n) == (5.0, 4.0, 6.0, 3)
    assert s.std == pytest.approx(1.0)


def test_bars_allow_one_percent_of_tier0_and_ten_percent_of_the_others_to_miss() -> None:
    bars = SloBars()
    assert bars.allowed_misses(0, 250) == 2 and bars.allowed_misses(2, 250) == 25
    ok = {"tiers": {"0": {"attainment": 0.99}, "1": {"attainment": 0.9}, "2": {"attainment": None}}}
    low = {"tiers": {"0": {"attainment": 0.989}, "1": {"attainment": 1.0}}}
    assert bars.cleared(ok) and not bars.cleared(low)


def test_met_slo_needs_every_target_of_the_tier() -> None:
    spec = TIERS[0]  # 200 ms TTFT, 50 ms TPOT
    r = make_request("r", tier=0, arrival=0.0, state=RequestState.FINISHED_STOPPED,
                     first_token_time=0.15, finish_time=0.15 + 9 * 0.04)
    assert met_slo(r, 10, spec)
    r.finish_time = 0.15 + 9 * 0.06
    assert not met_slo(r, 10, spec)
    r.state = RequestState.REJECTED
    assert not met_slo(r, 1, spec)


def test_a_probe_stops_once_a_tier_has_missed_more_than_its_bar_allows() -> None:
    cost = CostModel(PROFILES["h200-llama3-8b"])
    cluster = parse_cluster("prefill=1,decode=1,gpus_per_node=2", 51_000)
    trace = poisson("rate=40,duration=20,prompt=2000,output=50", seed=2)
    over = scale_load(trace, 4.0)
    full = Simulator(over, "vllm-fcfs", cluster, cost, TIERS).run()
    assert not SloBars().cleared(summarize(full, 4.0))
    probe = Simulator(over, "vllm-fcfs", cluster, cost, TIERS, stop_below=SloBars()).run()
    assert probe.stopped_early and probe.now < full.now / 2
    light = poisson("rate=5,duration=20,prompt=500,output=50", seed=2)
    a = summarize(Simulator(light, "tierserve", cluster, cost, TIERS).run(), 1.0)
    stopped = Simulator(light, "tierserve", cluster, cost, TIERS, stop_below=SloBars()).run()
    b = summarize(stopped, 1.0)
    assert not stopped.stopped_early and SloBars().cleared(b)
    a.pop("wall_s")
    b.pop("wall_s")
    assert a == b  # a run that clears is the same run with or without the watch


def test_every_peer_is_tuned_over_its_step_budgets_with_its_defaults_first() -> None:
    for name, key in (("vllm-fcfs", "max_num_batched_tokens"),
                      ("vllm-priority", "max_num_batched_tokens"),
                      ("sglang-lpm", "chunked_prefill_size"),
                      ("sglang-fcfs", "chunked_prefill_size"),
                      ("dynamo-priority", "max_num_batched_tokens")):
        grid = peer_grid(name)
        budgets = {dict(s.settings)[key] for s in grid}
        assert budgets == {"256", "512", "1024", "2048", "4096", "8192"}, name
        assert grid[0].settings == ((key, "8192"),), name
    assert any("long_prefill_token_threshold" in dict(s.settings) for s in peer_grid("vllm-priority"))
    assert any("router_queue_threshold" in dict(s.settings) for s in peer_grid("dynamo-priority"))
    assert peer_grid("tierserve") == []


def test_feasible_bars_count_only_requests_an_idle_worker_could_serve_in_time() -> None:
    run = {"tiers": {"0": {"attainment": 0.9, "attainment_feasible": 1.0},
                     "1": {"attainment": 0.95, "attainment_feasible": 0.95}}}
    assert not SloBars().cleared(run) and SloBars(feasible_only=True).cleared(run)
    cost = CostModel(PROFILES["h200-llama3-8b"])
    cluster = parse_cluster("prefill=1,decode=1,gpus_per_node=2", 51_000)
    # Tier-0 prompts of 9,000 tokens take ~290 ms to prefill on an idle H200: none is
    # feasible, so they miss the strict bar and are not counted by the feasible one.
    trace = [t if t.tier else dataclasses.replace(t, prompt_len=9000)
             for t in poisson("rate=2,duration=30,prompt=300,output=20", seed=4)]
    strict = Simulator(trace, "tierserve", cluster, cost, TIERS, stop_below=SloBars()).run()
    loose = Simulator(trace, "tierserve", cluster, cost, TIERS,
                      stop_below=SloBars(feasible_only=True)).run()
    assert strict.stopped_early and strict.missed_tier == 0
    assert not loose.stopped_early
    assert SloBars(feasible_only=True).cleared(summarize(loose, 1.0))
