"""Cluster spec for the simulator: prefill and decode workers, nodes, NVLink domains.

``parse_cluster("prefill=2,decode=2,gpus_per_node=4,domains_per_node=2")``:
workers are laid out interleaved (p0, d0, p1, d1, ...) so each prefill worker
has a decode worker in its own domain when counts allow; ``gpus_per_node``
devices per node, split evenly into ``domains_per_node`` NVLink domains.
``kv_blocks`` overrides the profile's KV blocks per worker, ``decode_kv_blocks`` those of
the decode workers alone (a decode pool whose memory, not prefill, runs short: each
decode worker then holds a few dozen requests). ``host_cache_gb`` gives
each prefill worker a prefix cache tier in host DRAM (as Mooncake's store or
LMCache do) on top of its HBM; hits are then charged a host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.topology import WorkerInfo, WorkerRole

DEFAULT_CLUSTER = "prefill=2,decode=2,gpus_per_node=4,domains_per_node=2"
_KEYS = ("prefill", "decode", "gpus_per_node", "domains_per_node", "kv_blocks", "decode_kv_blocks",
         "host_cache_gb")


class ClusterSpecError(ValueError):
    """An invalid --cluster string; the message names the key."""


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    prefill: tuple[WorkerInfo, ...]
    decode: tuple[WorkerInfo, ...]
    host_cache_gb: int = 0


def parse_cluster(text: str, default_kv_blocks: int) -> ClusterSpec:
    vals = {"prefill": 2, "decode": 2, "gpus_per_node": 8, "domains_per_node": 1,
            "kv_blocks": default_kv_blocks, "decode_kv_blocks": 0, "host_cache_gb": 0}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ClusterSpecError(f"cluster: {part!r} is not KEY=VALUE with KEY in {', '.join(_KEYS)}")
        try:
            vals[key] = int(raw)
        except ValueError:
            raise ClusterSpecError(f"cluster.{key}: {raw!r} is not an integer") from None
        if vals[key] < 0 or (vals[key] == 0 and key not in ("host_cache_gb", "decode_kv_blocks")):
            raise ClusterSpecError(f"cluster.{key}: must be positive, got {vals[key]}")
    if vals["gpus_per_node"] % vals["domains_per_node"]:
        raise ClusterSpecError("cluster.domains_per_node: must divide gpus_per_node")
    order: list[tuple[WorkerRole, int]] = []
    for i in range(max(vals["prefill"], vals["decode"])):
        if i < vals["prefill"]:
            order.append((WorkerRole.PREFILL, i))
        if i < vals["decode"]:
            order.append((WorkerRole.DECODE, i))
    per_domain = vals["gpus_per_node"] // vals["domains_per_node"]
    pre, dec = [], []
    for slot, (role, i) in enumerate(order):
        node = slot // vals["gpus_per_node"]
        local = slot % vals["gpus_per_node"]
        info = WorkerInfo(
            worker_id=f"{role.value[0]}{i}", role=role, node=f"node{node}",
            device=f"node{node}/cuda:{local}", domain=f"node{node}/nvl{local // per_domain}",
            num_kv_blocks=(vals["decode_kv_blocks"] or vals["kv_blocks"])
            if role is WorkerRole.DECODE else vals["kv_blocks"],
        )
        (pre if role is WorkerRole.PREFILL else dec).append(info)
    return ClusterSpec(tuple(pre), tuple(dec), vals["host_cache_gb"])
