"""One producer-consumer pair, consumer side: the reader thread and the segment waiters.

Owned by :class:`kvtransfer.consumer.KVConsumer` (one link per producer pair); see that
module for the transfer's life. The consumer imports this module, never the reverse: what a
link uses of it (the table, the pool, the shared rev queue, ``end``) comes in one
:class:`ConsumerContext` at construction. Every segment (kvtransfer.plan) is received with one receive
on the transfer's own tag: straight into its reserved slots in a block-major pool; into a
staging slab in a layer-major pool, scattered into the slots (one copy) once that receive has
completed and only while the transfer is not ending (kvtransfer.buffers):

* posted path: when the Open passes every check against the reservation, the reader posts
  the receive of every segment at once and answers Ready; a waiter thread of the transfer
  then waits for them in order, so a segment costs the producer's one message and nothing
  else (no header, no copy, no second wake-up). Layer-major: the reader posts the first
  ``max_in_flight_parts`` segments' receives, each into a slab of its own, and the waiter,
  once it has scattered a segment, posts the receive of the segment that many further on
  into the same slab (a send that finds no receive posted waits for one), so staging stays
  within the window whatever the transfer's size.
* announced path: a Blocks message says which segments follow; the reader posts their
  receives then (layer-major: into one slab, scattered after each), waits, checks the
  checksums, and drains the segments of a transfer it does not (or no longer) serve into
  scratch memory.

Cancelling a posted transfer (abort, timeout, the producer's End, a lost pair): its receives
point into its slots until each has had its message, so the record is terminal only after
that. The consumer tells the producer (End), which answers with one empty message on the tag
for every segment it had not sent: the waiter drains them (posting the rest of a layer-major
window's receives as before, and scattering nothing once the transfer is ending: an empty
message leaves a slab's earlier contents) and ends the transfer. (A gloo
receive dropped before its message arrives wedges the pair when it does, so none is dropped
while the pair lives.) A producer that does not answer within the stall timeout loses the
pair: closing the channel fails every posted receive at once. Slabs go back to the link's
pool once every receive into them has completed; a waiter that stops on a broken pair drops
its slabs instead (nothing may land in them, but they are not handed out again).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kvtransfer import auth, wire
from kvtransfer.backend import FRAME_TAG, Backend, Channel, ChannelError, MessageQueue, Work
from kvtransfer.buffers import Frame, PoolView, Slab, SlabPool, crc32
from kvtransfer.guard import Refusal, RefusalCounts, worth_logging
from kvtransfer.layout import KVLayout, KVStore, dtype_to_wire
from kvtransfer.plan import Segment, ticket_digest
from kvtransfer.state import FailReason, Side, TransferConfig, TransferState
from kvtransfer.transfers import TransferRecord, TransferTable
from scheduler.messages import KVLocation, KVServer

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 7 * 24 * 3600.0  # a posted receive waits this long (a timeout closes the pair)
_WAITER_GRACE_S = 2.0  # after closing a pair, how long its waiters get to wake


class EndTransfer(Protocol):
    """``KVConsumer.end``: end a record now, or once its posted receives have had their
    messages; False when it already ended or is ending."""

    def __call__(self, record: TransferRecord, state: TransferState, reason: FailReason | None,
                 side: Side | None, detail: str, *, tell_producer: bool = True) -> bool: ...


@dataclass(frozen=True, slots=True)
class ConsumerContext:
    """What every link of one consumer shares with it, handed over at construction: the link
    reads and ends transfers through these and never reaches into the consumer itself."""

    table: TransferTable
    store: KVStore
    layout: KVLayout
    config: TransferConfig
    segment_blocks: int  # the consumer's segment size (kvtransfer.plan)
    backend: Backend
    server: KVServer  # the consumer's own rendezvous server (the pair's group meets there)
    location: KVLocation
    rev_queue: MessageQueue  # one connection for every link's messages to its producer
    rev_lock: threading.Lock  # held while pushing on ``rev_queue``
    end: EndTransfer
    is_closed: Callable[[], bool]  # the consumer is closing: live transfers end ABORTED
    drop_link: Callable[[ConsumerLink], None]  # forget a torn-down link
    secret: str  # the consumer's (kvtransfer.auth): seals rev, opens fwd and the group's store


class ConsumerLink:
    """One producer's pair: its process group (rank 1), its fwd reader, our rev queue."""

    def __init__(self, ctx: ConsumerContext, hello: wire.Hello) -> None:
        self._ctx = ctx
        self.pair = hello.pair
        self.producer_id = hello.producer_id
        self._hello = hello
        self._channel: Channel | None = None
        self._rev: MessageQueue | None = None
        self._rev_lock = ctx.rev_lock
        self._closing = threading.Event()
        self._pool = PoolView(ctx.store)
        # layer-major pools: segments are received into slabs (shared by the waiters)
        self._staging = (None if self._pool.block_major
                         else SlabPool(ctx.layout, ctx.segment_blocks))
        self._scratch: torch.Tensor | None = None  # announced path: drained segments land here
        self._stream: Any = None
        self._topology = None
        self._backend_name = ""
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kvx-recv-{self.pair}")
        self._fwd_key = f"kvx/{self.pair}/fwd"
        self._rev_key = f"kvx/{self.pair}/rev"
        self._rev_sealer = auth.Sealer(ctx.secret, self._rev_key)
        # What this pair's streams refused (the store's fwd queue, the group's rendezvous):
        # dropped and counted, never acted on (kvtransfer.guard).
        self.counts = RefusalCounts()

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def abandon(self) -> None:
        """After a join timed out (the producer never answered Bye): drop the group anyway."""
        if self._channel is not None:
            self._channel.close()

    def give_up(self, detail: str) -> None:
        """The producer did not release a cancelled transfer's receives: close the pair."""
        log.warning("kvtransfer consumer: closing pair %s: %s", self.pair, detail)
        self._teardown(FailReason.TIMEOUT, detail)

    # -- messages to the producer ---------------------------------------------------------------

    def send_end(self, msg: wire.End) -> None:
        self._push_rev(msg)

    def _push_rev(self, msg: wire.Message) -> None:
        with self._rev_lock:
            if self._rev is None:
                return
            try:
                self._rev.push(self._rev_key, self._rev_sealer.seal(wire.encode(msg)))
            except ChannelError as exc:
                log.warning("kvtransfer consumer: cannot reach producer %s: %s", self.producer_id, exc)

    def close(self, graceful: bool) -> None:
        """Local teardown: say goodbye (the producer answers Bye, which ends our reader)."""
        if self._closing.is_set():
            return
        self._closing.set()
        if graceful:
            self._push_rev(wire.Bye())
        else:
            self._teardown(FailReason.PEER_LOST, "pair replaced by a new one")

    # -- the reader thread ----------------------------------------------------------------------

    def _run(self) -> None:
        """The reader thread. Whatever escapes the read loop ends the pair in order (its
        transfers fail, the group closes), never the thread alone with the pair half up."""
        try:
            self._serve()
        except Exception as exc:
            log.exception("kvtransfer consumer: pair %s failed", self.pair)
            self.counts.count(Refusal.MALFORMED)
            self._teardown(FailReason.PROTOCOL, f"the pair's reader failed: {exc!r:.200}",
                           notify=True)

    def _serve(self) -> None:
        ctx, cfg = self._ctx, self._ctx.config
        hello = self._hello
        try:
            self._rev = ctx.rev_queue
            self._channel = ctx.backend.open_channel(
                ctx.server, self.pair, 1, ctx.layout.device, ctx.location.host,
                cfg.connect_timeout_s, secret=ctx.secret, counts=self.counts)
            fwd = None if self._channel.can_prepost else ctx.backend.open_queue(
                hello.server, cfg.connect_timeout_s)
        except (ChannelError, ValueError) as exc:
            log.error("kvtransfer consumer: pair %s could not be set up: %s", self.pair, exc)
            self._teardown(FailReason.CONNECT_FAILED, str(exc))
            return
        self._topology = ctx.location.topology_to(hello.location)
        self._backend_name = self._channel.backend_name
        if ctx.layout.device.type == "cuda":
            torch.cuda.set_device(ctx.layout.device)
            self._stream = torch.cuda.Stream(ctx.layout.device)
        stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with stream:
            self._read_loop(fwd, Frame() if fwd is None else None)

    def _read_loop(self, fwd: MessageQueue | None, frame: Frame | None) -> None:
        channel = self._channel
        if channel is None:
            return
        pending: Work | None = None
        opener = auth.Opener(self._ctx.secret, self._fwd_key, wire.MAX_MESSAGE_BYTES)
        while True:
            try:
                if frame is None:
                    if fwd is None:
                        msg: wire.Message = wire.Bye()
                    else:
                        try:  # the producer's store: anyone may push there
                            payload = opener.open(fwd.pop(self._fwd_key))
                        except auth.AuthError as exc:
                            if worth_logging(self.counts.count(Refusal(exc.kind))):
                                log.warning("kvtransfer consumer: pair %s: refused a fwd "
                                            "message (%s)", self.pair, exc)
                            continue
                        msg = wire.decode(payload)
                else:
                    pending = pending or channel.recv(frame.tensor, FRAME_TAG)
                    pending.wait(_IDLE_WAIT_S)
                    pending = None
                    msg = wire.read_frame(frame.view)
            except ChannelError as exc:
                self._teardown(FailReason.PEER_LOST, f"producer unreachable: {exc}")
                return
            except wire.ProtocolError as exc:  # authentic, so the producer is broken
                self.counts.count(Refusal.MALFORMED)
                self._teardown(FailReason.PROTOCOL, f"bad message from the producer: {exc}")
                return
            try:
                if isinstance(msg, wire.Bye):
                    if not self._closing.is_set():
                        self._closing.set()
                        self._push_rev(wire.Bye())
                    self._teardown(FailReason.PEER_LOST, "the producer closed the pair")
                    return
                if isinstance(msg, wire.Blocks):
                    self._on_blocks(msg)
                elif self._closing.is_set():
                    continue
                elif isinstance(msg, wire.Open):
                    self._on_open(msg)
                elif isinstance(msg, wire.End):
                    self._on_end(msg)
                elif isinstance(msg, wire.Keepalive):
                    self._on_keepalive(msg)
                else:
                    raise wire.ProtocolError(f"unexpected {type(msg).__name__} from the producer")
            except ChannelError as exc:
                reason = FailReason.TIMEOUT if exc.timed_out else FailReason.PEER_LOST
                self._teardown(reason, f"receiving from the producer: {exc}", notify=True)
                return
            except wire.ProtocolError as exc:
                self.counts.count(Refusal.MALFORMED)
                self._teardown(FailReason.PROTOCOL, str(exc), notify=True)
                return

    def _refuse(self, req: str, tag: int, reason: FailReason, side: Side, detail: str) -> None:
        record = self._ctx.table.get(req)
        if record is not None and record.link is self and record.tag == tag:
            self._ctx.end(record, TransferState.FAILED, reason, side, detail)
        else:
            self._push_rev(wire.End(req, TransferState.FAILED, reason, side, detail, tag))

    def _on_open(self, msg: wire.Open) -> None:
        table = self._ctx.table
        record = table.get(msg.req)
        if record is None:
            self._push_rev(wire.End(msg.req, TransferState.FAILED, FailReason.UNKNOWN_REQUEST,
                                    Side.CONSUMER, "no reservation for this request id", msg.tag))
            return
        with table.lock:
            terminal = record.state.is_terminal
            bound_elsewhere = record.link is not None and record.link is not self
            if not terminal and not bound_elsewhere:
                record.link, record.topology = self, self._topology
                record.backend, record.posted = self._backend_name, msg.posted
        if terminal:
            self._push_rev(wire.End(msg.req, record.state, record.reason, record.failed_side,
                                    record.detail, msg.tag))
            return
        if bound_elsewhere:
            self._push_rev(wire.End(msg.req, TransferState.FAILED, FailReason.UNKNOWN_REQUEST,
                                    Side.CONSUMER, "request already served by another producer",
                                    msg.tag))
            return
        refusal = self._check_open(msg, record)
        if refusal is not None:
            self._refuse(msg.req, msg.tag, FailReason.MISMATCH, Side.PRODUCER, refusal)
            return
        if msg.posted:
            self._post(record)

    def _check_open(self, msg: wire.Open, record: TransferRecord) -> str | None:
        """Why the Open does not match the reservation (None: it does)."""
        layout = self._ctx.layout
        if msg.num_blocks != record.num_total:
            return f"producer will send {msg.num_blocks} blocks, {record.num_total} reserved"
        if msg.digest != ticket_digest(record.block_ids, record.present):
            return "the block ids the producer holds are not the reservation's"
        if msg.layers != [0, layout.num_layers]:
            return f"layer range {msg.layers}, expected [0, {layout.num_layers}]"
        if msg.dtype != dtype_to_wire(layout.dtype):
            return f"dtype {msg.dtype}, reserved {dtype_to_wire(layout.dtype)}"
        if msg.block_shape != list(layout.block_shape):
            return f"block shape {msg.block_shape}, reserved {list(layout.block_shape)}"
        if (msg.tag, msg.segment_blocks, msg.num_segments) != (
                record.tag, record.segment_blocks, len(record.segments)):
            return "tag or segment plan differs from the ticket's"
        if msg.posted and (self._channel is None or not self._channel.can_prepost):
            return "the posted path needs a channel that keeps receives posted"
        return None

    def _post(self, record: TransferRecord) -> None:
        """Posted path: a receive per segment into its slots (layer-major: the first window's
        into slabs), a waiter for them, Ready."""
        channel, table = self._channel, self._ctx.table
        if channel is None:
            raise wire.ProtocolError("open before the pair was set up")
        with record.io_lock:
            with table.lock:
                if record.state.is_terminal:
                    return
            slabs: list[Slab] | None = None
            if self._staging is None:
                works = [channel.recv(self._pool.run(seg.first_slot, seg.num_blocks),
                                      record.tag) for seg in record.segments]
            else:
                window = record.segments[:self._ctx.config.max_in_flight_parts]
                slabs = [self._staging.take() for _ in window]
                works = [channel.recv(slab.message(seg.num_blocks), record.tag)
                         for slab, seg in zip(slabs, window, strict=True)]
            waiter = threading.Thread(target=self._wait_segments, args=(record, slabs),
                                      daemon=True, name=f"kvx-wait-{record.req_id}")
            with table.lock:
                record.works, record.waiter = works, waiter
            del works
            waiter.start()
        self._push_rev(wire.Ready(record.req_id, record.tag))

    def _wait_segments(self, record: TransferRecord, slabs: list[Slab] | None) -> None:
        """A posted transfer's waiter: each segment's receive in plan order, then the end.
        ``slabs``: layer-major, the window's staging slabs (``works[k]`` receives into
        ``slabs[k]``); None: the receives go straight into the slots."""
        table, per_block = self._ctx.table, self._ctx.layout.bytes_per_block
        works = record.works
        if works is None:
            return
        error: ChannelError | None = None
        last = len(record.segments) - 1
        # Every receive is waited for, even once the transfer is ending: a gloo receive that
        # is dropped before its message comes wedges the pair when the message does come
        # (gloo neither discards nor skips it), so each one gets exactly one message, a
        # segment or the producer's empty release.
        for seg in record.segments:
            k = seg.index if slabs is None else seg.index % len(slabs)
            try:
                works[k].wait(_IDLE_WAIT_S)
                if slabs is not None:
                    self._land_staged(record, seg, slabs[k], works, k)
            except ChannelError as exc:
                error = exc
                break
            if seg.index == last and table.finish(record, TransferState.DONE, unless_ending=True,
                                                  num_bytes=record.num_total * per_block):
                works.clear()  # every receive has completed: DONE before the cleanup
                with table.lock:
                    record.works, record.num_landed = None, len(record.segments)
                self._give_slabs(slabs)
                self._push_rev(wire.End(record.req_id, TransferState.DONE, tag=record.tag))
                return
            with table.lock:
                if record.cancel is None:
                    record.num_landed += 1
                    record.mark_progress(seg.num_blocks, seg.num_blocks * per_block)
        works.clear()  # all completed, or the pair is closed: nothing lands in the slots now
        del works
        if error is None:
            self._give_slabs(slabs)
        with table.lock:  # only now may end() finish it directly
            record.works = None
            cancel = record.cancel
        if cancel is not None:
            table.finish(record, *cancel)
        elif error is not None:
            reason = FailReason.TIMEOUT if error.timed_out else FailReason.PEER_LOST
            table.finish(record, TransferState.FAILED, reason, Side.PRODUCER,
                         f"receiving from the producer: {error}")

    def _land_staged(self, record: TransferRecord, seg: Segment, slab: Slab, works: list[Any],
                     k: int) -> None:
        """Layer-major posted path: the segment is in ``slab``; scatter it into its slots
        unless the transfer is ending (an empty release message leaves the slab as it was),
        then post the receive of the segment a window further on into the same slab."""
        with record.io_lock:  # end() waits for a scatter in progress
            if record.cancel is None and not record.state.is_terminal:
                self._pool.scatter(slab, seg.first_slot, seg.num_blocks)
        later = seg.index + len(works)
        if later < len(record.segments):
            channel = self._channel
            if channel is None:
                raise ChannelError("the pair is gone")
            works[k] = channel.recv(slab.message(record.segments[later].num_blocks), record.tag)

    def _give_slabs(self, slabs: list[Slab] | None) -> None:
        if slabs is not None and self._staging is not None:
            for slab in slabs:
                self._staging.give(slab)

    def _on_keepalive(self, msg: wire.Keepalive) -> None:
        """The producer vouches for a transfer it has nothing to send for yet (its prompt
        is queued or paused between chunks): its clock restarts."""
        table = self._ctx.table
        record = table.get(msg.req)
        if record is None or record.link is not self or record.tag != msg.tag:
            return  # ended and forgotten, or an earlier transfer's
        with table.lock:
            if not record.state.is_terminal and record.cancel is None:
                record.last_alive = time.monotonic()

    def _on_end(self, msg: wire.End) -> None:
        record = self._ctx.table.get(msg.req)
        if record is not None and record.link is self and msg.tag in (0, record.tag):
            # answered even when nothing is owed: a posted transfer's End asks for the flush
            self._ctx.end(record, msg.state, msg.reason, msg.side, msg.detail)

    # -- announced path -------------------------------------------------------------------------

    def _on_blocks(self, msg: wire.Blocks) -> None:
        """Receive the announced segments into their slots (or drain them), in order."""
        table = self._ctx.table
        if any(n == 0 for n in msg.sizes) or (msg.crc is not None and len(msg.crc) != len(msg.sizes)):
            raise wire.ProtocolError("a blocks message with an empty segment or stray checksums")
        record = table.get(msg.req)
        serve = record is not None and record.link is self and record.tag == msg.tag
        if serve and record is not None and record.posted:
            raise wire.ProtocolError("a blocks message for a transfer on the posted path")
        if serve and record is not None and not self._closing.is_set():
            plan = [s.num_blocks for s in record.segments[msg.first:msg.first + len(msg.sizes)]]
            if msg.first != record.num_landed or msg.sizes != plan or msg.tag != record.tag:
                self._refuse(msg.req, msg.tag, FailReason.MISMATCH, Side.PRODUCER,
                             "the announced segments are not the next ones of the plan")
                serve = False
        if not serve or record is None:
            self._drain(msg.tag, msg.sizes)
            return
        slab = self._staging.take() if self._staging is not None else None
        self._receive_announced(msg, record, slab)
        if slab is not None and self._staging is not None:
            self._staging.give(slab)  # (a ChannelError above drops it: the pair is broken)

    def _receive_announced(self, msg: wire.Blocks, record: TransferRecord,
                           slab: Slab | None) -> None:
        """The announced segments into their slots: straight, or (``slab``, layer-major)
        received into the slab, checked, then scattered."""
        table = self._ctx.table
        timeout = self._ctx.config.stall_timeout_s
        per_block = self._ctx.layout.bytes_per_block
        channel = self._channel
        if channel is None:
            raise wire.ProtocolError("blocks before the pair was set up")
        for i, seg in enumerate(record.segments[msg.first:msg.first + len(msg.sizes)]):
            with record.io_lock:
                if record.state.is_terminal:
                    self._drain(msg.tag, msg.sizes[i:])
                    return
                region = (self._pool.run(seg.first_slot, seg.num_blocks) if slab is None
                          else slab.message(seg.num_blocks))
                channel.recv(region, msg.tag).wait(timeout)
                if self._stream is not None:
                    self._stream.synchronize()
                if msg.crc is not None and crc32(region) != msg.crc[i]:
                    self._refuse(msg.req, msg.tag, FailReason.CHECKSUM, Side.PRODUCER,
                                 f"segment {seg.index} checksum mismatch")
                    self._drain(msg.tag, msg.sizes[i + 1:])
                    return
                if slab is not None:
                    self._pool.scatter(slab, seg.first_slot, seg.num_blocks)
                    if self._stream is not None:
                        self._stream.synchronize()  # in the slots before DONE or the next recv
                with table.lock:
                    record.num_landed += 1
                    record.mark_progress(seg.num_blocks, seg.num_blocks * per_block)
        if record.num_landed == len(record.segments) and table.finish(record, TransferState.DONE):
            self._push_rev(wire.End(msg.req, TransferState.DONE, tag=record.tag))

    def _drain(self, tag: int, sizes: list[int]) -> None:
        """Receive announced segments nobody wants (the producer sends them regardless)."""
        channel = self._channel
        if channel is None or not sizes:
            return
        per_block = self._ctx.layout.bytes_per_block
        limit = self._ctx.config.part_bytes
        need = max(sizes) * per_block
        if need > max(limit, per_block):
            raise wire.ProtocolError(f"an announced segment of {need} bytes is too large")
        if self._scratch is None or self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8, device=self._ctx.layout.device)
        timeout = self._ctx.config.stall_timeout_s
        for n in sizes:
            channel.recv(self._scratch[: n * per_block], tag).wait(timeout)

    # -- teardown -------------------------------------------------------------------------------

    def _teardown(self, reason: FailReason, detail: str, notify: bool = False) -> None:
        """The pair is gone: end its live transfers, close the group, forget the link. Posted
        transfers end once their waiters have dropped their receives (closing the channel
        fails those receives at once)."""
        self._closing.set()
        ctx = self._ctx
        local = ctx.is_closed()
        ending = []
        for record in ctx.table.live():
            if record.link is self:
                state = TransferState.ABORTED if local else TransferState.FAILED
                ctx.end(record, state, None if local else reason,
                          Side.CONSUMER if local else Side.PRODUCER, detail, tell_producer=notify)
                if record.waiter is not None and record.waiter is not threading.current_thread():
                    ending.append(record)
        if self._channel is not None:
            self._channel.close()
        # Closing fails the waiters' receives, all but one whose message was cut off midway
        # (gloo signals its pending receives, not the one it was reading into when the
        # connection broke). The pair is closed, so nothing more lands in any receive of it:
        # a waiter still blocked after the grace is left behind and its transfer ended here.
        deadline = time.monotonic() + _WAITER_GRACE_S
        for record in ending:
            record.waiter.join(max(0.0, deadline - time.monotonic()))
            if record.waiter.is_alive() and record.cancel is not None:
                log.warning("kvtransfer consumer: a receive of %s stays blocked on the closed "
                            "pair %s; ending it", record.req_id, self.pair)
                ctx.table.finish(record, *record.cancel)
        ctx.drop_link(self)
