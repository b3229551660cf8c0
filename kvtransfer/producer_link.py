"""One producer-consumer pair, producer side: the sender and acknowledgement threads.

Owned by :class:`kvtransfer.producer.KVProducer` (one link per consumer endpoint); see that
module for the transfer's life. The producer imports this module, never the reverse: what a
link uses of it (the table, the pool, its server, ``fail_overdue``) comes in one
:class:`ProducerContext` at construction. Every segment of the plan (kvtransfer.plan) is one message on
the transfer's tag, sent once its last position is pushed and the consumer can take it:

* posted path (a channel that keeps receives posted, gloo or mock, without checksums): the
  consumer posts every segment's receive when it accepts the Open and answers Ready; from
  then on ``push`` itself sends each finished segment when the link is idle (no thread
  hand-off on the latency path). The consumer's End(DONE), or any next job, has the sender
  thread reap those sends.
* announced path (NCCL, or with checksums): a Blocks message (with the checksums) precedes
  each batch of segments; the consumer posts their receives when it reads it.

A segment is sent straight from a block-major pool when its source blocks are consecutive,
else gathered into a staging slab in the wire layout; from a layer-major pool every segment is
gathered (kvtransfer.buffers), so the consumer sees the same messages from either layout. Sends are issued under ``_issue_lock`` in order, so at most one
message per posted receive ever travels on a tag: when the consumer cancels (its End), one
empty message releases its next posted receive if some segment was not sent (the flush),
and no segment is sent after that.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from kvtransfer import auth, wire
from kvtransfer.backend import FRAME_TAG, Backend, Channel, ChannelError, MessageQueue, Work
from kvtransfer.buffers import FramePool, PoolView, Slab, SlabPool, crc32
from kvtransfer.guard import Refusal, RefusalCounts, worth_logging
from kvtransfer.layout import KVLayout, KVStore, dtype_to_wire
from kvtransfer.plan import Segment, ticket_digest
from kvtransfer.state import FailReason, Side, TransferConfig, TransferState
from kvtransfer.transfers import TransferRecord, TransferTable
from scheduler.messages import KVEndpoint, KVLocation, KVServer

log = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.uint8)  # the flush message


@dataclass(frozen=True, slots=True)
class ProducerContext:
    """What every link of one producer shares with it, handed over at construction: the link
    reads and ends transfers through these and never reaches into the producer itself."""

    endpoint_id: str
    table: TransferTable
    store: KVStore
    layout: KVLayout
    config: TransferConfig
    backend: Backend
    server: KVServer  # the producer's own rendezvous server (the fwd queue lives there)
    location: KVLocation
    fail_overdue: Callable[[TransferRecord, Side, str], None]  # KVProducer.fail_overdue
    is_closed: Callable[[], bool]  # the producer is closing: live transfers end ABORTED
    drop_link: Callable[[ProducerLink], None]  # forget a torn-down link


class ProducerLink:
    """One consumer's pair: its process group (rank 0), the fwd stream, its rev queue."""

    def __init__(self, ctx: ProducerContext, consumer: KVEndpoint, secret: str) -> None:
        self._ctx = ctx
        self.consumer_id = consumer.endpoint_id
        self._consumer = consumer
        self._secret = secret  # the ticket's: proves to the consumer that we hold one
        self.pair = f"{ctx.endpoint_id}-{uuid.uuid4().hex[:8]}"
        self.dead = False
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._issue_lock = threading.Lock()
        self._queued = 0  # submitted jobs not yet done: push may only send inline at 0
        self._connected = False
        self._frames = False  # fwd messages as frames on the group (else the store queue)
        self._posted = False  # the posted path (see the module docstring)
        self._fwd: MessageQueue | None = None
        self._channel: Channel | None = None
        # (work, buffer or None, the pool to give it back to, record or None, blocks)
        self._in_flight: deque[tuple[Work, Any, Any, TransferRecord | None, int]] = deque()
        # Transfers opened on this pair whose consumer side has not answered End yet: the
        # flush needs them even after the caller forgot them.
        self._records: dict[str, TransferRecord] = {}
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"kvx-send-{self.pair}")
        self._acker: threading.Thread | None = None
        self._fwd_key = f"kvx/{self.pair}/fwd"
        self._rev_key = f"kvx/{self.pair}/rev"
        # Both queues live on stores anyone may push to: fwd sealed, rev opened
        # (kvtransfer.auth); what fails is counted here and dropped.
        self._fwd_sealer = auth.Sealer(secret, self._fwd_key)
        # Held from sealing to pushing, so fwd messages reach the store in sequence order
        # (the consumer refuses one older than the last as a replay).
        self._fwd_lock = threading.Lock()
        self.counts = RefusalCounts()
        self._closing = threading.Event()
        self._frame_pool = FramePool()
        self._staging: dict[int, SlabPool] = {}  # by segment size
        self._pool = PoolView(ctx.store)
        self._stream: Any = None

    def start(self) -> None:
        self._sender.start()

    def submit(self, job: tuple) -> None:
        with self._issue_lock:
            self._queued += 1
        self._jobs.put(job)

    def close(self) -> None:
        """Graceful: the sender says Bye after the queued jobs; the consumer answers Bye."""
        if not self._closing.is_set():
            self._closing.set()
            self.submit(("bye",))

    def join(self, timeout: float) -> None:
        self._sender.join(timeout)
        if self._acker is not None:
            self._acker.join(timeout)
        if self._channel is not None:
            self._channel.close()

    # -- push (caller's thread) -----------------------------------------------------------------

    def on_pushed(self, record: TransferRecord, event: Any) -> None:
        """Positions up to ``record.cursor`` are pushed: send the segments that finished."""
        segments, k = record.segments, record.num_issued
        if (k >= len(segments) or segments[k].last_position >= record.cursor
                or (record.posted and not record.ready)):
            return
        if event is None and self._posted and self._issue_lock.acquire(blocking=False):
            # Posted path, link idle: send from push() itself (no thread hand-off)
            error: ChannelError | None = None
            try:
                if self._connected and not self._queued and not self._closing.is_set():
                    max_in_flight = self._ctx.config.max_in_flight_parts
                    while self._has_sendable(record) and len(self._in_flight) < max_in_flight:
                        if not self._issue_segment(record):
                            return
                    if self._has_sendable(record):  # past the in-flight window: the thread
                        self._queued += 1
                        self._jobs.put(("send", record, None))
                    return
            except ChannelError as exc:
                error = exc
                return
            finally:
                self._issue_lock.release()
                if error is not None:
                    self._teardown(FailReason.PEER_LOST, f"sending to the consumer: {error}")
        self.submit(("send", record, event))

    def _has_sendable(self, record: TransferRecord) -> bool:
        segments = record.segments
        return (record.num_issued < len(segments)
                and segments[record.num_issued].last_position < record.cursor
                and (record.ready or not record.posted))

    # -- issuing (under _issue_lock) ------------------------------------------------------------

    def _issue(self, tensor: torch.Tensor, tag: int, buf: Any, pool: Any,
               record: TransferRecord | None, n: int) -> None:
        if self._channel is None:
            raise ChannelError("send before the pair was set up")
        work = self._channel.send(tensor, tag)
        self._in_flight.append((work, buf, pool, record, n))

    def _segment_message(self, record: TransferRecord, seg: Segment, read: bool = True
                         ) -> tuple[torch.Tensor, Slab | None, SlabPool | None]:
        """The segment as one message: a run of a block-major pool, or its blocks gathered
        into a slab. ``read`` False (a transfer that ended after it was announced): a slab as
        it is, so that no read of the source blocks starts after the end (the consumer drains
        it)."""
        positions, src, n = seg.positions, record.src, seg.num_blocks
        first = src[positions[0]]
        if read and self._pool.block_major and (
                n == 1 or [src[p] for p in positions] == list(range(first, first + n))):
            return self._pool.run(first, n), None, None
        staging = self._staging.get(record.segment_blocks)
        if staging is None:
            staging = self._staging[record.segment_blocks] = SlabPool(
                self._ctx.layout, record.segment_blocks)
        slab = staging.take()
        if not read:
            return slab.message(n), slab, staging
        return self._pool.gather([src[p] for p in positions], slab), slab, staging

    def _issue_segment(self, record: TransferRecord) -> bool:
        """Send the record's next segment; False when the transfer ended or was flushed (then
        nothing more is sent for it: no read of its source blocks starts after the end)."""
        seg = record.segments[record.num_issued]
        with record.io_lock:
            if record.state.is_terminal or record.flushed:
                return False
            tensor, slab, staging = self._segment_message(record, seg)
            self._issue(tensor, record.tag, slab, staging, record, seg.num_blocks)
            record.num_issued += 1
        return True

    def _send_fwd(self, msg: wire.Message) -> None:
        if not self._frames:
            self._push_fwd(msg)
            return
        frame = self._frame_pool.take()
        wire.write_frame(msg, frame.view)
        self._issue(frame.tensor, FRAME_TAG, frame, self._frame_pool, None, 0)

    def _push_fwd(self, msg: wire.Message) -> None:
        """Store-queue path: one sealed message on our own store's fwd queue."""
        with self._fwd_lock:
            if self._fwd is not None:
                self._fwd.push(self._fwd_key, self._fwd_sealer.seal(wire.encode(msg)))

    # -- sender thread --------------------------------------------------------------------------

    def _connect(self) -> None:
        ctx, cfg = self._ctx, self._ctx.config
        backend, server = ctx.backend, self._consumer.server
        # Every connection of ours to the consumer's server is up before the Hello: the
        # consumer only connects after reading it (simultaneous connects to one TCPStore
        # server were seen to stall one of them for seconds).
        self._fwd = backend.open_queue(ctx.server, cfg.connect_timeout_s)
        accept = backend.open_queue(server, cfg.connect_timeout_s)
        rev = backend.open_queue(server, cfg.connect_timeout_s)
        proof = auth.pair_proof(self._secret, self.pair, ctx.endpoint_id)
        hello = auth.seal(self._secret, wire.ACCEPT_KEY, 0, wire.encode(wire.Hello(
            self.pair, ctx.endpoint_id, ctx.server, ctx.location, ctx.layout.shape(), proof)))
        channel = backend.open_channel(server, self.pair, 0, ctx.layout.device,
                                       ctx.location.host, cfg.connect_timeout_s,
                                       on_connected=lambda: accept.push(wire.ACCEPT_KEY, hello),
                                       secret=self._secret, counts=self.counts)
        accept.close()
        self._acker = threading.Thread(target=self._ack_loop, args=(rev,), daemon=True,
                                       name=f"kvx-ack-{self.pair}")
        self._acker.start()
        if ctx.layout.device.type == "cuda":
            torch.cuda.set_device(ctx.layout.device)
            self._stream = torch.cuda.Stream(ctx.layout.device)
        with self._issue_lock:
            self._channel = channel
            self._frames = channel.can_prepost
            self._posted = channel.can_prepost and not cfg.checksum
            self._connected = True

    def _send_loop(self) -> None:
        try:
            self._connect()
        except ChannelError as exc:
            self._teardown(FailReason.CONNECT_FAILED, f"cannot open the pair: {exc}")
            return
        stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        try:
            with stream:
                while True:
                    try:
                        job = self._jobs.get(block=not self._in_flight)
                    except queue.Empty:
                        self._reap_one()
                        continue
                    kind = job[0]
                    if kind == "stop":
                        return
                    if kind == "reap":  # not submitted: it does not order sends
                        while self._in_flight:
                            self._reap_one()
                        continue
                    if kind == "open":
                        self._open(job[1])
                    elif kind == "send":
                        self._send_segments(job[1], job[2])
                    elif kind == "end":
                        self._end(job[1], job[2])
                    elif kind == "keepalive":
                        self._keepalive(job[1])
                    elif kind == "flush":
                        self._flush(job[1])
                    elif kind == "confirm":
                        while self._in_flight:
                            self._reap_one()
                        self._confirm(job[1])
                    elif kind == "bye":
                        with self._issue_lock:
                            self._send_fwd(wire.Bye())
                        while self._in_flight:
                            self._reap_one()
                        return
                    with self._issue_lock:
                        self._queued -= 1
        except ChannelError as exc:
            reason = FailReason.TIMEOUT if exc.timed_out else FailReason.PEER_LOST
            self._teardown(reason, f"sending to the consumer: {exc}")

    def _open(self, record: TransferRecord) -> None:
        """Announce the transfer (even one that already ended: its End must bind too)."""
        layout = self._ctx.layout
        segments = record.segments
        msg = wire.Open(
            req=record.req_id, tag=record.tag,
            digest=ticket_digest(record.block_ids, record.present),
            num_blocks=record.num_total, num_segments=len(segments),
            segment_blocks=record.segment_blocks, layers=[0, layout.num_layers],
            dtype=dtype_to_wire(layout.dtype), block_shape=list(layout.block_shape),
            posted=self._posted)
        self._make_room()
        with self._issue_lock:
            record.posted = self._posted
            self._records[record.req_id] = record
            self._send_fwd(msg)
        # segments pushed before the Open wait in their own "send" job (behind this one)

    def _send_segments(self, record: TransferRecord, event: Any) -> None:
        if event is not None:
            event.wait()  # our side stream waits for the compute stream that produced them
        if not self._posted:
            self._send_announced(record)
            return
        while True:
            self._make_room()
            with self._issue_lock:
                if not self._has_sendable(record) or not self._issue_segment(record):
                    return

    def _send_announced(self, record: TransferRecord) -> None:
        """Blocks(first, count, crc) then the segments, in batches that fit one message."""
        checksum = self._ctx.config.checksum
        # with checksums a batch is staged before it is announced: keep it to the window
        batch = self._ctx.config.max_in_flight_parts if checksum else wire.MAX_SEGMENTS_PER_BLOCKS
        while self._has_sendable(record):
            first = record.num_issued
            count = 0
            while (first + count < len(record.segments) and count < batch
                   and record.segments[first + count].last_position < record.cursor):
                count += 1
            if checksum:
                # the checksums go first, so the batch is staged before it is announced
                staged = []
                with record.io_lock:
                    if record.state.is_terminal:
                        return
                    for seg in record.segments[first:first + count]:
                        staged.append(self._segment_message(record, seg))
                    if self._stream is not None:
                        self._stream.synchronize()
                    crc = [crc32(tensor) for tensor, _, _ in staged]
                with self._issue_lock:
                    self._send_fwd(wire.Blocks(record.req_id, record.tag, first,
                                               _sizes(record, first, count), crc))
                for seg, (tensor, slab, staging) in zip(
                        record.segments[first:first + count], staged, strict=True):
                    self._make_room()
                    with self._issue_lock:
                        self._issue(tensor, record.tag, slab, staging, record, seg.num_blocks)
                        record.num_issued += 1
                continue
            with self._issue_lock:
                if record.state.is_terminal:
                    return
                self._send_fwd(wire.Blocks(record.req_id, record.tag, first,
                                           _sizes(record, first, count), None))
            # Once announced, every segment is sent even if the transfer ends meanwhile (the
            # consumer drains it): the stream of messages must match what it was told.
            for seg in record.segments[first:first + count]:
                self._make_room()
                with self._issue_lock, record.io_lock:
                    live = not record.state.is_terminal
                    tensor, slab, staging = self._segment_message(record, seg, read=live)
                    self._issue(tensor, record.tag, slab, staging, record, seg.num_blocks)
                    record.num_issued += 1

    def _end(self, record: TransferRecord, msg: wire.End) -> None:
        self._make_room()
        with self._issue_lock:
            self._send_fwd(msg)
            if not record.posted:  # the consumer only mirrors it; nothing is owed
                self._records.pop(record.req_id, None)

    def _keepalive(self, record: TransferRecord) -> None:
        """The caller vouches for a transfer with nothing to send yet: tell the consumer
        (after the Open, which went first on this stream), unless the transfer ended."""
        self._make_room()
        with self._issue_lock:
            if record.state.is_terminal or self._records.get(record.req_id) is not record:
                return
            self._send_fwd(wire.Keepalive(record.req_id, record.tag))

    def _flush(self, record: TransferRecord) -> None:
        """The consumer is ending the transfer: one empty message for every segment not sent,
        so that each of its posted receives gets its one message (and none is sent after)."""
        with self._issue_lock, record.io_lock:
            if record.flushed or not record.ready:
                return
            record.flushed = True
            owed = len(record.segments) - record.num_issued
        for _ in range(owed):
            self._make_room()
            with self._issue_lock:
                self._issue(_EMPTY, record.tag, None, None, None, 0)

    def _confirm(self, record: TransferRecord) -> None:
        """The stall watchdog found every block pushed but no End from the consumer: every
        send has completed now (reaped above), so the blocks left this pool."""
        with self._ctx.table.lock:
            sent = record.num_issued == len(record.segments)
        if sent:
            self._ctx.table.finish(
                record, TransferState.DONE,
                detail="every block was sent; the consumer did not confirm in time")
        else:
            self._ctx.fail_overdue(record, Side.CONSUMER,
                                     "the consumer did not take the blocks in time")

    def _make_room(self) -> None:
        while len(self._in_flight) >= self._ctx.config.max_in_flight_parts:
            self._reap_one()

    def _reap_one(self) -> None:
        with self._issue_lock:
            if not self._in_flight:
                return
            work, buf, pool, record, n = self._in_flight.popleft()
        try:
            work.wait(self._ctx.config.stall_timeout_s)
        finally:
            if pool is not None and buf is not None:
                with self._issue_lock:
                    pool.give(buf)
        if record is not None and n:
            with self._ctx.table.lock:
                if not record.state.is_terminal:
                    record.mark_progress(n, n * self._ctx.layout.bytes_per_block)

    # -- ack thread -----------------------------------------------------------------------------

    def _ack_loop(self, rev: MessageQueue) -> None:
        """The ack thread. Whatever escapes the loop ends the pair in order, never the
        thread alone with the pair half up."""
        try:
            self._read_acks(rev)
        except Exception as exc:
            log.exception("kvtransfer producer: pair %s failed", self.pair)
            self.counts.count(Refusal.MALFORMED)
            self._teardown(FailReason.PROTOCOL, f"the pair's ack reader failed: {exc!r:.200}")

    def _read_acks(self, rev: MessageQueue) -> None:
        table = self._ctx.table
        opener = auth.Opener(self._secret, self._rev_key, wire.MAX_MESSAGE_BYTES)
        while True:
            try:
                raw = rev.pop(self._rev_key)
            except ChannelError as exc:
                self._teardown(FailReason.PEER_LOST, f"consumer unreachable: {exc}")
                return
            try:  # the consumer's store: anyone may push there
                payload = opener.open(raw)
            except auth.AuthError as exc:
                if worth_logging(self.counts.count(Refusal(exc.kind))):
                    log.warning("kvtransfer producer: pair %s: refused a rev message (%s)",
                                self.pair, exc)
                continue
            try:
                msg = wire.decode(payload)
            except wire.ProtocolError as exc:  # authentic, so the consumer is broken
                self.counts.count(Refusal.MALFORMED)
                self._teardown(FailReason.PROTOCOL, f"bad message from the consumer: {exc}")
                return
            if isinstance(msg, wire.Bye):
                local = self._closing.is_set()
                if not local:  # the consumer leaves: answer, then tear down
                    self._closing.set()
                    self.submit(("bye",))
                self._teardown(FailReason.PEER_LOST, "the consumer closed the pair", local=local)
                return
            if isinstance(msg, wire.Ready):
                record = self._records.get(msg.req)
                if record is not None and record.tag == msg.tag:
                    record.ready = True
                    if self._has_sendable(record):
                        self.submit(("send", record, None))
                continue
            if not isinstance(msg, wire.End):
                self.counts.count(Refusal.UNEXPECTED)
                self._teardown(FailReason.PROTOCOL, f"unexpected {type(msg).__name__} on rev")
                return
            record = self._records.get(msg.req)
            if record is None or msg.tag not in (0, record.tag):
                continue  # an earlier transfer's (a request id may come back)
            del self._records[msg.req]
            num_bytes = 0
            if msg.state is TransferState.DONE:
                self._jobs.put(("reap",))  # sends that push() issued inline
                num_bytes = record.num_total * self._ctx.layout.bytes_per_block
            elif record.posted and record.ready:
                self.submit(("flush", record))
            table.finish(record, msg.state, msg.reason, msg.side, msg.detail, num_bytes=num_bytes)

    def _teardown(self, reason: FailReason, detail: str, local: bool | None = None) -> None:
        ctx = self._ctx
        self.dead = True
        if local is None:
            local = ctx.is_closed() or self._closing.is_set()
        if not local:
            log.warning("kvtransfer producer: pair %s to %s lost (%s): %s", self.pair,
                        self.consumer_id, reason.value, detail)
        self._records.clear()
        for record in ctx.table.live():
            if record.link is not self:
                continue
            if local:
                ctx.table.finish(record, TransferState.ABORTED, None, Side.PRODUCER, detail)
                continue
            ctx.table.finish(record, TransferState.FAILED, reason, Side.CONSUMER, detail)
            if not self._frames and reason is FailReason.TIMEOUT:
                try:  # in frames mode the consumer learns it from the torn-down group
                    self._push_fwd(wire.End(record.req_id, TransferState.FAILED, reason,
                                            Side.CONSUMER, detail, record.tag))
                except ChannelError:
                    pass
        if not local:
            if self._channel is not None:
                self._channel.close()
            self._jobs.put(("stop",))
        ctx.drop_link(self)


def _sizes(record: TransferRecord, first: int, count: int) -> list[int]:
    return [seg.num_blocks for seg in record.segments[first:first + count]]
