"""One topology rule: the kernel's placement (``topology_class`` of two workers), the cluster's
locations and kvtransfer's endpoints (``KVLocation.topology_to``) all classify by
``scheduler.topology.classify``, so a measured transfer reports the class it was priced by."""

from __future__ import annotations

import pytest

from cluster.topology import WorkerLocation
from cluster.topology import topology_class as cluster_class
from scheduler.messages import KVLocation
from scheduler.topology import TopologyClass, WorkerInfo, WorkerRole, classify, topology_class

CASES = [
    # (node, device, domain) of both ends, and the class
    (("n0", "cuda:0", "d0"), ("n0", "cuda:0", "d0"), TopologyClass.SAME_DEVICE),
    (("n0", "cuda:0", "d0"), ("n0", "cuda:1", "d0"), TopologyClass.SAME_DOMAIN),
    (("n0", "cuda:0", "d0"), ("n0", "cuda:1", "d1"), TopologyClass.SAME_NODE),
    (("n0", "cuda:0", "d0"), ("n1", "cuda:0", "d0"), TopologyClass.CROSS_NODE),
    # two CPU pools never share a device, even on one host: the block crosses a socket
    (("n0", "cpu", "n0/host"), ("n0", "cpu", "n0/host"), TopologyClass.SAME_DOMAIN),
    (("n0", "cpu", "a"), ("n0", "cpu", "b"), TopologyClass.SAME_NODE),
    (("n0", "cpu", "n0/host"), ("n1", "cpu", "n1/host"), TopologyClass.CROSS_NODE),
]


@pytest.mark.parametrize(("a", "b", "expected"), CASES)
def test_every_view_of_two_workers_gets_the_same_class(a, b, expected):
    assert classify(*a, *b) is expected
    assert classify(*b, *a) is expected
    info = [WorkerInfo(f"w{i}", WorkerRole.DECODE, n, d, dom, 8)
            for i, (n, d, dom) in enumerate((a, b))]
    assert topology_class(*info) is expected
    assert cluster_class(WorkerLocation(*a), WorkerLocation(*b)) is expected
    assert KVLocation(*a).topology_to(KVLocation(*b)) is expected


def test_no_known_domain_matches_none():
    assert classify("n0", "cuda:0", None, "n0", "cuda:1", None) is TopologyClass.SAME_NODE
    assert classify("n0", "cpu", None, "n0", "cpu", None) is TopologyClass.SAME_NODE
    assert KVLocation("n0", "cuda:0").topology_to(KVLocation("n0", "cuda:0")) is \
        TopologyClass.SAME_DEVICE
