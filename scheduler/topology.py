"""Worker locations and what moving KV blocks between them costs (DESIGN §6).

The kernel sees each worker as a :class:`WorkerInfo` (role, node, device, NVLink
domain, KV budget). :func:`topology_class` says how far a block travels between
two workers; :class:`LinkCosts` prices a move of ``n`` blocks by that class.
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


def classify(node_a: str, device_a: str, domain_a: str,
             node_b: str, device_b: str, domain_b: str) -> TopologyClass:
    """The one rule for how far a block travels; CPU "devices" are never shared."""
    if node_a != node_b:
        return TopologyClass.CROSS_NODE
    if device_a == device_b and device_a != "cpu":
        return TopologyClass.SAME_DEVICE
    if domain_a == domain_b:
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
