"""Two Ray nodes as two NVLink domains, 2 prefill + 2 decode workers (ray.cluster_utils).

The nodes are labelled and given resources the way the Helm chart does it
(``tierserve.io/nvlink-domain``, ``tierserve.io/k8s-node``, ``tierserve_domain_<name>``):
the workers are scheduled onto their declared domain's node by that resource alone, and
report the labelled node names and domains. Requests decode in their prefill worker's
domain while capacity allows, and every transfer is counted by topology class. The requests go through the router's cluster
backend directly (no HTTP), to keep this module's time small."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NUM_REQUESTS = 24
LABEL_DOMAIN = "tierserve.io/nvlink-domain"
LABEL_NODE = "tierserve.io/k8s-node"


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path]]:
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from cluster.app import start_workers
    from cluster.config import load_config
    from engine.testing import make_tiny_checkpoint

    torch.set_num_threads(1)
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    path = make_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("tiny") / "qwen2")
    ray_cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"tierserve_domain_nvl_a": 1}, "include_dashboard": False,
        "node_ip_address": "127.0.0.1", "labels": {LABEL_DOMAIN: "nvl-a", LABEL_NODE: "gpu-a"}})
    ray_cluster.add_node(num_cpus=2, resources={"tierserve_domain_nvl_b": 1},
                         node_ip_address="127.0.0.1",
                         labels={LABEL_DOMAIN: "nvl-b", LABEL_NODE: "gpu-b"})
    ray.init(address=ray_cluster.address, namespace="tierserve-topology")
    place = "[{node: a, nvlink_domain: nvl-a}, {node: b, nvlink_domain: nvl-b}]"
    cfg = load_config(overrides=[
        "pools.mode=disaggregated",  # these tests are about prefill -> decode transfers
        f"model.path={path}", "model.dtype=float32", "pools.num_prefill=2", "pools.num_decode=2",
        "pools.num_cpus_per_worker=0.25", "pools.num_kv_blocks=128",
        f"topology.prefill={place}", f"topology.decode={place}"], environ={})
    handles = start_workers(cfg)
    yield handles, path
    ray.shutdown()
    ray_cluster.shutdown()


async def _run_requests(handles: object, path: Path) -> list[int]:
    from cluster.backend import ClusterBackend, HFTokenizer
    from router.backend import GenerationSpec, SamplingSpec

    backend = ClusterBackend(handles.scheduler, handles.decode, HFTokenizer.from_path(str(path)),
                             "tiny", handles.max_model_len, 10.0, 120.0)
    sem = asyncio.Semaphore(4)

    async def one(i: int) -> int:
        spec = GenerationSpec(f"topo-{i}", tuple(range(i, i + 20 + i)), SamplingSpec(8, 0.0),
                              tier=1, tenant="t", arrival_time=time.time())
        n = 0
        async with sem:
            async for delta in backend.generate(spec):
                n += len(delta.token_ids)
        return n

    return await asyncio.gather(*(one(i) for i in range(NUM_REQUESTS)))


def test_decode_stays_in_the_prefill_domain_and_transfers_are_counted(two_node_cluster) -> None:
    import ray

    handles, path = two_node_cluster
    infos = {i["worker_id"]: i["location"] for i in handles.infos}
    assert {loc["nvlink_domain"] for loc in infos.values()} == {"nvl-a", "nvl-b"}
    counts = asyncio.run(_run_requests(handles, path))
    assert all(1 <= n <= 8 for n in counts)
    by_class = handles.stats()["transfers_by_class"]
    total = sum(by_class.values())
    assert total == NUM_REQUESTS
    assert by_class["same_domain"] >= 0.95 * total
    metrics = ray.get(handles.scheduler.metrics.remote(), timeout=10).decode()
    assert 'tierserve:kv_transfer_bytes_total{topology="same_domain"}' in metrics
    # Each worker runs on the Ray node labelled with its declared domain (placed by the
    # tierserve_domain_<name> resource) and reports that node's labels.
    labels = {n["NodeID"]: n["Labels"] for n in ray.nodes() if n["Alive"]}
    for i in handles.infos:
        node_labels = labels[i["ray_node_id"]]
        assert i["location"]["nvlink_domain"] == node_labels[LABEL_DOMAIN]
        assert i["location"]["node"] == node_labels[LABEL_NODE]
    assert {i["location"]["node"] for i in handles.infos} == {"gpu-a", "gpu-b"}
