"""The chart: `helm lint --strict`, `helm template` for a 2-node GPU cluster, and the
rendered objects checked against Kubernetes' schemas, the repo's RayService schema and
tierserve's own config loader; then each safety property of the rendered objects (Ray
token auth, NetworkPolicy, keys from a Secret on the head only, probes, security
contexts, the serve Service), and every unsafe combination refused at render time."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster.config import ClusterConfig, ConfigError, load_config

K8S_VERSION = "1.35.0"
OPEN = ("--set", "config.router.allow_open_access=true")
VALUES = Path(__file__).resolve().parents[2] / "helm" / "tierserve" / "values.yaml"


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def validate_core(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def pod_template(name: str, template: dict[str, Any]) -> dict[str, Any]:
    """A group's pod template as a core PodTemplate object, for the Kubernetes schema."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
            "template": template}


def rendered_config(docs: list[dict[str, Any]], tmp_path: Path) -> ClusterConfig:
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-config")]
    path = tmp_path / "config.yaml"
    path.write_text(cm["data"]["config.yaml"])
    return load_config(path, environ={})


@pytest.mark.parametrize("two_node", [False, True], ids=["defaults", "2node-gpu"])
def test_lint_strict(chart, two_node: bool) -> None:
    args = ["lint", "--strict", str(chart.path)]
    args += ["-f", str(chart.two_node_values)] if two_node else list(OPEN)
    out = chart.run(*args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


def test_two_node_gpu_cluster_renders_valid_objects(chart, tmp_path: Path) -> None:
    docs = chart.render("-f", str(chart.two_node_values))
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "ConfigMap", "NetworkPolicy",
                                               "RayService", "Secret", "ServiceMonitor"]
    for doc in docs:
        if doc["kind"] in ("ConfigMap", "NetworkPolicy", "Secret"):
            validate_core(doc)
    (rs,) = by_kind(docs, "RayService")
    jsonschema.validate(rs, json.loads(chart.rayservice_schema.read_text()),
                        cls=jsonschema.Draft202012Validator)
    cluster = rs["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    validate_core(pod_template("head", head["template"]))
    groups = cluster["workerGroupSpecs"]
    for g in groups:
        validate_core(pod_template(g["groupName"], g["template"]))
    assert [g["groupName"] for g in groups] == ["prefill-nvl-a", "decode-nvl-a", "prefill-nvl-b",
                                                "decode-nvl-b"]
    cfg = rendered_config(docs, tmp_path)
    assert (cfg.pools.num_prefill, cfg.pools.num_decode) == (2, 2)
    assert cfg.model.served_name == "qwen2.5-7b"
    # Keys come from the Secret's files, read by the router; the config names the files.
    assert cfg.requires_api_key and [t.api_keys_file for t in cfg.tenants] == [
        "/etc/tierserve/keys/chat", "/etc/tierserve/keys/batch", "/etc/tierserve/keys/metrics"]
    for g in groups:
        role, domain = g["groupName"].split("-", 1)
        assert g["replicas"] == g["minReplicas"] == g["maxReplicas"] == 1
        spec = g["template"]["spec"]
        # Pinned to the NVLink domain's nodes by the clique label, and told its domain.
        clique = {"nvl-a": "a1b2c3d4.0", "nvl-b": "e5f6a7b8.0"}[domain]
        assert spec["nodeSelector"]["nvidia.com/gpu.clique"] == clique
        params = g["rayStartParams"]
        assert f"tierserve.io/nvlink-domain={domain}" in params["labels"].split(",")
        resources = json.loads(json.loads(params["resources"].strip("'")))
        assert resources == {f"tierserve_{role}": 1,
                             "tierserve_domain_" + domain.replace("-", "_"): 1}
        (container,) = spec["containers"]
        limits = container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == params["num-gpus"] == "1"
        assert limits["cpu"] == params["num-cpus"] == "8"
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["TIERSERVE_NVLINK_DOMAIN"] == domain
        assert env["TIERSERVE_CONFIG"] == "/etc/tierserve/config.yaml"
        # Loopback node addresses are for one machine; pods must advertise their own IP.
        assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in env
    assert sum(g["replicas"] for g in groups if g["groupName"].startswith("prefill")) == 2
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    (app,) = serve["applications"]
    assert app["import_path"] == "cluster.serve_app:app_builder"
    assert app["args"] == {"config_path": "/etc/tierserve/config.yaml"}
    assert serve["http_options"] == {"host": cfg.router.host, "port": cfg.router.port}

    # Clients reach the RayService's own serve Service: KubeRay sets its selector (the
    # active cluster's pods with a healthy Serve proxy); the chart makes no Service that
    # selects pods by its own labels, which both clusters' heads carry during an upgrade.
    svc = rs["spec"]["serveService"]
    assert "selector" not in svc["spec"]
    assert svc["metadata"]["name"] == rs["metadata"]["name"]
    (port,) = svc["spec"]["ports"]
    head_ports = {p["name"]: p["containerPort"]
                  for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert port["targetPort"] == head_ports["serve"] == cfg.router.port
    validate_core({"apiVersion": "v1", "kind": "Service", **svc})
    (sm,) = by_kind(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == port["name"]
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    # Keys are required on /metrics: the scrape sends one from the Secret.
    assert sm["spec"]["endpoints"][0]["authorization"] == {
        "type": "Bearer", "credentials": {"name": "tierserve-api-keys", "key": "metrics"}}
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"]["matchNames"] == ["llm"]
    # The dashboard ConfigMap carries the chart's dashboard file as is.
    (dash,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("dashboard")]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["tierserve.json"]) == json.loads(
        (chart.path / "dashboards" / "tierserve.json").read_text())


def test_open_access_on_the_network_needs_an_explicit_value(chart) -> None:
    # The defaults: host 0.0.0.0 and no tenant with a key. Refused, with what to do.
    out = chart.run("template", "ts", str(chart.path))
    assert out.returncode != 0
    assert "config.router.host 0.0.0.0 with no API key" in out.stderr
    assert "allow_open_access" in out.stderr
    # Said explicitly, on loopback, or with a key file: rendered.
    for extra in (OPEN, ("--set", "config.router.host=127.0.0.1"),
                  ("--set", "config.tenants[0].name=a", "--set",
                   "config.tenants[0].api_keys_file=/etc/tierserve/keys/a",
                   "--set", "apiKeys.existingSecret=keys")):
        assert chart.run("template", "ts", str(chart.path), *extra).returncode == 0, extra


def test_the_router_binds_the_configured_host(chart) -> None:
    # The old chart bound 0.0.0.0 whatever config.router.host said, so a loopback host
    # without keys passed the check and served open on the pod IP.
    (rs,) = by_kind(chart.render("--set", "config.router.host=127.0.0.1"), "RayService")
    serve = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert serve["http_options"]["host"] == "127.0.0.1"
    (head,) = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        command = head[probe]["exec"]["command"]
        assert command[command.index("--host") + 1] == "127.0.0.1"


def test_defaults_render_one_prefill_and_one_decode_group(chart, tmp_path: Path) -> None:
    docs = chart.render(*OPEN)
    assert "ServiceMonitor" not in {d["kind"] for d in docs}
    (rs,) = by_kind(docs, "RayService")
    groups = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert [(g["groupName"], g["replicas"]) for g in groups] == [("prefill", 1), ("decode", 1)]
    assert all("nodeSelector" not in g["template"]["spec"] for g in groups)
    cfg = rendered_config(docs, tmp_path)
    assert cfg.pools.num_gpus_per_worker == 1


def test_config_in_secret_and_fractional_cpus(chart, tmp_path: Path) -> None:
    values = tmp_path / "cpu-values.yaml"
    values.write_text("configInSecret: true\n"
                      "apiKeys: {existingSecret: my-keys}\n"
                      "config: {pools: {num_cpus_per_worker: 0.5, num_gpus_per_worker: 0},\n"
                      "         tenants: [{name: a, api_keys_file: /etc/tierserve/keys/a}]}\n")
    docs = chart.render("-f", str(values))
    (secret,) = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"].endswith("-config")]
    validate_core(secret)
    assert "config.yaml" in secret["stringData"]
    (rs,) = by_kind(docs, "RayService")
    for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        validate_core(pod_template(g["groupName"], g["template"]))
        res = g["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["cpu"] == "500m" and "nvidia.com/gpu" not in res["limits"]
        # `ray start --num-cpus/--num-gpus` take integers.
        assert (g["rayStartParams"]["num-cpus"], g["rayStartParams"]["num-gpus"]) == ("1", "0")
        volumes = {v["name"]: v for v in g["template"]["spec"]["volumes"]}
        assert volumes["config"]["secret"]["secretName"] == secret["metadata"]["name"]


def test_domain_counts_must_match_the_pools(chart) -> None:
    out = chart.run("template", "ts", str(chart.path), "-f", str(chart.two_node_values), "--set",
                   "topology.domains[1].prefill=3")
    assert out.returncode != 0
    assert "prefill counts add up to 4 but config.pools.num_prefill is 2" in out.stderr
    out = chart.run("lint", "--strict", str(chart.path), "--set", "topology.domains[0].name=A_b")
    assert out.returncode != 0


def test_rayservice_schema_refuses_what_kuberay_would(chart) -> None:
    (rs,) = by_kind(chart.render("-f", str(chart.two_node_values)), "RayService")
    schema = json.loads(chart.rayservice_schema.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors(rs))
    bad_replicas = copy.deepcopy(rs)
    bad_replicas["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "1"
    bad_param = copy.deepcopy(rs)
    bad_param["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 4
    typo = copy.deepcopy(rs)
    typo["spec"]["rayClusterConfig"]["workerGroupSpec"] = []
    for broken in (bad_replicas, bad_param, typo):
        assert list(validator.iter_errors(broken))


def test_values_mirror_the_config_tree() -> None:
    values = yaml.safe_load(VALUES.read_text())
    tree = values["config"]
    # Every section and field the chart names is one ClusterConfig has, and the chart's
    # defaults are a valid configuration once open access is chosen (the loader refuses
    # it on 0.0.0.0 as the chart does).
    with pytest.raises(ConfigError, match="allow_open_access"):
        ClusterConfig.from_dict(tree)
    ClusterConfig.from_dict({**tree, "router": {**tree["router"], "allow_open_access": True}})
    for section, fields in tree.items():
        assert section in ClusterConfig.model_fields, section
        if isinstance(fields, dict):
            model = ClusterConfig.model_fields[section].annotation
            assert set(fields) <= set(model.model_fields), (section, set(fields))
