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


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def scheduler_actor_name(namespace_suffix: str = "") -> str:
    return f"tierserve-scheduler{namespace_suffix}"


def worker_actor_name(role: str, index: int) -> str:
    return f"tierserve-{role}-{index}"
