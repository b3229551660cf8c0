"""The chart is safe by default (issue 24 item 3): each property read from the rendered
objects of `helm template`, and each unsafe combination refused with a clear message.

Reproduced from the issue: no Ray auth, the dashboard open on 0.0.0.0, no
NetworkPolicy, serveConfigV2 binding 0.0.0.0 whatever config.router.host said, keys in a
ConfigMap, no probes, no securityContext, a Service selecting head pods by chart labels
(tests/ops/test_helm.py has the last two on the two-node values)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from .test_helm import by_kind, validate_core

KEYS = ("--set", "apiKeys.existingSecret=tierserve-api-keys",
        "--set", "config.tenants[0].name=chat",
        "--set", "config.tenants[0].api_keys_file=/etc/tierserve/keys/chat")


def pods(rs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Group name -> pod template (the head as "head")."""
    cluster = rs["spec"]["rayClusterConfig"]
    out = {"head": cluster["headGroupSpec"]["template"]}
    out.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return out


def render(chart, *args: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    docs = chart.render(*args)
    (rs,) = by_kind(docs, "RayService")
    return docs, rs


def test_ray_token_auth_on_every_ray_container(chart) -> None:
    docs, rs = render(chart, *KEYS)
    (token,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("ray-token")]
    validate_core(token)
    assert len(token["data"]["auth_token"]) >= 32
    name = token["metadata"]["name"]
    # KubeRay calls the dashboard with the same Secret's token.
    assert rs["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token", "secretName": name}
    for group, template in pods(rs).items():
        for container in template["spec"]["containers"]:
            env = {e["name"]: e for e in container["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token", group
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {
                "name": name, "key": "auth_token"}, group
    # The dashboard is on the pod network (KubeRay deploys Serve through it) only because
    # the token guards it; the Ray client port is not published.
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    ports = {p["name"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert "client" not in ports
    # An existing Secret replaces the chart's.
    docs, rs = render(chart, *KEYS, "--set", "rayAuth.existingSecret=ops-token")
    assert not [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("ray-token")]
    assert rs["spec"]["rayClusterConfig"]["authOptions"]["secretName"] == "ops-token"


def test_network_policy_admits_only_the_cluster_to_ray_ports(chart) -> None:
    docs, rs = render(chart, *KEYS, "--set", "config.router.port=9000")
    (np,) = by_kind(docs, "NetworkPolicy")
    validate_core(np)
    selector = np["spec"]["podSelector"]["matchLabels"]
    for group, template in pods(rs).items():
        assert selector.items() <= template["metadata"]["labels"].items(), group
    assert np["spec"]["policyTypes"] == ["Ingress"]
    own, operator, router = np["spec"]["ingress"]
    # The cluster's own pods: every port (GCS, raylet, object manager, KV transfer).
    assert own == {"from": [{"podSelector": {"matchLabels": selector}}]}
    # KubeRay: the dashboard only.
    assert operator["ports"] == [{"protocol": "TCP", "port": 8265}]
    assert operator["from"][0]["podSelector"]["matchLabels"] == {
        "app.kubernetes.io/name": "kuberay-operator"}
    # Everyone else: the router's port only (API keys guard it), as configured.
    assert router == {"ports": [{"protocol": "TCP", "port": 9000}]}
    # Restricted to given peers when asked.
    values = {"networkPolicy": {"serveFrom": [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "ingress-nginx"}}}], "metricsFrom": [{"podSelector": {
            "matchLabels": {"app": "prometheus"}}}]}}
    docs, _ = render(chart, *KEYS, "--set-json", f"networkPolicy={json.dumps(values['networkPolicy'])}")
    (np,) = by_kind(docs, "NetworkPolicy")
    router, metrics = np["spec"]["ingress"][2:]
    # KubeRay still reaches the proxy's health check, or it would unlabel the serving pods.
    assert router["from"] == values["networkPolicy"]["serveFrom"] + operator["from"]
    assert metrics == {"from": values["networkPolicy"]["metricsFrom"],
                       "ports": [{"protocol": "TCP", "port": 8080}]}


def test_keys_come_from_a_secret_mounted_on_the_head_only(chart) -> None:
    docs, rs = render(chart, "--set", "apiKeys.create=true",
                      "--set", "apiKeys.keys.chat=sk-chat-1",
                      "--set-json", 'apiKeys.keys.batch=["sk-batch-1","sk-batch-2"]',
                      "--set", "config.tenants[0].name=chat",
                      "--set", "config.tenants[0].api_keys_file=/etc/tierserve/keys/chat",
                      "--set", "config.tenants[1].name=batch",
                      "--set", "config.tenants[1].api_keys_file=/etc/tierserve/keys/batch")
    (keys,) = [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("api-keys")]
    validate_core(keys)
    assert keys["stringData"] == {"chat": "sk-chat-1", "batch": "sk-batch-1\nsk-batch-2"}
    # No key anywhere but that Secret: not the ConfigMap, not the RayService, no env.
    rest = json.dumps([d for d in docs if d is not keys])
    assert "sk-chat-1" not in rest and "sk-batch" not in rest
    for group, template in pods(rs).items():
        spec = template["spec"]
        mounts = {m["name"]: m for m in spec["containers"][0]["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        if group == "head":
            assert mounts["api-keys"]["mountPath"] == "/etc/tierserve/keys"
            assert mounts["api-keys"]["readOnly"] is True
            assert volumes["api-keys"]["secret"]["secretName"] == keys["metadata"]["name"]
        else:
            assert "api-keys" not in mounts and "api-keys" not in volumes, group
    # The router (the only key holder) is placed on the head by its Ray resource.
    params = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert json.loads(json.loads(params["resources"].strip("'"))) == {"tierserve_router": 1}


def test_pods_run_restricted(chart) -> None:
    _, rs = render(chart, *KEYS)
    for group, template in pods(rs).items():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True, group
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["readOnlyRootFilesystem"] is True
            # Where Ray must write: its session under /tmp, caches under cacheDir.
            writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
            assert {"/tmp", "/home/ray/.cache", "/dev/shm"} <= writable, group
    # A writable root filesystem when the image needs one: no emptyDir over /tmp then.
    _, rs = render(chart, *KEYS, "--set",
                   "securityContext.container.readOnlyRootFilesystem=false")
    mounts = [m["mountPath"] for m in
              pods(rs)["head"]["spec"]["containers"][0]["volumeMounts"]]
    assert "/tmp" not in mounts


def test_head_probes_read_health(chart) -> None:
    _, rs = render(chart, *KEYS)
    (head,) = pods(rs)["head"]["spec"]["containers"]
    for probe, mode in (("readinessProbe", "ready"), ("livenessProbe", "live")):
        command = head[probe]["exec"]["command"]
        assert command[:4] == ["python", "-m", "cluster.probe", mode]
        assert command[command.index("--port") + 1] == "8000"
        # Over 0.0.0.0 the router answers on loopback inside the pod.
        assert command[command.index("--host") + 1] == "127.0.0.1"
        # The kubelet's timeout covers the probe's own.
        assert head[probe]["timeoutSeconds"] > float(command[command.index("--timeout") + 1])


@pytest.mark.parametrize(("args", "message"), [
    (("--set", "config.tenants[0].name=a", "--set", "config.tenants[0].api_keys[0]=sk-x",
      "--set", "apiKeys.existingSecret=k"), "config.tenants[0].api_keys: keys in values"),
    (("--set", "config.tenants[0].name=a", "--set", "config.tenants[0].api_keys_env=KEYS",
      "--set", "apiKeys.existingSecret=k"), "reaches every Ray container"),
    (("--set", "config.tenants[0].name=a", "--set", "config.tenants[0].api_keys_file=/etc/keys",
      "--set", "apiKeys.existingSecret=k"), "only the API keys Secret is mounted"),
    (("--set", "config.tenants[0].name=a",
      "--set", "config.tenants[0].api_keys_file=/etc/tierserve/keys/a"), "no Secret to mount"),
    ((*KEYS, "--set", "apiKeys.create=true"), "existingSecret or create, not both"),
    ((*KEYS, "--set", "rayAuth.enabled=false"), "rayAuth.allowUnauthenticated=true"),
    ((*KEYS, "--set", "head.rayStartParams.resources=x"), "head.rayStartParams.resources"),
    ((*KEYS, "--set-json", "networkPolicy.serveFrom=[{}]"), "serveFrom"),
    (("--set", "config.router.host=::"), "config.router.host :: with no API key"),
])
def test_unsafe_combinations_do_not_render(chart, args: tuple[str, ...], message: str) -> None:
    out = chart.run("template", "ts", str(chart.path), *args)
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def test_unauthenticated_ray_only_when_said(chart) -> None:
    docs, rs = render(chart, *KEYS, "--set", "rayAuth.enabled=false",
                      "--set", "rayAuth.allowUnauthenticated=true")
    assert "authOptions" not in rs["spec"]["rayClusterConfig"]
    assert not [s for s in by_kind(docs, "Secret") if s["metadata"]["name"].endswith("token")]
    (head,) = pods(rs)["head"]["spec"]["containers"]
    assert "RAY_AUTH_MODE" not in {e["name"] for e in head["env"]}


def test_two_node_values_document_the_safe_setup(chart) -> None:
    values = yaml.safe_load(chart.two_node_values.read_text())
    assert values["apiKeys"] == {"existingSecret": "tierserve-api-keys"}
    assert "extraEnv" not in values  # no key travels through the environment
    assert all(t["api_keys_file"].startswith("/etc/tierserve/keys/")
               for t in values["config"]["tenants"])
