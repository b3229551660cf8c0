"""Control messages between the router, the global scheduler and the workers.

Everything that crosses an actor boundary at run time is msgpack bytes of plain
dicts (DESIGN §7: nothing is unpickled from another process). This module names the
events a worker reports and packs/unpacks them; the global scheduler turns events
into state transitions (``scheduler.request.transition``).

Worker report (every control interval, worker -> global scheduler)::

    {"worker_id", "role", "location": {node, device, nvlink_domain},
     "num_free_blocks", "num_total_blocks", "num_waiting", "backlog_tokens",
     "block_events": [{"kind": "stored"|"removed", "block_hashes", "parent_hash"}],
     "events": [{"req_id", "event", "time", "num_blocks"}],
     "running": [[req_id, num_blocks], ...],        # decode workers: preemption candidates
     "prefill_tokens_per_s", "decode_step_s"}       # measured, for the service estimate
"""

from __future__ import annotations

import enum
from typing import Any

import msgpack


class WorkerEvent(enum.Enum):
    PREFILL_DONE = "prefill_done"  # first token sampled, KV on its way: -> TRANSFERRING
    DECODE_START = "decode_start"  # decode worker added the prefilled request: -> DECODING
    FINISHED_STOP = "finished_stop"
    FINISHED_LENGTH = "finished_length"
    PREEMPTED_SWAP = "preempted_swap"
    PREEMPTED_RECOMPUTE = "preempted_recompute"
    RESUMED_SWAP = "resumed_swap"
    RESUMED_RECOMPUTE = "resumed_recompute"
    ABORTED = "aborted"
    TRANSFER_FAILED = "transfer_failed"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def event(req_id: str, kind: WorkerEvent, time: float, num_blocks: int = 0) -> dict[str, Any]:
    return {"req_id": req_id, "event": kind.value, "time": time, "num_blocks": num_blocks}


def scheduler_actor_name(namespace_suffix: str = "") -> str:
    return f"tierserve-scheduler{namespace_suffix}"


def worker_actor_name(role: str, index: int) -> str:
    return f"tierserve-{role}-{index}"
