"""The chart's Serve entry point: ``serveConfigV2`` names an importable application
builder, and the builder's config loading reads the configuration the chart renders.
(The builder itself, reusing running actors, is exercised in
tests/cluster/test_cluster_preemption.py, which has a Ray instance.)"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

from cluster.config import ConfigError, load_config
from cluster.serve_app import app_builder, load_app_config


def _serve_app(chart, *args: str) -> tuple[dict, str]:
    docs = chart.render(*args)
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith(
        "-config")]
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    return app, cm["data"]["config.yaml"]


def test_import_path_resolves_to_the_builder(chart) -> None:
    app, _ = _serve_app(chart, "-f", str(chart.two_node_values))
    module, _, attr = app["import_path"].partition(":")
    assert getattr(importlib.import_module(module), attr) is app_builder


def test_builder_loads_the_rendered_config(chart, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text("config:\n  tracing: {enabled: true, jsonl_path: /var/log/ts.jsonl}\n")
    app, text = _serve_app(chart, "-f", str(chart.two_node_values), "-f", str(values))
    mounted = tmp_path / "config.yaml"  # stands in for /etc/tierserve/config.yaml
    mounted.write_text(text)
    assert set(app["args"]) == {"config_path"}
    cfg = load_app_config({**app["args"], "config_path": str(mounted)})
    assert cfg == load_config(mounted, environ={})
    # The builder reads no key: the router reads the Secret's files on the head pod.
    assert [t.api_keys_file for t in cfg.tenants] == [
        "/etc/tierserve/keys/chat", "/etc/tierserve/keys/batch", "/etc/tierserve/keys/metrics"]
    assert cfg.requires_api_key
    assert cfg.tracing.enabled and cfg.tracing.trace_file == "/var/log/ts.jsonl"
    assert cfg.pools.num_prefill == 2 and cfg.pools.num_decode == 2
    over = load_app_config({"config_path": str(mounted), "set": ["pools.num_kv_blocks=64"]})
    assert over.pools.num_kv_blocks == 64


@pytest.mark.parametrize(("args", "message"), [
    ({"config_path": "/nonexistent/config.yaml"}, "args.config_path: no file"),
    ({"config": "x"}, "unknown config"),
    ({"set": "pools.num_decode=2"}, "args.set: expected a list"),
    (["config_path"], "expected a mapping"),
])
def test_bad_builder_args_are_clear_errors(args: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_app_config(args)  # type: ignore[arg-type]
