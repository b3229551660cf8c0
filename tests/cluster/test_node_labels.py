"""Node labels and placement resources from the Helm chart, without Ray: a worker's
location prefers its node's labels over the declared topology, and its actor options ask
for the domain and role resources only where the cluster has them."""

from __future__ import annotations

from cluster.app import _worker_options
from cluster.config import load_config
from cluster.topology import (
    LABEL_DOMAIN,
    LABEL_K8S_NODE,
    domain_resource,
    label_value,
    role_resource,
)
from cluster.worker_runtime import locate

PLACE = "[{node: a, nvlink_domain: nvl-a}, {node: b, nvlink_domain: nvl.b}]"


def _cfg(*extra: str):
    return load_config(overrides=["pools.num_prefill=2", f"topology.prefill={PLACE}", *extra],
                       environ={})


def test_labels_win_over_the_declared_topology() -> None:
    cfg = _cfg()
    labels = {LABEL_DOMAIN: "clique-7", LABEL_K8S_NODE: "gpu-node-3"}
    loc = locate(cfg, "prefill", 1, "cpu", labels=labels)
    assert (loc.node, loc.nvlink_domain, loc.device) == ("gpu-node-3", "clique-7", "cpu")


def test_declared_topology_without_labels_and_partial_labels() -> None:
    cfg = _cfg()
    loc = locate(cfg, "prefill", 1, "cpu", labels={})
    assert (loc.node, loc.nvlink_domain) == ("b", "nvl.b")
    # Only the node label: the declared domain stays; an unexpanded $(VAR) is no value.
    loc = locate(cfg, "prefill", 0, "cpu", labels={LABEL_K8S_NODE: "gpu-1",
                                                    LABEL_DOMAIN: "$(TIERSERVE_DOMAIN)"})
    assert (loc.node, loc.nvlink_domain) == ("gpu-1", "nvl-a")
    # No declaration, no labels: one domain per node.
    loc = locate(load_config(environ={}), "decode", 0, "cpu", labels={LABEL_K8S_NODE: "n1"})
    assert (loc.node, loc.nvlink_domain) == ("n1", "n1/host")


def test_label_value_reads_strings_and_lists() -> None:
    assert label_value({"k": ["v"]}, "k") == "v"
    assert label_value({"k": " "}, "k") is None
    assert label_value(None, "k") is None


def test_resource_names_match_the_chart() -> None:
    # helm/tierserve/templates/_helpers.tpl tierserve.resourceName: [^A-Za-z0-9_] -> _
    assert domain_resource("nvl-a") == "tierserve_domain_nvl_a"
    assert domain_resource("uuid.0/x") == "tierserve_domain_uuid_0_x"
    assert role_resource("decode") == "tierserve_decode"


def test_workers_ask_for_domain_and_role_resources_the_cluster_has() -> None:
    cfg = _cfg()
    have = {"CPU", "tierserve_domain_nvl_a", "tierserve_prefill"}
    opts = _worker_options(cfg, "prefill", 0, "ns", have)
    assert set(opts["resources"]) == {"tierserve_domain_nvl_a", "tierserve_prefill"}
    # Domain nvl.b has no node with its resource: not asked for (it could never start).
    opts = _worker_options(cfg, "prefill", 1, "ns", have)
    assert set(opts["resources"]) == {"tierserve_prefill"}
    assert "resources" not in _worker_options(cfg, "decode", 0, "ns", {"CPU"})
    pinned = _worker_options(_cfg("topology.pin_to_node_resource=true"), "prefill", 1, "ns",
                             set(), detached=True)
    assert pinned["resources"] == {"node_b": 0.001} and pinned["lifetime"] == "detached"
