"""Worker locations and what moving KV blocks between them costs (DESIGN §6).

The kernel sees each worker as a :class:`WorkerInfo` (role, node, device, NVLink
domain, KV budget). :func:`classify` says how far a block travels between two
workers (:func:`topology_class` for two ``WorkerInfo``; kvtransfer's
``KVLocation.topology_to`` for its endpoints, so a measured transfer carries the
class the kernel priced); :class:`LinkCosts` prices a move of ``n`` blocks by that class.
The cluster maps its own ``cluster.topology.WorkerLocation`` onto
:class:`WorkerInfo` (same class names and values), since this package may not
import the cluster.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class TopologyClass(enum.Enum):
    """How far a block travels between two workers, cheapest first."""

    SAME_DEVICE = "same_device"
    SAME_DOMAIN = "same_domain"
    SAME_NODE = "same_node"
    CROSS_NODE = "cross_node"


class WorkerRole(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    worker_id: str
    role: WorkerRole
    node: str
    device: str
    domain: str
    num_kv_blocks: int


def classify(node_a: str, device_a: str, domain_a: str | None,
             node_b: str, device_b: str, domain_b: str | None) -> TopologyClass:
    """The one rule for how far a block travels between two workers' KV pools (the kernel's
    placement, the link model's prices and kvtransfer's measured transfers all use it).

    A CPU "device" is never shared: two CPU workers, even in one process, hold separate
    pools and a block between them crosses a socket (gloo over loopback), which the link
    model (``scheduler.links``) prices as SAME_DOMAIN / SAME_NODE, not as a copy inside one
    device. A domain of None is no known NVLink domain: it matches none."""
    if node_a != node_b:
        return TopologyClass.CROSS_NODE
    if device_a == device_b and device_a != "cpu":
        return TopologyClass.SAME_DEVICE
    if domain_a is not None and domain_a == domain_b:
        return TopologyClass.SAME_DOMAIN
    return TopologyClass.SAME_NODE


def topology_class(a: WorkerInfo, b: WorkerInfo) -> TopologyClass:
    return classify(a.node, a.device, a.domain, b.node, b.device, b.domain)


@dataclass(frozen=True, slots=True)
class LinkCosts:
    """Bandwidth (bytes/s) and fixed latency (s) per topology class, plus host links.

    ``host_bw`` prices a swap between device and CPU memory (PCIe), one direction.
    """

    bytes_per_block: int
    bw: dict[TopologyClass, float]
    latency: dict[TopologyClass, float]
    host_bw: float
    host_latency: float = 20e-6

    def move_s(self, num_blocks: int, cls: TopologyClass) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.latency[cls] + num_blocks * self.bytes_per_block / self.bw[cls]

    def swap_s(self, num_blocks: int) -> float:
        if num_blocks <= 0:
            return 0.0
        return self.host_latency + num_blocks * self.bytes_per_block / self.host_bw
