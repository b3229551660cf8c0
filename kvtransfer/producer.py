"""The prefill side: stream blocks into a consumer's reserved slots as prefill chunks finish.

Life of a transfer here::

    1. begin(ticket)            PENDING; the pair to that consumer is opened lazily (Hello on
                                its accept queue, two-rank process group, rank 0) by the
                                link's sender thread, so begin never blocks
    2. Ready on the rev queue   posted path: the consumer posted a receive per segment
    3. push(req, src_ids)       each finished chunk's blocks; positions present at the
                                consumer are skipped; every segment whose last position is
                                pushed goes as one message (from push itself when the link is
                                idle, else the sender thread) while the next chunk computes
                                (TRANSFERRING): a run of a block-major pool as it is, else its
                                blocks gathered into a staging slab (every segment of a
                                layer-major pool), in the wire layout either way
    4. End(DONE) on rev queue   the consumer wrote every block: DONE (if it never says so,
                                the stall watchdog calls it DONE once every send completed)
    any time: abort(), a stall past the timeout, the consumer's End/Bye or death -> terminal;
    from then on the source blocks are not read again (the caller releases them).

    keepalive(req) between 1 and 3, as often as the caller likes: while a transfer waits
    for blocks not computed yet (its prompt queued, or paused between chunks), the caller
    vouches for it; its clocks here restart and a Keepalive goes to the consumer at most
    every keepalive_interval_s (kvtransfer.transfers says how the timeouts use it). A
    caller that stops vouching and pushing is taken for hung after the timeout.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Sequence

import torch

from kvtransfer import wire
from kvtransfer.backend import Backend
from kvtransfer.dist_backend import DistBackend
from kvtransfer.guard import ListenerStats, RefusalCounts
from kvtransfer.layout import KVLayout, KVStore, check_pool
from kvtransfer.plan import plan_segments
from kvtransfer.producer_link import ProducerContext, ProducerLink
from kvtransfer.state import (
    FailReason,
    KVLocation,
    Side,
    TransferConfig,
    TransferState,
    TransferStats,
    TransferStatus,
)
from kvtransfer.ticket import check_ticket
from kvtransfer.transfers import (
    TransferRecord,
    TransferTable,
    Watchdog,
    keepalive_interval_s,
)
from scheduler.messages import KVEndpoint, KVTicket

log = logging.getLogger(__name__)


class KVProducer:
    """Sends KV blocks of ``store`` to any number of consumers, one pair group each."""

    def __init__(
        self,
        store: KVStore,
        *,
        location: KVLocation | None = None,
        config: TransferConfig | None = None,
        backend: Backend | None = None,
    ) -> None:
        self._store = store
        self.layout = KVLayout.of(store.kv_layout())
        check_pool(store, self.layout)
        self.location = location or KVLocation(socket.gethostname(), str(self.layout.device))
        self.config = config or TransferConfig()
        self._backend = backend or DistBackend()
        self._cuda = self.layout.device.type == "cuda"
        self.endpoint_id = f"p-{uuid.uuid4().hex[:12]}"
        self._server = self._backend.listen(self.location.host)
        self._table = TransferTable(Side.PRODUCER)
        self._links: dict[str, ProducerLink] = {}
        self._links_lock = threading.Lock()
        self._closed_pair_counts = RefusalCounts()  # refusals on pairs torn down since
        self._closed = False
        self._keepalive_s = keepalive_interval_s(self.config)
        self._link_context = ProducerContext(
            endpoint_id=self.endpoint_id, table=self._table, store=store, layout=self.layout,
            config=self.config, backend=self._backend, server=self._server,
            location=self.location, fail_overdue=self.fail_overdue,
            is_closed=lambda: self._closed, drop_link=self._drop_link)
        self._watchdog = Watchdog(self._table, self.config, self._on_overdue)

    # -- public API ---------------------------------------------------------------------------

    def address(self) -> KVEndpoint:
        return KVEndpoint(endpoint_id=self.endpoint_id, backend=self._backend.name,
                          server=self._server, location=self.location, layout=self.layout.shape())

    def begin(self, ticket: KVTicket) -> None:
        """Start a transfer for a consumer's ticket; never blocks (the pair opens lazily).
        The ticket comes from another process: a malformed one is a ValueError
        (``kvtransfer.ticket``)."""
        if self._closed:
            raise RuntimeError("producer is closed")
        ticket = check_ticket(ticket)
        consumer = ticket.consumer
        if consumer.backend != self._backend.name:
            raise ValueError(f"ticket is for a {consumer.backend!r} backend, "
                             f"this producer uses {self._backend.name!r}")
        block_ids, present = list(ticket.block_ids), frozenset(ticket.present)
        record = TransferRecord(ticket.req_id, Side.PRODUCER, block_ids, present,
                                len(block_ids) - len(present), tag=ticket.tag,
                                segment_blocks=ticket.segment_blocks,
                                segments=plan_segments(block_ids, present,
                                                       ticket.segment_blocks),
                                src=[-1] * len(block_ids))
        record.topology = self.location.topology_to(consumer.location)
        record.backend = self._backend.channel_backend_name(self.layout.device)
        self._table.add(record)
        if consumer.layout != self.layout.shape():
            self._table.finish(record, TransferState.FAILED, FailReason.MISMATCH, Side.PRODUCER,
                               f"consumer layout {consumer.layout} differs from "
                               f"{self.layout.shape()}")
            return
        if record.num_total == 0:
            self._table.finish(record, TransferState.DONE, detail="every block was present")
            return
        link = self._link_to(consumer, ticket.secret)
        record.link = link
        link.submit(("open", record))

    def push(self, req_id: str, src_block_ids: Sequence[int], first_position: int | None = None) -> None:
        """Queue blocks for consecutive positions (from ``first_position`` or where the last
        push ended). Returns at once; a gap may only skip positions present at the consumer."""
        record = self._table.get(req_id)
        if record is None:
            raise ValueError(f"no transfer {req_id!r}; call begin(ticket) first")
        src = list(map(int, src_block_ids))
        start = record.cursor if first_position is None else int(first_position)
        if start != record.cursor:
            _check_skip(record, start)
        end = start + len(src)
        if end > len(record.block_ids):
            raise ValueError(f"{end} blocks pushed, the reservation has {len(record.block_ids)}")
        record.src[start:end] = src
        record.cursor = end
        if record.state.is_terminal or record.link is None:
            return  # the caller learns why from poll()
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()  # the blocks are final on the caller's current stream
        record.link.on_pushed(record, event)  # first: the bookkeeping below overlaps the send
        record.last_alive = time.monotonic()
        if record.state is TransferState.PENDING:
            self._table.mark_started(record)

    def keepalive(self, req_id: str) -> bool:
        """The caller still holds the transfer's blocks to come (the prompt is queued, or
        paused between chunks): the stall and start clocks restart here and, at most every
        ``keepalive_interval_s``, at the consumer. Never blocks. False (nothing done): no
        such live transfer, or every block is pushed already (then the sends and the
        consumer's confirmation are what it waits for)."""
        record = self._table.get(req_id)
        if record is None or record.state.is_terminal or record.cursor >= len(record.block_ids):
            return False
        now = time.monotonic()
        record.last_alive = now
        link = record.link
        if link is not None and now - record.keepalive_sent >= self._keepalive_s:
            record.keepalive_sent = now
            link.submit(("keepalive", record))
        return True

    def poll(self, req_id: str) -> TransferStatus | None:
        return self._table.status(req_id)

    def abort(self, req_id: str) -> bool:
        record = self._table.get(req_id)
        if record is None or not self._table.finish(
            record, TransferState.ABORTED, side=Side.PRODUCER, detail="aborted by the producer"
        ):
            return False
        if record.link is not None:
            record.link.submit(("end", record, wire.End(req_id, TransferState.ABORTED,
                                                        side=Side.PRODUCER,
                                                        detail="aborted by the producer",
                                                        tag=record.tag)))
        return True

    def forget(self, req_id: str) -> TransferStatus | None:
        return self._table.forget(req_id)

    def drain_stats(self) -> list[TransferStats]:
        return self._table.drain_stats()

    def peers(self) -> list[str]:
        """Consumer endpoint ids with an open (or opening) pair group."""
        with self._links_lock:
            return list(self._links)

    def listener_stats(self) -> ListenerStats:
        """What this producer's pairs refused (forged acks on the consumer's store, a
        forged rendezvous value). A producer has no accept queue and no thread that a
        bad message can end: a pair whose reader fails is torn down and opened again on
        the next ``begin``."""
        pairs = RefusalCounts()
        pairs.add(self._closed_pair_counts)
        with self._links_lock:
            links = list(self._links.values())
        for link in links:
            pairs.add(link.counts)
        empty = RefusalCounts().snapshot()
        return ListenerStats(accept=empty, pairs=pairs.snapshot(), num_thread_restarts=0,
                             dead_threads=(), is_healthy=True)

    def disconnect(self, consumer_id: str) -> bool:
        """Tear down the pair to one consumer (its live transfers are aborted)."""
        with self._links_lock:
            link = self._links.get(consumer_id)
        if link is None:
            return False
        for record in self._table.live():
            if record.link is link:
                self.abort(record.req_id)
        link.close()
        link.join(timeout=2)
        return True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._watchdog.stop()
        with self._links_lock:
            links = list(self._links)
        for consumer_id in links:
            self.disconnect(consumer_id)
        self._backend.shutdown()

    # -- internals ----------------------------------------------------------------------------

    @property
    def table(self) -> TransferTable:
        return self._table

    def _link_to(self, consumer: KVEndpoint, secret: str) -> ProducerLink:
        with self._links_lock:
            link = self._links.get(consumer.endpoint_id)
            if link is None or link.dead:
                if link is not None:
                    self._closed_pair_counts.add(link.counts)
                link = ProducerLink(self._link_context, consumer, secret)
                self._links[consumer.endpoint_id] = link
                link.start()
            return link

    def _drop_link(self, link: ProducerLink) -> None:
        with self._links_lock:
            if self._links.get(link.consumer_id) is link:
                del self._links[link.consumer_id]
                self._closed_pair_counts.add(link.counts)

    def _on_overdue(self, record: TransferRecord) -> None:
        if record.cursor < len(record.block_ids):
            if record.state is TransferState.PENDING and record.cursor == 0:
                detail = "no block was pushed (nor a keepalive) within the start timeout"
            else:
                detail = "the producer pushed no block (nor a keepalive) within the stall timeout"
            self.fail_overdue(record, Side.PRODUCER, detail)
        elif record.link is not None and not record.confirming:
            # Every block is pushed and the consumer has not confirmed: once every send has
            # completed the blocks have left this pool (DONE), else the consumer is stalled.
            record.confirming = True
            record.link.submit(("confirm", record))
        elif record.link is None:
            self.fail_overdue(record, Side.CONSUMER, "the consumer did not confirm in time")

    def fail_overdue(self, record: TransferRecord, side: Side, detail: str) -> None:
        """A timeout ends the transfer here and tells the consumer."""
        if self._table.finish(record, TransferState.FAILED, FailReason.TIMEOUT, side, detail):
            if record.link is not None:
                record.link.submit(("end", record, wire.End(
                    record.req_id, TransferState.FAILED, FailReason.TIMEOUT, side, detail,
                    record.tag)))


def _check_skip(record: TransferRecord, start: int) -> None:
    if start < record.cursor:
        raise ValueError(f"position {start} was already pushed (next is {record.cursor})")
    if any(p not in record.present for p in range(record.cursor, start)):
        raise ValueError(f"positions {record.cursor}..{start - 1} skipped but not present "
                         "at the consumer")
