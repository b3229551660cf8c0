"""One producer-consumer pair, consumer side: the reader thread that validates and writes.

Owned by :class:`kvtransfer.consumer.KVConsumer` (one link per producer pair); see that
module for the transfer's life.
"""

from __future__ import annotations

import logging
import threading
import zlib
from collections import deque
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer import wire
from kvtransfer.backend import DATA_TAG, FRAME_TAG, Channel, ChannelError, MessageQueue, Work
from kvtransfer.buffers import PoolView, Slab, SlabPool
from kvtransfer.layout import dtype_from_wire, dtype_to_wire
from kvtransfer.state import FailReason, Location, Side, TransferState
from kvtransfer.transfers import TransferRecord, run_slices

if TYPE_CHECKING:
    from kvtransfer.consumer import KVConsumer

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 7 * 24 * 3600.0  # a posted frame receive waits this long for the next message


class ConsumerLink:
    """One producer's pair: its process group (rank 1), its fwd queue reader, our rev queue."""

    def __init__(self, owner: KVConsumer, hello: wire.Hello) -> None:
        self._owner = owner
        self.pair = hello.pair
        self.producer_id = hello.producer_id
        self._hello = hello
        self._channel: Channel | None = None
        self._rev: MessageQueue | None = None
        self._rev_lock = owner._rev_lock
        self._closing = threading.Event()
        self._staging: SlabPool | None = None
        self._pool = PoolView(owner._store, owner.layout)
        self._stream: Any = None
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kvx-recv-{self.pair}")
        self._fwd_key = f"kvx/{self.pair}/fwd"
        self._rev_key = f"kvx/{self.pair}/rev"

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def abandon(self) -> None:
        """After a join timed out (the producer never answered Bye): drop the group anyway."""
        if self._thread.is_alive() and self._channel is not None:
            self._channel.close()

    # -- messages to the producer ---------------------------------------------------------------

    def send_end(self, msg: wire.End) -> None:
        self._push_rev(msg)

    def _push_rev(self, msg: wire.Message) -> None:
        with self._rev_lock:
            if self._rev is None:
                return
            try:
                self._rev.push(self._rev_key, wire.encode(msg))
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
        owner, cfg = self._owner, self._owner.config
        hello = self._hello
        try:
            location = Location.from_wire(hello.location)
            self._rev = owner._rev_queue
            self._channel = owner._backend.open_channel(
                owner._server, self.pair, 1, owner.layout.device, owner.location.host,
                cfg.connect_timeout_s)
            fwd = None if self._channel.can_prepost else owner._backend.open_queue(
                hello.server, cfg.connect_timeout_s)
        except (ChannelError, ValueError, KeyError, TypeError) as exc:
            log.error("kvtransfer consumer: pair %s could not be set up: %s", self.pair, exc)
            self._teardown(FailReason.CONNECT_FAILED, str(exc))
            return
        self._topology = owner.location.topology_to(location)
        self._backend_name = self._channel.backend_name
        self._staging = SlabPool(owner.layout, 0, owner.lead_bytes)
        if owner.layout.device.type == "cuda":
            torch.cuda.set_device(owner.layout.device)
            self._stream = torch.cuda.Stream(owner.layout.device)
        frame = None
        if fwd is None:  # frames mode: one frame slab, its receive posted while idle
            frame = SlabPool(owner.layout, wire.FRAME_HEADER_BYTES, owner.lead_bytes).take(0)
        stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with stream:
            self._read_loop(fwd, frame)

    def _read_loop(self, fwd: MessageQueue | None, frame: Slab | None) -> None:
        channel = self._channel
        if channel is None:
            return
        pending: Work | None = None
        while True:
            try:
                if frame is None:
                    msg = wire.decode(fwd.pop(self._fwd_key)) if fwd is not None else wire.Bye()
                else:
                    # Posted only now, after the previous frame was handled: a receive posted
                    # while we write would cost the next message's latency instead.
                    pending = pending or channel.recv(frame.tensor, FRAME_TAG)
                    pending.wait(_IDLE_WAIT_S)
                    pending = None
                    msg = wire.read_frame_header(frame.header)
            except ChannelError as exc:
                self._teardown(FailReason.PEER_LOST, f"producer unreachable: {exc}")
                return
            except wire.ProtocolError as exc:
                self._teardown(FailReason.PROTOCOL, f"bad message from the producer: {exc}")
                return
            try:
                if isinstance(msg, wire.Bye):
                    if not self._closing.is_set():
                        self._closing.set()
                        self._push_rev(wire.Bye())
                    self._teardown(FailReason.PEER_LOST, "the producer closed the pair")
                    return
                if self._closing.is_set() and not isinstance(msg, wire.Blocks):
                    continue
                if isinstance(msg, wire.Open):
                    self._on_open(msg)
                elif isinstance(msg, wire.Blocks):
                    self._on_blocks(msg, frame)
                elif isinstance(msg, wire.End):
                    self._on_end(msg)
                else:
                    raise wire.ProtocolError(f"unexpected {type(msg).__name__} from the producer")
            except ChannelError as exc:
                reason = FailReason.TIMEOUT if exc.timed_out else FailReason.PEER_LOST
                self._teardown(reason, f"receiving from the producer: {exc}", notify=True)
                return
            except wire.ProtocolError as exc:
                self._teardown(FailReason.PROTOCOL, str(exc), notify=True)
                return

    def _refuse(self, req: str, reason: FailReason, side: Side, detail: str) -> None:
        table = self._owner.table
        record = table.get(req)
        if record is not None and record.link is self:
            table.finish(record, TransferState.FAILED, reason, side, detail)
        self._push_rev(wire.End(req, TransferState.FAILED, reason, side, detail))

    def _on_open(self, msg: wire.Open) -> None:
        table = self._owner.table
        record = table.get(msg.req)
        if record is None:
            self._push_rev(wire.End(msg.req, TransferState.FAILED, FailReason.UNKNOWN_REQUEST,
                                    Side.CONSUMER, "no reservation for this request id"))
            return
        with table.lock:
            if record.state.is_terminal:
                self._push_rev(wire.End(msg.req, record.state, record.reason, record.failed_side,
                                        record.detail))
                return
            if record.link is not None:
                bound_elsewhere = True
            else:
                bound_elsewhere = False
                record.link = self
                record.topology = self._topology
                record.backend = self._backend_name
        if bound_elsewhere:
            self._push_rev(wire.End(msg.req, TransferState.FAILED, FailReason.UNKNOWN_REQUEST,
                                    Side.CONSUMER, "request already served by another producer"))
        elif msg.num_blocks != record.num_total:
            self._refuse(msg.req, FailReason.MISMATCH, Side.PRODUCER,
                         f"producer will send {msg.num_blocks} blocks, {record.num_total} reserved")

    def _on_end(self, msg: wire.End) -> None:
        record = self._owner.table.get(msg.req)
        if record is not None and record.link is self:
            self._owner.table.finish(record, msg.state, msg.reason, msg.side, msg.detail)

    def _validate(self, msg: wire.Blocks, record: TransferRecord | None) -> tuple[FailReason, Side, str] | None:
        layout = self._owner.layout
        if record is None or record.link is not self:
            return FailReason.UNKNOWN_REQUEST, Side.CONSUMER, "no open reservation for this request id"
        if msg.layers != [0, layout.num_layers]:
            return FailReason.MISMATCH, Side.PRODUCER, f"layer range {msg.layers}, expected [0, {layout.num_layers}]"
        if msg.dtype != dtype_to_wire(layout.dtype):
            return FailReason.MISMATCH, Side.PRODUCER, f"dtype {msg.dtype}, reserved {dtype_to_wire(layout.dtype)}"
        if msg.block_shape != list(layout.block_shape):
            return FailReason.MISMATCH, Side.PRODUCER, f"block shape {msg.block_shape}, reserved {list(layout.block_shape)}"
        n = len(msg.dst)
        if len(msg.positions) != n or sum(msg.parts) != n or any(p == 0 for p in msg.parts):
            return FailReason.MISMATCH, Side.PRODUCER, "positions, block ids and parts disagree in count"
        if msg.crc is not None and len(msg.crc) != len(msg.parts):
            return FailReason.MISMATCH, Side.PRODUCER, "one checksum per part expected"
        for lo, count, direct in zip(msg.part_offsets, msg.parts, msg.direct, strict=True):
            if direct and msg.dst[lo:lo + count] != list(range(msg.dst[lo], msg.dst[lo] + count)):
                return FailReason.MISMATCH, Side.PRODUCER, "a direct part needs consecutive slots"
        if len(set(msg.positions)) != n:
            return FailReason.MISMATCH, Side.PRODUCER, "repeated positions"
        for pos, dst in zip(msg.positions, msg.dst, strict=True):
            if pos >= len(record.block_ids) or pos in record.present or pos in record.done_positions:
                return FailReason.MISMATCH, Side.PRODUCER, f"position {pos} is not awaiting a block"
            if record.block_ids[pos] != dst:
                return FailReason.MISMATCH, Side.PRODUCER, f"block id {dst} at position {pos} is not the reserved {record.block_ids[pos]}"
        return None

    def _part_sizes(self, msg: wire.Blocks) -> list[int]:
        """Bytes of each part as the producer declared it (to drain a refused group)."""
        try:
            elem = dtype_from_wire(msg.dtype).itemsize
        except ValueError as exc:
            raise wire.ProtocolError(str(exc)) from None
        if len(msg.layers) != 2 or msg.layers[1] <= msg.layers[0] or len(msg.block_shape) != 3:
            raise wire.ProtocolError("malformed layer range or block shape")
        per_block = (msg.layers[1] - msg.layers[0]) * 2 * elem
        for d in msg.block_shape:
            per_block *= d
        sizes = [per_block * n for n in msg.parts]
        if len(msg.direct) != len(msg.parts) or any(d not in (0, 1) for d in msg.direct):
            raise wire.ProtocolError("one direct flag (0 or 1) per part expected")
        if sum(sizes) != msg.nbytes or msg.nbytes > self._owner.config.max_group_bytes:
            raise wire.ProtocolError(f"declared payload of {msg.nbytes} bytes is inconsistent or too large")
        return sizes

    def _on_blocks(self, msg: wire.Blocks, frame: Slab | None) -> None:
        """Receive a group's parts (part 0 is already in ``frame`` in frames mode), validate
        before writing, write each part into its slots as it completes."""
        owner, cfg = self._owner, self._owner.config
        sizes = self._part_sizes(msg)
        if not sizes:
            raise wire.ProtocolError("a blocks message without parts")
        if frame is not None and msg.direct[0]:
            frame = None  # a header-only frame: part 0 goes direct
        if frame is not None and sizes[0] > frame.capacity:
            raise wire.ProtocolError("part 0 does not fit the frame")
        record = owner.table.get(msg.req)
        skip = record is not None and record.link is self and record.state.is_terminal
        refusal = None if skip else self._validate(msg, record)
        if refusal is not None:
            self._refuse(msg.req, *refusal)
        write = not skip and refusal is None and not self._closing.is_set()
        channel, staging = self._channel, self._staging
        if channel is None or staging is None:
            raise wire.ProtocolError("blocks before the pair was set up")
        wire_dtype = dtype_from_wire(msg.dtype)
        offsets = msg.part_offsets
        in_flight: deque[_Item] = deque()
        if frame is not None:
            in_flight.append((0, None, frame, None))
        for i in range(1 if frame is not None else 0, len(sizes)):
            if msg.direct[i]:
                while in_flight:
                    write = self._complete(msg, in_flight.popleft(), offsets, record, write)
                write = self._receive_direct(msg, i, sizes[i], wire_dtype, record, write)
                continue
            if len(in_flight) >= cfg.max_in_flight_parts:
                write = self._complete(msg, in_flight.popleft(), offsets, record, write)
            slab = staging.take(sizes[i])
            work = channel.recv(slab.message(sizes[i], wire_dtype), DATA_TAG)
            in_flight.append((i, work, slab, staging))
        while in_flight:
            write = self._complete(msg, in_flight.popleft(), offsets, record, write)
        if write and record is not None:
            with owner.table.lock:
                complete = len(record.done_positions) == record.num_total
            if complete and owner.table.finish(record, TransferState.DONE):
                self._push_rev(wire.End(msg.req, TransferState.DONE))

    def _receive_direct(self, msg: wire.Blocks, i: int, nbytes: int, wire_dtype: torch.dtype,
                        record: TransferRecord | None, write: bool) -> bool:
        """A direct part: one receive per (layer, K|V) straight into a run of slots, under the
        record's io_lock so that abort() returns only after the bytes have landed."""
        channel, staging = self._channel, self._staging
        if channel is None or staging is None:
            raise wire.ProtocolError("blocks before the pair was set up")
        layers = msg.layers[1] - msg.layers[0]
        n, lo = msg.parts[i], msg.part_offsets[i]
        per_slice = nbytes // (2 * layers)
        timeout = self._owner.config.stall_timeout_s
        if write and record is not None:
            with record.io_lock:
                if not record.state.is_terminal:
                    pieces = run_slices(self._owner._store.kv_tensor(), msg.dst[lo], n)
                    works = [channel.recv(piece, DATA_TAG) for piece in pieces]
                    for work in works:
                        work.wait(timeout)
                    if self._stream is not None:
                        self._stream.synchronize()
                    with self._owner.table.lock:
                        record.done_positions.update(msg.positions[lo:lo + n])
                        record.mark_progress(n, nbytes)
                    return True
        scratch = staging.take(per_slice)  # drain: every slice into the same scratch bytes
        try:
            works = [channel.recv(scratch.message(per_slice, wire_dtype), DATA_TAG)
                     for _ in range(2 * layers)]
            for work in works:
                work.wait(timeout)
        finally:
            staging.give(scratch)
        return False

    def _complete(self, msg: wire.Blocks, item: _Item, offsets: list[int],
                  record: TransferRecord | None, write: bool) -> bool:
        """Wait for one part and write it into the slots; returns whether to keep writing."""
        i, work, slab, pool = item
        try:
            if work is not None:
                work.wait(self._owner.config.stall_timeout_s)
            if not write or record is None:
                return False
            n, lo = msg.parts[i], offsets[i]
            nbytes = n * self._owner.layout.bytes_per_block
            if msg.crc is not None and _crc(slab.payload(nbytes)) != msg.crc[i]:
                self._refuse(msg.req, FailReason.CHECKSUM, Side.PRODUCER, f"part {i} checksum mismatch")
                return False
            with record.io_lock:
                if record.state.is_terminal:
                    return False
                try:
                    self._pool.scatter(msg.dst[lo:lo + n], slab)
                    if self._stream is not None:
                        self._stream.synchronize()
                except Exception as exc:  # the pool refused the write: this transfer fails
                    self._refuse(msg.req, FailReason.LOCAL_ERROR, Side.CONSUMER, f"writing blocks: {exc}")
                    return False
                with self._owner.table.lock:
                    record.done_positions.update(msg.positions[lo:lo + n])
                    record.mark_progress(n, nbytes)
            return True
        finally:
            if pool is not None:
                pool.give(slab)

    def _teardown(self, reason: FailReason, detail: str, notify: bool = False) -> None:
        """The pair is gone: fail its live transfers, close the group, forget the link."""
        self._closing.set()
        owner = self._owner
        local = owner._closed.is_set()
        for record in owner.table.live():
            if record.link is self:
                state = TransferState.ABORTED if local else TransferState.FAILED
                if owner.table.finish(record, state, None if local else reason,
                                      Side.CONSUMER if local else Side.PRODUCER, detail) and notify:
                    self._push_rev(wire.End(record.req_id, state, reason, Side.PRODUCER, detail))
        if self._channel is not None:
            self._channel.close()
        owner._drop_link(self)


# (part index, work or None when already here, slab, the pool to give the slab back to, or
# None: the frame, which the read loop keeps)
_Item = tuple[int, Work | None, Slab, SlabPool | None]


def _crc(buf: torch.Tensor) -> int:
    return zlib.crc32(buf.detach().cpu().numpy().tobytes())
