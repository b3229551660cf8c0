"""The configuration tree: defaults, YAML + overrides, and errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.config import (
    ClusterConfig,
    ConfigError,
    check_key_files,
    load_config,
    parse_overrides,
)
from cluster.topology import (
    TopologyClass,
    WorkerLocation,
    detect_location,
    nvlink_groups_from_topo_matrix,
    topology_class,
)
from scheduler.tiers import ShareMode


def test_defaults_are_valid_and_frozen() -> None:
    cfg = load_config(environ={})
    assert cfg.router.host == "127.0.0.1" and cfg.router.port == 8000
    assert cfg.tier_config.num_tiers == 4
    assert not cfg.requires_api_key
    with pytest.raises(ValidationError):
        cfg.pools.num_decode = 3  # type: ignore[misc]


def test_yaml_then_overrides_then_direct_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(
        "pools: {num_prefill: 2, num_decode: 2, num_kv_blocks: 64}\n"
        "tiers:\n  share_mode: quota\n  tiers:\n"
        "    - {name: fast, ttft_s: 0.5, tpot_s: 0.1, share: 0.6, weight: 4}\n"
        "    - {name: slow, e2e_s: 60, share: 0.4}\n"
        "tenants: [{name: a, api_keys: [k1], tier: 1, may_override_tier: true}]\n"
    )
    cfg = load_config(f, ["pools.num_decode=3", "router.port=9000", "scheduling.policy=vllm-fcfs"],
                      direct={"model.path": "/m", "router.host": None}, environ={})
    assert (cfg.pools.num_prefill, cfg.pools.num_decode, cfg.pools.num_kv_blocks) == (2, 3, 64)
    assert cfg.router.port == 9000 and cfg.router.host == "127.0.0.1"
    assert cfg.model.path == "/m" and cfg.scheduling.policy == "vllm-fcfs"
    tc = cfg.tier_config
    assert tc.num_tiers == 2 and tc.share_mode is ShareMode.QUOTA and tc[0].ttft_s == 0.5
    assert cfg.requires_api_key
    assert ClusterConfig.from_dict(cfg.to_dict()) == cfg


def test_environment_is_read_in_one_place(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("pools: {num_decode: 2}\n")
    cfg = load_config(environ={"TIERSERVE_CONFIG": str(f), "TIERSERVE_MODEL": "/x"})
    assert cfg.pools.num_decode == 2 and cfg.model.path == "/x"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["pools.num_decode=0"], "pools.num_decode"),
        (["pools.block_size=12"], "block_size"),
        (["pools.bogus=1"], "pools.bogus"),
        (["router.port=70000"], "router.port"),
        (["model.dtype=int3"], "model.dtype"),
        (["tiers.tiers=[{name: a, ttft_s: 1, share: 0.5}, {name: b, e2e_s: 9, share: 0.2}]"],
         "tiers.tiers[*].share"),
        (["tiers.tiers=[{name: a, ttft_s: -1, share: 1.0}, {name: b, e2e_s: 9, share: 0.0}]"],
         "tiers.tiers[0].ttft_s"),
        (["tenants=[{name: a, tier: 7}]"], "tenants[0].tier"),
        (["scheduling.policy=fastest"], "scheduling.policy"),
        (["tenants=[{name: a, api_keys: [k]}, {name: b, api_keys: [k]}]"], "tenants[1].api_keys"),
        (["pools.num_prefill=2", "topology.prefill=[{node: a, nvlink_domain: d}]"],
         "topology.prefill"),
        (["tenants=[{name: a, api_keys: [k], max_tier_override: 4}]"],
         "tenants[0].max_tier_override"),
        (["router.host=0.0.0.0"], "router.host"),
        (["tenants=[{name: a, api_key_digests: [sha256$00$00]}]"], "tenants[0].api_key_digests"),
        (["tenants=[{name: a, api_keys: [k]}, {name: a, tier: 2}]"], "tenants[1].name"),
        (["keys_withheld=true"], "keys_withheld"),
        (["tenants=[{name: a, api_keys_env: NO_SUCH_VAR}]"], "tenants[0].api_keys_env"),
        (["router.max_body_bytes=10"], "router.max_body_bytes"),
    ],
)
def test_invalid_values_name_the_field(overrides: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides, environ={})
    assert field in str(e.value)


def test_malformed_override_and_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_overrides(["pools.num_decode"])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad, environ={})


def test_topology_classes_and_declared_domains() -> None:
    a = WorkerLocation("n1", "cpu", "d1")
    assert topology_class(a, WorkerLocation("n1", "cpu", "d1")) is TopologyClass.SAME_DOMAIN
    assert topology_class(a, WorkerLocation("n1", "cpu", "d2")) is TopologyClass.SAME_NODE
    assert topology_class(a, WorkerLocation("n2", "cpu", "d1")) is TopologyClass.CROSS_NODE
    g = WorkerLocation("n1", "cuda:0", "x")
    assert topology_class(g, WorkerLocation("n1", "cuda:0", "x")) is TopologyClass.SAME_DEVICE
    assert detect_location("n1", "cpu", "rack-a").nvlink_domain == "rack-a"
    assert detect_location("n1", "cpu", None).nvlink_domain == "n1/host"
    assert WorkerLocation.from_dict(a.to_dict()) == a


def test_nvidia_smi_topology_matrix_is_parsed() -> None:
    text = (
        "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\n"
        "GPU0\t X \tNV12\tSYS\tSYS\t0-31\n"
        "GPU1\tNV12\t X \tSYS\tSYS\t0-31\n"
        "GPU2\tSYS\tSYS\t X \tNV4\t32-63\n"
        "GPU3\tSYS\tSYS\tNV4\t X \t32-63\n"
    )
    groups = nvlink_groups_from_topo_matrix(text)
    assert groups[0] == groups[1] != groups[2] == groups[3]


def test_one_kv_budget_and_engine_limits_name_the_field(tmp_path) -> None:
    from cluster.worker_runtime import build_engine
    from engine.testing import make_tiny_checkpoint

    with pytest.raises(ConfigError, match="pools.num_kv_blocks: give one KV budget"):
        load_config(overrides=["pools.num_kv_blocks=64", "pools.kv_cache_bytes=1000000"])
    path = str(make_tiny_checkpoint("llama", tmp_path / "llama"))
    cfg = load_config(overrides=[f"model.path={path}", "model.device=cpu",
                                 "pools.kv_cache_bytes=1125899906842624"])
    with pytest.raises(ConfigError, match=r"pools.kv_cache_bytes: 1048576.00 GiB asked, more"):
        build_engine(cfg, role="decode")
    cfg = load_config(overrides=[f"model.path={path}", "model.device=cpu", "model.dtype=float16"])
    with pytest.raises(ConfigError, match="model.dtype: float16 does not run on cpu"):
        build_engine(cfg, role="decode")
    cfg = load_config(overrides=[f"model.path={path}", "model.device=cpu",
                                 "pools.kv_cache_memory_fraction=0.001"])
    engine = build_engine(cfg, role="decode")
    assert engine.num_total_blocks > 0


def test_open_access_and_where_keys_come_from(tmp_path: Path) -> None:
    # Open access on loopback, said at start; on another address only when asked for.
    assert "bound to 127.0.0.1 only" in load_config(environ={}).access_summary()
    cfg = load_config(overrides=["router.host=0.0.0.0", "router.allow_open_access=true"],
                      environ={})
    assert not cfg.requires_api_key and cfg.access_summary().startswith("WARNING")
    # Keys from the environment join the listed ones, as keyed digests: the loaded tree
    # holds no key. A key file stays a path, read by the router alone (and re-read).
    keys = tmp_path / "keys"
    keys.write_text("# team a\nk-file-1\n\n  k-file-2  \n")
    cfg = load_config(overrides=[
        "router.host=0.0.0.0",
        f"tenants=[{{name: a, api_keys: [k-listed], api_keys_file: {keys}}},"
        " {name: b, tier: 2, api_keys_env: B_KEYS, may_override_tier: true,"
        " max_tier_override: 1}]"], environ={"B_KEYS": "k-env-1, k-env-2 k-env-3"})
    a, b = cfg.tenants
    assert a.accepts("k-listed") and not a.accepts("k-env-1") and a.api_keys_file == str(keys)
    assert all(b.accepts(k) for k in ("k-env-1", "k-env-2", "k-env-3")) and not b.accepts("k")
    assert b.max_tier_override == 1 and b.api_keys_env is None
    assert ClusterConfig.from_dict(cfg.to_dict()) == cfg
    assert "API key is required" in cfg.access_summary()
    shipped = json.dumps(cfg.to_dict())
    for key in ("k-listed", "k-env-1", "k-file-1"):
        assert key not in shipped and key not in repr(cfg)
    check_key_files(cfg)
    with pytest.raises(ConfigError, match=r"tenants\[0\].api_keys_file: cannot read"):
        check_key_files(load_config(overrides=["tenants=[{name: a, api_keys_file: /no/keys}]"],
                                    environ={}))
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["tenants=[{name: a, api_keys: [k1]}, {name: b, api_keys: [k1]}]"],
                    environ={})
    assert "k1" not in str(e.value)
    # A tree whose key sources were never read is refused, not served open.
    with pytest.raises(ConfigError, match="not read"):
        ClusterConfig.from_dict({"tenants": [{"name": "a", "api_keys_env": "B_KEYS"}]})


def test_scheduler_and_workers_get_no_key_material() -> None:
    # What cluster/app.py launch_workers sends the scheduler and every worker.
    cfg = load_config(overrides=[
        "router.host=0.0.0.0", "tenants=[{name: a, api_keys: [sk-a]}, "
        "{name: b, tier: 2, api_keys_file: /run/keys/b}, {name: c, api_keys_env: C}]"],
        environ={"C": "sk-c"})
    shipped = cfg.without_keys().to_dict()
    text = json.dumps(shipped)
    assert "sk-a" not in text and "sk-c" not in text and "/run/keys" not in text
    assert "hmac-sha256" not in text and "hmac-sha256" in json.dumps(cfg.to_dict())
    worker_cfg = ClusterConfig.from_dict(shipped)  # what the actors rebuild
    assert worker_cfg.keys_withheld and not worker_cfg.requires_api_key
    assert [(t.name, t.tier) for t in worker_cfg.tenants] == [("a", 1), ("b", 2), ("c", 1)]
    assert worker_cfg.pools == cfg.pools and worker_cfg.router == cfg.router
    # A withheld tree never carries keys back in, and a configuration cannot claim to be one.
    with pytest.raises(ConfigError, match="keys_withheld"):
        ClusterConfig.from_dict({**shipped, "tenants": [{"name": "a", "api_keys": ["k"]}]})


def test_planner_settings_and_their_checks() -> None:
    cfg = load_config(overrides=["planner.enabled=true", "planner.max_decode=3",
                                 "pools.num_decode=2"])
    st = cfg.planner.settings()
    assert st.decode.max_size == 3 and st.prefill.min_size == 1 and st.cooldown_s == 20.0
    with pytest.raises(ConfigError, match="planner bounds"):
        load_config(overrides=["planner.enabled=true", "pools.num_decode=5"])
    with pytest.raises(ConfigError, match="min"):
        load_config(overrides=["planner.min_decode=3", "planner.max_decode=2"])
    with pytest.raises(ConfigError, match="watermarks"):
        load_config(overrides=["planner.busy_low=0.9", "planner.busy_high=0.5"])
    # Off (the default), the pool sizes are not held to the planner's bounds.
    assert load_config(overrides=["pools.num_decode=5"]).pools.num_decode == 5


def test_an_aggregated_cluster_has_no_prefill_pool_for_the_planner() -> None:
    cfg = load_config(overrides=["planner.enabled=true", "pools.mode=aggregated",
                                 "pools.num_prefill=0"])
    st = cfg.planner_settings()
    assert (st.prefill.min_size, st.prefill.max_size) == (0, 0) and st.decode.max_size == 4
