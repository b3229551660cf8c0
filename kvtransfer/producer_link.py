"""One producer-consumer pair, producer side: the sender and acknowledgement threads.

Owned by :class:`kvtransfer.producer.KVProducer` (one link per consumer endpoint); see that
module for the transfer's life and this class's docstring for how sends are issued.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
import zlib
from collections import deque
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from kvtransfer import wire
from kvtransfer.backend import DATA_TAG, FRAME_TAG, Channel, ChannelError, MessageQueue, Work
from kvtransfer.buffers import PoolView, Slab, SlabPool
from kvtransfer.layout import dtype_to_wire
from kvtransfer.state import FailReason, Side, TransferState
from kvtransfer.transfers import TransferRecord, run_slices

if TYPE_CHECKING:
    from kvtransfer.producer import KVProducer


class ProducerLink:
    """One consumer's pair: its process group (rank 0), the fwd stream, its rev queue.

    Fwd messages go as frames on the group when the channel can keep a receive posted
    (gloo, mock; a frame carries the header and the group's first part in one message), else
    through our store queue (NCCL). Sends are issued under ``_issue_lock`` in submission
    order; ``push`` issues a group's first frame itself when nothing is queued before it
    (no thread hand-off on the latency path), the sender thread does everything else and
    waits for completions, those of inline frames once the consumer's End arrives or its
    next job comes (nothing wakes it while a frame is on the wire).
    """

    def __init__(self, owner: KVProducer, consumer: dict[str, Any]) -> None:
        self._owner = owner
        self.consumer_id = str(consumer["endpoint_id"])
        self._consumer = consumer
        self.pair = f"{owner.endpoint_id}-{uuid.uuid4().hex[:8]}"
        self.dead = False
        self._jobs: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._issue_lock = threading.Lock()
        self._queued = 0  # submitted jobs not yet issued: push may only go inline at 0
        self._connected = False
        self._frames = False
        self._fwd: MessageQueue | None = None
        self._channel: Channel | None = None
        # (work, slab or None, its pool, record or None, blocks, bytes)
        self._in_flight: deque[tuple[Work, Slab | None, SlabPool | None, Any, int, int]] = deque()
        self._sender = threading.Thread(target=self._send_loop, daemon=True,
                                        name=f"kvx-send-{self.pair}")
        self._acker: threading.Thread | None = None
        self._fwd_key = f"kvx/{self.pair}/fwd"
        self._rev_key = f"kvx/{self.pair}/rev"
        self._closing = threading.Event()
        layout, cfg = owner.layout, owner.config
        lead = int(consumer.get("lead_bytes", cfg.part_bytes))
        self._per_part = max(1, min(cfg.part_bytes, lead) // layout.bytes_per_block)
        part_cap = self._per_part * layout.bytes_per_block
        self._staging = SlabPool(layout, 0, part_cap)
        self._frame_pool = SlabPool(layout, wire.FRAME_HEADER_BYTES, part_cap)
        self._pool = PoolView(owner._store, layout)
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

    # -- issuing (caller's thread or sender thread, under _issue_lock) -------------------------

    def try_inline(self, record: TransferRecord, keep: list[tuple[int, int]]) -> bool:
        """Issue the group's first frame from push() itself when the link is idle."""
        cfg = self._owner.config
        if not self._frames or cfg.checksum or not self._issue_lock.acquire(blocking=False):
            return False
        error: ChannelError | None = None
        try:
            if (not self._connected or self._queued or self._closing.is_set()
                    or len(keep) > wire.MAX_BLOCKS_PER_MESSAGE
                    or len(self._in_flight) >= cfg.max_in_flight_parts):
                return False
            try:
                rest = self._issue_group_head(record, keep)
            except ChannelError as exc:
                error = exc
                return True
            if rest:
                self._queued += 1
                self._jobs.put(("parts", record, rest))
            # else the sender thread reaps the frame's send later (the consumer's End asks
            # for it, any job does it first): no wake-up while the frame is on the wire
            return True
        finally:
            self._issue_lock.release()
            if error is not None:
                self._teardown(FailReason.PEER_LOST, f"sending to the consumer: {error}")

    def _header(self, record: TransferRecord, keep: list[tuple[int, int]],
                parts: list[_Part], crc: list[int] | None) -> wire.Blocks:
        layout = self._owner.layout
        return wire.Blocks(
            req=record.req_id,
            positions=[p for p, _ in keep],
            dst=[record.block_ids[p] for p, _ in keep],
            layers=[0, layout.num_layers],
            dtype=dtype_to_wire(layout.dtype),
            block_shape=list(layout.block_shape),
            parts=[len(blocks) for blocks, _ in parts],
            nbytes=len(keep) * layout.bytes_per_block,
            crc=crc,
            direct=[int(direct) for _, direct in parts],
        )

    def _split(self, record: TransferRecord, keep: list[tuple[int, int]]) -> list[_Part]:
        """Parts in position order: long runs (consecutive sources to consecutive slots) go
        direct, the rest is staged in parts of at most ``_per_part`` blocks."""
        cfg, layout = self._owner.config, self._owner.layout
        slice_bytes = layout.bytes_per_block // (2 * layout.num_layers)
        runs: list[list[tuple[int, int]]] = []
        for pos, src in keep:
            if runs:
                last_pos, last_src = runs[-1][-1]
                if (src == last_src + 1
                        and record.block_ids[pos] == record.block_ids[last_pos] + 1):
                    runs[-1].append((pos, src))
                    continue
            runs.append([(pos, src)])
        parts: list[_Part] = []
        staged: list[tuple[int, int]] = []
        for run in runs:
            if not cfg.checksum and len(run) * slice_bytes >= cfg.direct_min_bytes:
                parts.extend((staged[i:i + self._per_part], False)
                             for i in range(0, len(staged), self._per_part))
                staged = []
                parts.append((run, True))
            else:
                staged.extend(run)
        parts.extend((staged[i:i + self._per_part], False)
                     for i in range(0, len(staged), self._per_part))
        return parts

    def _issue_group_head(self, record: TransferRecord,
                          keep: list[tuple[int, int]]) -> list[_Part]:
        """Frames mode, no checksum: one frame = header + part 0 when it is staged (header
        only when it goes direct). Returns the parts still to send."""
        parts = self._split(record, keep)
        header = self._header(record, keep, parts, None)
        blocks, direct = parts[0]
        nbytes = 0 if direct else len(blocks) * self._owner.layout.bytes_per_block
        frame = self._frame_pool.take(nbytes)
        wire.write_frame_header(header, frame.header)
        if not direct:
            self._stage_into(frame, blocks, record)
        self._issue(frame.message(nbytes), FRAME_TAG, frame, self._frame_pool, record,
                    0 if direct else len(blocks), nbytes)
        self._mark_started(record)
        return parts if direct else parts[1:]

    def _issue(self, tensor: torch.Tensor, tag: int, slab: Slab | None,
               pool: SlabPool | None, record: TransferRecord | None, n: int,
               nbytes: int) -> None:
        if self._channel is None:
            raise ChannelError("send before the pair was set up")
        work = self._channel.send(tensor, tag)
        self._in_flight.append((work, slab, pool, record, n, nbytes))

    def _issue_staged(self, record: TransferRecord, blocks: list[tuple[int, int]]) -> None:
        """A staged part after the header's: a DATA_TAG message the consumer posts a receive
        for once it has read the header."""
        layout = self._owner.layout
        nbytes = len(blocks) * layout.bytes_per_block
        slab = self._staging.take(nbytes)
        self._stage_into(slab, blocks, record)
        self._issue(slab.message(nbytes, layout.dtype), DATA_TAG, slab, self._staging, record,
                    len(blocks), nbytes)

    def _stage_into(self, slab: Slab, part: list[tuple[int, int]],
                    record: TransferRecord) -> bool:
        """Gather the part's source blocks into the slab's payload; False if the transfer
        ended (the bytes are then left as they are: the consumer drops them)."""
        with record.io_lock:  # a terminal record's blocks may already be released
            if record.state.is_terminal:
                return False
            self._pool.gather([s for _, s in part], slab)
        return True

    def _mark_started(self, record: TransferRecord) -> None:
        with self._owner.table.lock:
            if record.state is TransferState.PENDING:
                record.state = TransferState.TRANSFERRING
                record.started = record.started or time.monotonic()

    # -- sender thread --------------------------------------------------------------------------

    def _connect(self) -> None:
        owner, cfg = self._owner, self._owner.config
        backend, server = owner._backend, self._consumer["server"]
        # Every connection of ours to the consumer's server is up before the Hello: the
        # consumer only connects after reading it (simultaneous connects to one TCPStore
        # server were seen to stall one of them for seconds).
        self._fwd = backend.open_queue(owner._server, cfg.connect_timeout_s)
        accept = backend.open_queue(server, cfg.connect_timeout_s)
        rev = backend.open_queue(server, cfg.connect_timeout_s)
        hello = wire.encode(wire.Hello(
            self.pair, owner.endpoint_id, dict(owner._server), owner.location.to_wire(),
            owner.layout.to_wire()))
        channel = backend.open_channel(server, self.pair, 0, owner.layout.device,
                                       owner.location.host, cfg.connect_timeout_s,
                                       on_connected=lambda: accept.push(wire.ACCEPT_KEY, hello))
        accept.close()
        self._acker = threading.Thread(target=self._ack_loop, args=(rev,), daemon=True,
                                       name=f"kvx-ack-{self.pair}")
        self._acker.start()
        if owner.layout.device.type == "cuda":
            torch.cuda.set_device(owner.layout.device)
            self._stream = torch.cuda.Stream(owner.layout.device)
        with self._issue_lock:
            self._channel = channel
            self._frames = channel.can_prepost
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
                    if kind == "reap":
                        while self._in_flight:
                            self._reap_one()
                        continue
                    if kind == "blocks":
                        self._send_group(*job[1:])
                    elif kind == "parts":
                        self._send_parts(job[1], job[2])
                    elif kind == "open":  # even for an ended record: its End must bind too
                        self._send_message(wire.Open(job[1].req_id, job[1].num_total))
                    elif kind == "end":
                        self._send_message(job[2])
                    elif kind == "bye":
                        self._send_message(wire.Bye())
                        while self._in_flight:
                            self._reap_one()
                        return
                    with self._issue_lock:
                        self._queued -= 1
        except ChannelError as exc:
            reason = FailReason.TIMEOUT if exc.timed_out else FailReason.PEER_LOST
            self._teardown(reason, f"sending to the consumer: {exc}")

    def _make_room(self) -> None:
        while len(self._in_flight) >= self._owner.config.max_in_flight_parts:
            self._reap_one()

    def _reap_one(self) -> None:
        with self._issue_lock:
            if not self._in_flight:
                return
            work, slab, pool, record, n, nbytes = self._in_flight.popleft()
        try:
            work.wait(self._owner.config.stall_timeout_s)
        finally:
            if pool is not None and slab is not None:
                with self._issue_lock:
                    pool.give(slab)
        if record is not None and n:
            with self._owner.table.lock:
                if not record.state.is_terminal:
                    record.mark_progress(n, nbytes)

    def _send_message(self, msg: wire.Message) -> None:
        if not self._frames:
            if self._fwd is not None:
                self._fwd.push(self._fwd_key, wire.encode(msg))
            return
        self._make_room()
        with self._issue_lock:
            frame = self._frame_pool.take(0)
            wire.write_frame_header(msg, frame.header)
            self._issue(frame.message(0), FRAME_TAG, frame, self._frame_pool, None, 0, 0)

    def _send_group(self, record: TransferRecord, keep: list[tuple[int, int]], event: Any) -> None:
        if record.state.is_terminal:
            return  # never announced: nothing to keep aligned
        if event is not None:
            event.wait()  # our side stream waits for the compute stream that produced them
        step = wire.MAX_BLOCKS_PER_MESSAGE
        for i in range(0, len(keep), step):
            self._send_message_group(record, keep[i:i + step])

    def _send_message_group(self, record: TransferRecord, keep: list[tuple[int, int]]) -> None:
        cfg, layout = self._owner.config, self._owner.layout
        if not cfg.checksum:
            if self._frames:
                self._make_room()
                with self._issue_lock:
                    rest = self._issue_group_head(record, keep)
                self._send_parts(record, rest)
            else:
                parts = self._split(record, keep)
                self._fwd_push(self._header(record, keep, parts, None))
                self._send_parts(record, parts)
            return
        # Checksums travel in the header, so every part is staged before it is announced.
        parts = self._split(record, keep)  # all staged: no direct parts with checksums
        staged = []
        with self._issue_lock:
            for i, (blocks, _) in enumerate(parts):
                nbytes = len(blocks) * layout.bytes_per_block
                pool = self._frame_pool if (i == 0 and self._frames) else self._staging
                slab = pool.take(nbytes)
                self._stage_into(slab, blocks, record)
                crc = zlib.crc32(slab.payload(nbytes).cpu().numpy().tobytes())
                staged.append((slab, pool, nbytes, crc, len(blocks)))
            header = self._header(record, keep, parts, [s[3] for s in staged])
            if self._frames:
                wire.write_frame_header(header, staged[0][0].header)
        if not self._frames:
            self._fwd_push(header)
        for slab, pool, nbytes, _, n in staged:
            with self._issue_lock:
                if slab.head:  # part 0 in the header's frame
                    tensor, tag = slab.message(nbytes), FRAME_TAG
                else:
                    tensor, tag = slab.message(nbytes, layout.dtype), DATA_TAG
                self._issue(tensor, tag, slab, pool, record, n, nbytes)
        self._mark_started(record)

    def _send_parts(self, record: TransferRecord, parts: list[_Part]) -> None:
        for blocks, direct in parts:
            self._make_room()
            if direct:
                self._send_direct(record, blocks)
                continue
            with self._issue_lock:
                self._issue_staged(record, blocks)
        self._mark_started(record)

    def _send_direct(self, record: TransferRecord, blocks: list[tuple[int, int]]) -> None:
        """One message per (layer, K|V) straight from the pool (a run of source blocks).

        Once announced, the run is sent even if the transfer ended meanwhile (the consumer
        drops it); the pool tensor outlives the send, so this only reads stale values."""
        layout = self._owner.layout
        first, n = blocks[0][1], len(blocks)
        per_slice = n * layout.bytes_per_block // (2 * layout.num_layers)
        with self._issue_lock:
            for piece in run_slices(self._owner._store.kv_tensor(), first, n):
                self._issue(piece, DATA_TAG, None, None, record, 0, 0)
            # progress is counted once, on the last message of the run
            work, slab, pool, _, _, _ = self._in_flight.pop()
            self._in_flight.append((work, slab, pool, record, n, per_slice * 2 * layout.num_layers))

    def _fwd_push(self, msg: wire.Message) -> None:
        if self._fwd is not None:
            self._fwd.push(self._fwd_key, wire.encode(msg))

    # -- ack thread -----------------------------------------------------------------------------

    def _ack_loop(self, rev: MessageQueue) -> None:
        table = self._owner.table
        while True:
            try:
                msg = wire.decode(rev.pop(self._rev_key))
            except ChannelError as exc:
                self._teardown(FailReason.PEER_LOST, f"consumer unreachable: {exc}")
                return
            except wire.ProtocolError as exc:
                self._teardown(FailReason.PROTOCOL, f"bad message from the consumer: {exc}")
                return
            if isinstance(msg, wire.Bye):
                local = self._closing.is_set()
                if not local:  # the consumer leaves: answer, then tear down
                    self._closing.set()
                    self.submit(("bye",))
                self._teardown(FailReason.PEER_LOST, "the consumer closed the pair", local=local)
                return
            if isinstance(msg, wire.End):
                self._jobs.put(("reap",))  # sends that push() issued inline
                record = table.get(msg.req)
                if record is not None and record.link is self:
                    if msg.state is TransferState.DONE:  # may overtake our own completions
                        with table.lock:
                            record.num_bytes = record.num_total * self._owner.layout.bytes_per_block
                    table.finish(record, msg.state, msg.reason, msg.side, msg.detail)

    def _teardown(self, reason: FailReason, detail: str, local: bool | None = None) -> None:
        owner = self._owner
        self.dead = True
        if local is None:
            local = owner._closed or self._closing.is_set()
        for record in owner.table.live():
            if record.link is not self:
                continue
            if local:
                owner.table.finish(record, TransferState.ABORTED, None, Side.PRODUCER, detail)
                continue
            owner.table.finish(record, TransferState.FAILED, reason, Side.CONSUMER, detail)
            if not self._frames and reason is FailReason.TIMEOUT:
                try:  # in frames mode the consumer learns it from the torn-down group
                    self._fwd_push(wire.End(record.req_id, TransferState.FAILED, reason,
                                            Side.CONSUMER, detail))
                except ChannelError:
                    pass
        if not local:
            if self._channel is not None:
                self._channel.close()
            self._jobs.put(("stop",))
        owner._drop_link(self)


_Part = tuple[list[tuple[int, int]], bool]  # ([(position, source block id)], direct)
