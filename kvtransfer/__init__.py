"""Streaming KV blocks from prefill workers to decode workers (DESIGN §1, §3): torch, msgpack.

The decode side (consumer) reserves blocks in its own pool and publishes a *ticket*; the
prefill side (producer) streams blocks into exactly those slots as its prefill chunks finish.
No Ray and no engine import here: the pool is reached through :class:`KVStore` (a Protocol the
engine's ``BlockPool`` satisfies structurally) and the control plane only carries small
msgpack-able dicts (the ticket).

Life of a transfer (both sides keep one record per request id)::

    consumer                                   producer
    1. expect(req, block_ids, present) ──ticket dict (via Ray)──▶ 2. begin(ticket)
       PENDING                                     PENDING; lazily opens the pair group
    3. ◀── msgpack header (store queue) + payload (process group) ── push(req, src_ids)
       TRANSFERRING: validate, recv, write             TRANSFERRING: stage + send in the
       straight into the reserved slots                background, next chunk computes
    4. all blocks written: DONE ──"end: done"──▶ DONE (consumer acknowledged every block)
    any time: abort() / timeout / refusal / peer loss ──"end"──▶ the other side: ABORTED|FAILED

Public API::

    from kvtransfer import (KVConsumer, KVProducer, TransferConfig, Location, KVLayout, KVStore,
                            TensorKVStore, TransferState, TransferStatus, TransferStats,
                            FailReason, Side, TopologyClass, DistBackend, MockBackend, MockHub)

    loc = Location(node_id="n0", device="cpu", nvlink_domain=None, host="127.0.0.1")
    cfg = TransferConfig(stall_timeout_s=10.0, start_timeout_s=120.0, connect_timeout_s=30.0,
                         part_bytes=8 << 20, max_in_flight_parts=4, checksum=False,
                         direct_min_bytes=128 << 10)

    # decode worker
    consumer = KVConsumer(pool, location=loc, config=cfg)   # backend: DistBackend() (gloo on
    ticket = consumer.expect(req_id, block_ids, present=())  # CPU, NCCL on CUDA) or MockBackend
        # block_ids: the reserved slots in prompt order; present: positions (indices into
        # block_ids) already valid there (prefix hits) -- they are never sent.
        # ticket: a msgpack-able dict to hand to the producer through the control plane.
    consumer.poll(req_id) -> TransferStatus | None           # never blocks
    consumer.abort(req_id) -> bool; consumer.forget(req_id) -> TransferStatus | None
    consumer.drain_stats() -> list[TransferStats]; consumer.close()

    # prefill worker
    producer = KVProducer(pool, location=loc, config=cfg)
    producer.begin(ticket)                                   # never blocks; bad ticket: ValueError
    producer.push(req_id, src_block_ids, first_position=None)  # blocks in prompt order, as each
        # chunk finishes (engine StepOutput.ready_block_ids); returns at once, a background
        # thread stages and sends them while the next chunk computes.
    producer.poll / abort / forget / drain_stats as above; producer.disconnect(consumer_id);
    producer.close()
    consumer.address() / producer.address() -> dict; .endpoint_id; .peers() -> list[str]

    TransferStatus(state: TransferState, reason: FailReason | None, failed_side: Side | None,
                   detail: str, num_blocks_done: int, num_blocks_total: int)
    TransferState: PENDING, TRANSFERRING, DONE, FAILED, ABORTED (.is_terminal)
    TransferStats(req_id, role, topology: TopologyClass, backend, state, num_blocks,
                  num_skipped_blocks, num_bytes, queued_s, duration_s, end_time) .to_dict()

Who frees which blocks:
  * consumer side: the reserved slots belong to the decode worker's engine. On DONE it hands
    them to the request (``engine.add_prefilled_request``); on FAILED or ABORTED it frees them
    (``engine.release``/``abort``). kvtransfer never frees pool blocks, and guarantees that once
    ``poll`` reports a terminal state no further write lands in those slots (a write in
    progress finishes before ``abort`` returns; late frames are drained and discarded).
  * producer side: the source blocks belong to the prefill request (``prefill_only`` keeps
    them). The prefill worker releases them once the producer's state is terminal; from then
    on kvtransfer starts no new read of them (a pool-to-pool send already on the wire may
    still read them until it completes or times out; the pool tensor outlives it and the
    consumer discards what a terminal transfer receives).
  * the records themselves are dropped by ``forget`` (a terminal transfer's status stays
    pollable until then).

Granularity: per block group, not per layer. A group is the set of blocks a prefill chunk
finished (the engine finalises blocks per step, all layers at once), so messages stay large
(gloo pays per message) and the send of chunk k overlaps the compute of chunk k+1; the tail
after prefill ends is one chunk's group. Inside a group, a run of consecutive source blocks
going to consecutive slots is sent pool to pool, one message per (layer, K|V) slice, when a
slice is at least ``direct_min_bytes`` (no copy on either side); the rest is gathered into
reused staging buffers in parts of about ``part_bytes``, pipelined (gather part i+1 while
part i is on the wire; write part i while part i+1 arrives). On gloo the header travels in
the same message as the group's first part (a frame the consumer keeps a receive posted
for), so a small group costs one message; ``push`` issues that frame itself when the link
is idle, with no thread hand-off, and leaves its send to be reaped when the consumer's End
arrives (no sender-thread wake-up while the frame is on the wire). On NCCL (a posted
receive would occupy the GPU) headers go through the store queue and the parts follow on
the group.

The fixed cost of a small transfer: a transfer starts after an idle spell, and then every
torch op pays tens of microseconds of dispatch before it touches a byte. So the hot path
builds no torch view per transfer: staging and frame buffers (``kvtransfer.buffers.Slab``)
are reused with their views made once, frame headers are written and read as bytes, host
pools are copied with numpy through a byte view of the same memory (device pools with
torch), and a direct run's (layer, K|V) views come from one ``narrow``/``unbind``.

Connections: one process group per producer-consumer pair, created lazily on the first
``begin`` to a consumer from its own rendezvous (the consumer's TCPStore; no global world
group, no init_process_group): ``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA.
Headers and acknowledgements travel as msgpack through that store's queues; tensors through
the group. A group is torn down when its peer says goodbye, dies, or stalls past the timeout.

Failures: ``TransferStatus.failed_side`` names the side whose action or absence ended the
transfer: the stalled side for TIMEOUT (``stall_timeout_s`` without progress, or
``start_timeout_s`` before the first block), the vanished side for PEER_LOST, the producer
for metadata the consumer refused (MISMATCH, CHECKSUM), the consumer for UNKNOWN_REQUEST and
LOCAL_ERROR. Both sides end up terminal: refusals and timeouts are sent to the peer as an
``End`` message; a torn-down or dead peer breaks the pair group and its queues at once.

Testing: ``kvtransfer.testing.PeerProcess`` runs an endpoint in a spawned process driven by
msgpack commands; ``MockBackend(MockHub())`` runs the same endpoints in one process;
``DistBackend(frames=False)`` runs gloo through the NCCL-style store-queue path.

CLI: ``tierserve bench-transfer --json OUT`` (kvtransfer.bench; figures in kvtransfer/README.md).
"""

from __future__ import annotations

from kvtransfer.backend import Backend
from kvtransfer.consumer import KVConsumer
from kvtransfer.dist_backend import DistBackend
from kvtransfer.layout import KVLayout, KVStore, TensorKVStore
from kvtransfer.mock_backend import MockBackend, MockHub
from kvtransfer.producer import KVProducer
from kvtransfer.state import (
    FailReason,
    Location,
    Side,
    TopologyClass,
    TransferConfig,
    TransferState,
    TransferStats,
    TransferStatus,
)

__all__ = [
    "Backend",
    "DistBackend",
    "FailReason",
    "KVConsumer",
    "KVLayout",
    "KVProducer",
    "KVStore",
    "Location",
    "MockBackend",
    "MockHub",
    "Side",
    "TensorKVStore",
    "TopologyClass",
    "TransferConfig",
    "TransferState",
    "TransferStats",
    "TransferStatus",
]
