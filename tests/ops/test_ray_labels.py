"""The chart's NVLink domain reaches real Ray: a worker group's rendered `rayStartParams`,
put on a `ray start` command line the way KubeRay does (``--key=value`` in a bash
command, ``$(VAR)`` expanded by Kubernetes), start a Ray node whose labels and custom
resources carry the domain."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow]

READY_TIMEOUT_S = 120.0
QUERY = """
import json, ray
ray.init(address="127.0.0.1:{port}", log_to_driver=False)
node = [n for n in ray.nodes() if n["Alive"]][0]
print(json.dumps({{"labels": node["Labels"], "resources": node["Resources"]}}))
ray.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kuberay_command(params: dict[str, str], port: int, env: dict[str, str]) -> str:
    """`ray start` as KubeRay writes it, on one local node (CPU sizes replaced)."""
    params = dict(params, **{"num-cpus": "1", "num-gpus": "0"})
    args = " ".join(f"--{k}={v}" for k, v in params.items())
    for name, value in env.items():  # Kubernetes expands $(VAR) in container args
        args = args.replace(f"$({name})", value)
    ray = Path(sys.executable).with_name("ray")
    return (f"{ray} start --head --block --node-ip-address=127.0.0.1 --port={port} "
            f"--include-dashboard=false {args}")


def test_domain_label_and_resource_reach_the_ray_node(chart, tmp_path: Path) -> None:
    (rs,) = [d for d in chart.render("-f", str(chart.two_node_values))
             if d["kind"] == "RayService"]
    (group,) = [g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
                if g["groupName"] == "decode-nvl-b"]
    port = free_port()
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="disabled",
               RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    log_path = tmp_path / "ray_start.log"
    cmd = kuberay_command(group["rayStartParams"], port, {"TIERSERVE_K8S_NODE": "gpu-node-2"})
    with log_path.open("w") as log:
        proc = subprocess.Popen(["bash", "-c", cmd], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while "Ray runtime started" not in log_path.read_text():
            assert proc.poll() is None, f"ray start exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "ray start did not come up"
            time.sleep(0.5)
        out = subprocess.run([sys.executable, "-c", QUERY.format(port=port)], env=env,
                             capture_output=True, text=True, timeout=READY_TIMEOUT_S)
        assert out.returncode == 0, out.stderr[-3000:]
        node = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    labels, resources = node["labels"], node["resources"]
    assert labels["tierserve.io/nvlink-domain"] == "nvl-b"
    assert labels["tierserve.io/role"] == "decode"
    assert labels["tierserve.io/k8s-node"] == "gpu-node-2"
    assert resources["tierserve_domain_nvl_b"] == 1.0
    assert resources["tierserve_decode"] == 1.0
    assert yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
