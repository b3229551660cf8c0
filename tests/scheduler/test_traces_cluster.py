"""Trace readers, load scaling and the cluster spec; bad input names file and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler.sim.cluster import ClusterSpecError, parse_cluster
from scheduler.sim.traces import (
    TraceError,
    poisson,
    read_azure,
    read_mooncake,
    scale_load,
)
from scheduler.tiers import TierMix
from scheduler.topology import TopologyClass, topology_class

AZURE = ("TIMESTAMP,ContextTokens,GeneratedTokens\n"
         "2023-11-16 18:15:46.6805900,374,44\n"
         "2023-11-16 18:15:50.9951690,396,109\n")


def test_azure_rebases_time_and_assigns_seeded_tiers(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text(AZURE)
    reqs = read_azure(p, seed=1)
    assert [r.prompt_len for r in reqs] == [374, 396]
    assert reqs[0].arrival == 0.0 and reqs[1].arrival == pytest.approx(4.314579)
    assert read_azure(p, seed=1) == reqs
    assert {r.tier for r in read_azure(p, TierMix((0.0, 0.0, 0.0, 1.0)))} == {3}


def test_azure_tier_column_wins(tmp_path: Path) -> None:
    p = tmp_path / "a.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens,Tier\n"
                 "2023-11-16 18:15:46.6805900,374,44,2\n")
    assert read_azure(p)[0].tier == 2


@pytest.mark.parametrize("line, why", [
    ("2023-11-16 18:15:52.0,abc,5", "ContextTokens"),
    ("not a time,5,5", "TIMESTAMP"),
    ("2023-11-16 18:15:52.0,5", "fields"),
])
def test_azure_bad_line_names_file_and_line(tmp_path: Path, line: str, why: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(AZURE + line + "\n")
    with pytest.raises(TraceError, match=rf"bad\.csv:4: .*{why}"):
        read_azure(p)


def test_mooncake_keeps_prefix_identity(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"timestamp": 1000, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
                 '{"timestamp": 4000, "input_length": 100, "output_length": 5, "hash_ids": [0]}\n')
    reqs = read_mooncake(p)
    assert reqs[0].hashes == (0, 1) and reqs[1].hashes == (0,)
    assert reqs[1].arrival == pytest.approx(3.0)


@pytest.mark.parametrize("line, why", [
    ('{"timestamp": 0, "input_length": 600}', "missing field 'output_length'"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0]}', "1 hash_ids"),
    ("{oops", "not JSON"),
])
def test_mooncake_bad_line_names_file_and_line(tmp_path: Path, line: str, why: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}\n'
                 + line + "\n")
    with pytest.raises(TraceError, match=rf"bad\.jsonl:2: {why}"):
        read_mooncake(p)


def test_poisson_is_seeded_and_scaling_compresses_time() -> None:
    a = poisson("rate=10,duration=20,prefix_groups=3", seed=4)
    assert a == poisson("rate=10,duration=20,prefix_groups=3", seed=4)
    assert 100 < len(a) < 300 and all(r.hashes for r in a)
    b = scale_load(a, 2.0, duration=5.0)
    assert all(r.arrival < 5.0 for r in b)
    assert b[0].arrival == pytest.approx(a[0].arrival / 2)
    with pytest.raises(TraceError, match="rate"):
        poisson("rate=-1")


def test_cluster_layout_and_errors() -> None:
    spec = parse_cluster("prefill=2,decode=2,gpus_per_node=4,domains_per_node=2", 100)
    p0, p1 = spec.prefill
    d0, d1 = spec.decode
    assert topology_class(p0, d0) is TopologyClass.SAME_DOMAIN
    assert topology_class(p0, d1) is TopologyClass.SAME_NODE
    spec = parse_cluster("prefill=1,decode=1,gpus_per_node=1", 100)
    assert topology_class(spec.prefill[0], spec.decode[0]) is TopologyClass.CROSS_NODE
    with pytest.raises(ClusterSpecError, match="cluster.decode"):
        parse_cluster("decode=x", 100)
    with pytest.raises(ClusterSpecError, match="KEY=VALUE"):
        parse_cluster("gpus=3", 100)


def test_decode_kv_blocks_shrink_the_decode_pool_alone() -> None:
    spec = parse_cluster("prefill=2,decode=2,kv_blocks=5000,decode_kv_blocks=1200", 100)
    assert {w.num_kv_blocks for w in spec.prefill} == {5000}
    assert {w.num_kv_blocks for w in spec.decode} == {1200}
    assert {w.num_kv_blocks for w in parse_cluster("decode=2", 100).decode} == {100}
