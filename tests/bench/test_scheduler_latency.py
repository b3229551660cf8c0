"""`tierserve bench-scheduler` runs the real decisions at small sizes (no timing asserted)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench import scheduler_latency as bench


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def _trace(tmp_path: Path) -> str:
    """A small Mooncake-format trace: conversations sharing prefix blocks."""
    path = tmp_path / "mc.jsonl"
    lines = []
    for i in range(40):
        ids = [0, 1 + i % 5] + [100 + i]
        lines.append(json.dumps({"timestamp": i * 100, "input_length": 512 * len(ids) - 7,
                                 "output_length": 20, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_bench_writes_percentiles(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    rc = bench.run(_args("--running", "16", "--waiting", "128", "--steps", "30",
                         "--placements", "30", "--trace", _trace(tmp_path), "--json", str(out)))
    assert rc == 0
    d = json.loads(out.read_text())
    for part in ("step", "step_kv_pressure", "placement", "placement_kv_full"):
        r = d[part]
        assert r["n"] == 30
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["max_us"]
    # With the blocks of each closed request back, nearly every arrival is placed at once; with
    # the decode workers full, none is (the no-room path is what that variant measures).
    assert d["placement"]["placed"] >= 27  # the odd one may wait for its prefill horizon
    assert d["placement_kv_full"]["placed"] == 0


def test_bench_with_a_peer_policy_and_bad_input(tmp_path: Path) -> None:
    assert bench.run(_args("--policy", "vllm-fcfs", "--running", "8", "--waiting", "32",
                           "--steps", "5", "--placements", "5", "--trace",
                           _trace(tmp_path))) == 0
    assert bench.run(_args("--policy", "nope")) == 2
    assert bench.run(_args("--waiting", "0")) == 2
