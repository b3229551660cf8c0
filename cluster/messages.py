"""Actor names, and msgpack for the cluster's read-side documents.

Every message of the request path (submissions, dispatches, reports, token batches,
notices) is a typed ``scheduler.messages`` message. What is left here is msgpack for the
plain JSON-like documents the cluster answers about itself (a worker's setup info,
``stats``, ``why``), which nothing but the driver and the router reads, and never a
pickle (DESIGN §7).
"""

from __future__ import annotations

from typing import Any

import msgpack

from scheduler.messages import WorkerSetup


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def setup_document(worker_id: str, role: str, setup: WorkerSetup) -> dict[str, Any]:
    """A worker's setup as the driver reads it (``setup()``, ``worker_infos``)."""
    return {"worker_id": worker_id, "role": role,
            "location": {"node": setup.node, "device": setup.device,
                         "nvlink_domain": setup.nvlink_domain},
            "num_total_blocks": setup.num_total_blocks,
            "num_free_blocks": setup.num_free_blocks,
            "bytes_per_block": setup.bytes_per_block, "max_model_len": setup.max_model_len,
            "ray_node_id": setup.ray_node_id, "pid": setup.pid}


def scheduler_actor_name(namespace_suffix: str = "") -> str:
    return f"tierserve-scheduler{namespace_suffix}"


def worker_actor_name(role: str, index: int) -> str:
    return f"tierserve-{role}-{index}"
