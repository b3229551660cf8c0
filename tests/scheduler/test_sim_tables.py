"""scripts/sim_tables.py reads several result files as one headline: the best peer is the
peer with the highest mean SLO capacity, and every policy is shown against it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "sim_tables.py"
_spec = importlib.util.spec_from_file_location("sim_tables", _PATH)
assert _spec is not None and _spec.loader is not None
sim_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim_tables)


def _res(caps: dict[str, float]) -> dict:
    return {"slo_capacity_spread": {k: {"mean": v, "std": 0.0, "min": v, "max": v, "n": 1}
                                    for k, v in caps.items()}}


def test_combined_picks_the_best_peer_across_files_and_divides_by_it() -> None:
    lines = sim_tables.combined([_res({"tierserve": 9.0, "vllm-fcfs": 2.0}),
                                 _res({"dynamo-priority:router_queue_threshold=2.0": 3.0})])
    assert lines[0].startswith("best peer: `dynamo-priority:router_queue_threshold=2.0`")
    rows = {ln.split("`")[1]: ln for ln in lines if ln.startswith("| `")}
    assert rows["tierserve"].endswith("| 3.00x |")
    assert rows["vllm-fcfs"].endswith("| 0.67x |")
    assert list(rows) == ["tierserve", "dynamo-priority:router_queue_threshold=2.0", "vllm-fcfs"]


def test_combined_needs_a_peer() -> None:
    assert sim_tables.combined([_res({"tierserve": 9.0})]) == []
