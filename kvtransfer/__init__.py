"""Streaming KV blocks from prefill workers to decode workers (DESIGN §1, §3): torch, msgpack.

The decode side (consumer) reserves blocks in its own pool and publishes a *ticket*; the
prefill side (producer) streams blocks into exactly those slots as its prefill chunks finish.
No Ray and no engine import here: the pool is reached through :class:`KVStore` (a Protocol the
engine's ``BlockPool`` satisfies structurally: one contiguous tensor, block-major with a block
``kv[block_id]``, or layer-major ``[layers, 2, blocks, ...]`` where ``block_major`` is False)
and the control plane only carries the ticket, a typed message (``scheduler.messages.KVTicket``,
with the consumer's ``KVEndpoint``: server, ``KVLocation``, ``KVPoolShape``).

Life of a transfer (both sides keep one record per request id)::

    consumer                                     producer
    1. expect(req, block_ids, present) ──ticket (via Ray)──▶ 2. begin(ticket)
       PENDING; plans the segments                  PENDING; opens the pair lazily, Open ──▶
    3. Open checked against the reservation (count, block ids, dtype, shapes, tag, plan)
       before any receive is posted; posted path: one receive per segment straight into
       its slots, Ready ──▶                         4. push(req, src_ids) as chunks finish:
                                                       every segment whose last block is
       ◀── one message per segment, on the transfer's tag ── pushed goes at once
       ◀── Keepalive while blocks are still to come ──  keepalive(req) each turn of the
                                                       caller's loop: queued or paused
    5. every segment landed: DONE ──End(DONE)──▶    DONE
    any time: abort() / timeout / refusal / peer loss ──End──▶ the other side: ABORTED|FAILED

Public API::

    from kvtransfer import (KVConsumer, KVProducer, TransferConfig, KVLocation, KVLayout, KVStore,
                            TensorKVStore, TransferState, TransferStatus, TransferStats,
                            FailReason, Side, TopologyClass, DistBackend, MockBackend, MockHub)

    loc = KVLocation(node_id="n0", device="cpu", nvlink_domain=None, host="127.0.0.1")
    cfg = TransferConfig(stall_timeout_s=10.0, start_timeout_s=120.0, connect_timeout_s=30.0,
                         part_bytes=8 << 20, max_in_flight_parts=4, checksum=False)

    # decode worker
    consumer = KVConsumer(pool, location=loc, config=cfg)   # backend: DistBackend() (gloo on
    ticket = consumer.expect(req_id, block_ids, present=())  # CPU, NCCL on CUDA) or MockBackend
        # block_ids: the reserved slots in prompt order; present: positions (indices into
        # block_ids) already valid there (prefix hits) -- they are never sent.
        # ticket: a KVTicket (slots, present, tag, segment size, our KVEndpoint, the pair
        # secret) to hand to the producer through the control plane (scheduler.messages
        # encode/decode; StartPrefill and MigrateAnswer carry it).
    consumer.poll(req_id) -> TransferStatus | None           # never blocks
    consumer.abort(req_id) -> bool; consumer.forget(req_id) -> TransferStatus | None
    consumer.drain_stats() -> list[TransferStats]; consumer.close()
    consumer.listener_stats() -> ListenerStats               # what was refused, by kind and
        # connection (accept queue, pairs), thread restarts; consumer.is_healthy() -> bool
        # (False: the accept thread is down for good, the worker reports itself unhealthy)

    # prefill worker
    producer = KVProducer(pool, location=loc, config=cfg)
    producer.begin(ticket)                                   # never blocks; bad ticket: ValueError
        # (every field checked: it comes from another process, kvtransfer.ticket)
    producer.push(req_id, src_block_ids, first_position=None)  # blocks in prompt order, as each
        # chunk finishes (engine StepOutput.ready_block_ids); returns at once: the finished
        # segments are sent from push itself when the pair is idle, else by its sender thread,
        # while the next chunk computes.
    producer.keepalive(req_id) -> bool                       # never blocks; the blocks still
        # to come are being computed or wait their turn (a prompt queued, or paused between
        # chunks by the policy): call it every turn of the caller's loop while they do
    producer.poll / abort / forget / drain_stats as above; producer.disconnect(consumer_id);
    producer.close()
    consumer.address() / producer.address() -> KVEndpoint; .endpoint_id; .peers() -> list[str]

    TransferStatus(state: TransferState, reason: FailReason | None, failed_side: Side | None,
                   detail: str, num_blocks_done: int, num_blocks_total: int)
    TransferState: PENDING, TRANSFERRING, DONE, FAILED, ABORTED (.is_terminal)
    TopologyClass, KVLocation.topology_to: the scheduler's (scheduler.topology.classify), so a
        transfer's stats carry the class the kernel priced its move by
    TransferStats(req_id, role, topology: TopologyClass, backend, state, num_blocks,
                  num_skipped_blocks, num_bytes, queued_s, duration_s, end_time) .to_dict()

Who frees which blocks:
  * consumer side: the reserved slots belong to the decode worker's engine. On DONE it hands
    them to the request (``engine.add_prefilled_request``); on FAILED or ABORTED it frees them
    (``engine.release``/``abort``). kvtransfer never frees pool blocks, and guarantees that once
    ``poll`` reports a terminal state no further write lands in those slots. On the posted
    path a transfer's receives are posted into its slots until it ends, so ``abort()`` (and a
    timeout or the producer's End) returns at once but the state turns terminal only once
    every receive of it has had its message (the producer answers the consumer's End with one
    empty message on the tag for each segment it did not send; a producer that does not
    within the stall timeout loses the pair, which fails every receive of it). The caller
    frees the slots when ``poll`` says it ended, as vLLM's KV connectors delay freeing the
    blocks a transfer may still write.
  * producer side: the source blocks belong to the prefill request (``prefill_only`` keeps
    them). The prefill worker releases them once the producer's state is terminal; from then
    on kvtransfer starts no new read of them (a send already on the wire may still read them
    until it completes or times out; the pool tensor outlives it and the consumer, which has
    ended the transfer or will, does not keep what lands).
  * the records themselves are dropped by ``forget`` (a terminal transfer's status stays
    pollable until then).

Granularity: per segment, not per layer. The consumer cuts the reservation into *segments*
(runs of consecutive slots of at most ``part_bytes``, :mod:`kvtransfer.plan`) and both sides
derive the same plan from the ticket. A segment is one message of its blocks in the wire
layout ``[n, layers, 2, block_size, kv_heads, head_dim]``, whatever the pools' layouts
(:mod:`kvtransfer.layout`), so either side may be block-major or layer-major:
  * from a block-major pool, straight when its source blocks are consecutive too (a fresh
    prefill's usually are), else gathered into a reused staging buffer; into a block-major
    pool, straight into the slots (a run of consecutive slots is one region);
  * from a layer-major pool, always gathered into a staging buffer (one tensor op); into a
    layer-major pool, received into a staging buffer and scattered into the slots (one
    copy) once that receive completed, before the transfer is DONE.
It leaves as soon as its last block is pushed, so chunk k's blocks travel while chunk k+1
computes and the tail after the prefill is the last chunk's segments.

Two paths, by what the channel can do:
  * posted (gloo and the mock, checksums off): the consumer posts every segment's receive when
    it accepts the Open, and a waiter thread per transfer waits for them in order. A segment
    then costs exactly one tensor message: no header, no copy, no rendezvous, no second
    wake-up. Each transfer has its own tag (from the ticket), so receives of two transfers
    never take each other's messages. A layer-major consumer posts a window of
    ``max_in_flight_parts`` receives into staging buffers and the waiter posts each next one
    as it scatters an earlier one, so staging stays bounded.
  * announced (NCCL, where a posted receive occupies the GPU stream; or checksums on): a
    ``Blocks`` message (with the segments' checksums) precedes each batch of segments and the
    consumer posts their receives when it reads it, draining those of a transfer it refused.

Control messages travel as frames on the pair's own group where a receive can stay posted
(gloo, mock), else through the store queue (NCCL); acknowledgements (Ready, End, Bye) through
the consumer's store queue. The hot path builds only the one tensor view it sends, and
block-major host pools are gathered with numpy.

Connections: one process group per producer-consumer pair, created lazily on the first
``begin`` to a consumer from its own rendezvous (the consumer's TCPStore; no global world
group, no init_process_group): ``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA.
A group is torn down when its peer says goodbye, dies, or stalls past the timeout (gloo's
``abort()`` leaves the pair open, so a gloo channel is closed by timing out a wait, which
makes gloo fail every operation of the pair on both ends).

Failures: ``TransferStatus.failed_side`` names the side whose action or absence ended the
transfer: the stalled side for TIMEOUT (``stall_timeout_s`` without a block or a keepalive,
or ``start_timeout_s`` before the first block; a transfer its producer's caller keeps alive
may wait any time for its blocks, see :mod:`kvtransfer.transfers`), the vanished side for
PEER_LOST, the producer for metadata the consumer refused (MISMATCH, CHECKSUM), the
consumer for UNKNOWN_REQUEST and LOCAL_ERROR. Both sides end up terminal and agree: a
producer whose consumer stops answering is DONE if every send completed (the blocks left its
pool; the consumer, once it runs again, has them all) and FAILED (TIMEOUT, consumer side)
with the pair torn down otherwise.

Testing: ``kvtransfer.testing.PeerProcess`` runs an endpoint in a spawned process driven by
msgpack commands; ``MockBackend(MockHub())`` runs the same endpoints in one process;
``DistBackend(frames=False)`` runs gloo through the NCCL-style store-queue path.

CLI: ``tierserve bench-transfer --json OUT`` (bench.transfer; figures in kvtransfer/README.md).
"""

from __future__ import annotations

from kvtransfer.backend import Backend
from kvtransfer.consumer import KVConsumer
from kvtransfer.dist_backend import DistBackend
from kvtransfer.guard import ListenerStats, Refusal
from kvtransfer.layout import KVLayout, KVStore, TensorKVStore
from kvtransfer.mock_backend import MockBackend, MockHub
from kvtransfer.producer import KVProducer
from kvtransfer.state import (
    FailReason,
    KVLocation,
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
    "KVLocation",
    "KVProducer",
    "KVStore",
    "ListenerStats",
    "MockBackend",
    "MockHub",
    "Refusal",
    "Side",
    "TensorKVStore",
    "TopologyClass",
    "TransferConfig",
    "TransferState",
    "TransferStats",
    "TransferStatus",
]
