"""The decode side: reserve-then-receive into the reserved slots (straight into a block-major
pool; through staging slabs, scattered into the slots, in a layer-major one).

Life of a transfer here::

    1. expect(req, block_ids, present)  PENDING; the ticket (slots, tag, segment size) goes to
                                        the producer through the control plane
    2. Hello on our accept queue        a producer opens a pair, proving it holds the ticket's
                                        secret (sealed, kvtransfer.auth; anything else is
                                        refused and counted, kvtransfer.guard, and nothing is
                                        opened): its link thread joins the pair's process
                                        group (rank 1, through a sealed store) and reads its
                                        fwd stream
    3. Open(req)                        checked against the reservation (count, block ids,
                                        dtype, shapes, tag, plan) before any receive is posted;
                                        refused: End(FAILED). Posted path: every segment's
                                        receive is posted straight into its slots (layer-
                                        major: a window of them into slabs), Ready
    4. segments land                    in plan order (announced path: after their Blocks);
                                        layer-major: each is scattered from its slab into
                                        the slots once its receive completed. Between them
                                        (and before the first), Keepalive messages say the
                                        producer still computes the blocks to come: the
                                        clock restarts (kvtransfer.transfers, liveness)
    5. every segment landed             DONE, End(DONE) to the producer
    any time: abort(), a stall past the timeout, the producer's End/Bye or death -> terminal
    once no receive is left posted into the slots; from then on nothing is written into
    them (the caller frees them, see __init__). A posted transfer's abort() therefore returns
    at once but its status turns terminal a moment later (the caller polls, as for DONE).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import uuid
from collections.abc import Sequence

from kvtransfer import auth, wire
from kvtransfer.backend import FIRST_DATA_TAG, MAX_DATA_TAG, Backend, ChannelError, MessageQueue
from kvtransfer.consumer_link import ConsumerContext, ConsumerLink
from kvtransfer.dist_backend import DistBackend
from kvtransfer.guard import (
    ListenerStats,
    Refusal,
    RefusalCounts,
    SupervisedThread,
    worth_logging,
)
from kvtransfer.layout import KVLayout, KVStore, check_pool
from kvtransfer.plan import plan_segments, segment_blocks_for
from kvtransfer.state import (
    FailReason,
    KVLocation,
    Side,
    TransferConfig,
    TransferState,
    TransferStats,
    TransferStatus,
)
from kvtransfer.transfers import (
    TransferRecord,
    TransferTable,
    Watchdog,
)
from scheduler.messages import KVEndpoint, KVTicket

log = logging.getLogger(__name__)

ACCEPT_KEY = wire.ACCEPT_KEY


class KVConsumer:
    """Receives KV blocks from any number of producers into reserved slots of ``store``."""

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
        self.endpoint_id = f"c-{uuid.uuid4().hex[:12]}"
        self._server = self._backend.listen(self.location.host)
        # Only producers given one of our tickets may open a pair (kvtransfer.auth).
        self._secret = auth.new_secret()
        self._pairs_seen: set[str] = set()
        self._accept_counts = RefusalCounts()  # the accept queue's refusals
        self._closed_pair_counts = RefusalCounts()  # refusals on pairs torn down since
        # Blocks per segment, one message each (the ticket hands it to the producer).
        self.segment_blocks = segment_blocks_for(self.config.part_bytes, self.layout.bytes_per_block)
        self._tags = itertools.count()
        self._table = TransferTable(Side.CONSUMER)
        self._links: dict[str, ConsumerLink] = {}
        self._links_lock = threading.Lock()
        self._closed = threading.Event()
        self._accept_queue = self._backend.open_queue(self._server, self.config.connect_timeout_s)
        # One connection for every link's acknowledgements (pushes only, so it can be shared;
        # fewer connections to set up per pair).
        self._rev_queue = self._backend.open_queue(self._server, self.config.connect_timeout_s)
        self._rev_lock = threading.Lock()
        self._link_context = ConsumerContext(
            table=self._table, store=store, layout=self.layout, config=self.config,
            segment_blocks=self.segment_blocks, backend=self._backend, server=self._server,
            location=self.location, rev_queue=self._rev_queue, rev_lock=self._rev_lock,
            end=self.end, is_closed=self._closed.is_set, drop_link=self._drop_link,
            secret=self._secret)
        self._accept_thread = SupervisedThread(f"kvx-accept-{self.endpoint_id}",
                                               self._accept_loop, self._is_open)
        self._accept_thread.start()
        self._watchdog = Watchdog(self._table, self.config, self._on_overdue,
                                  on_tick=self._accept_thread.check)

    # -- public API ---------------------------------------------------------------------------

    def address(self) -> KVEndpoint:
        return KVEndpoint(endpoint_id=self.endpoint_id, backend=self._backend.name,
                          server=self._server, location=self.location, layout=self.layout.shape())

    def expect(self, req_id: str, block_ids: Sequence[int],
               present: Sequence[int] = ()) -> KVTicket:
        """Register reserved slots for ``req_id``; returns the ticket for the producer."""
        if self._closed.is_set():
            raise RuntimeError("consumer is closed")
        if not isinstance(req_id, str) or not req_id:
            raise ValueError("req_id must be a non-empty string")
        ids = [int(b) for b in block_ids]
        if not ids or any(b < 0 for b in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"block_ids must be distinct non-negative ints, got {ids!r}")
        hits = frozenset(int(p) for p in present)
        if any(not 0 <= p < len(ids) for p in hits):
            raise ValueError(f"present positions must index block_ids (0..{len(ids) - 1})")
        tag = FIRST_DATA_TAG + next(self._tags) % (MAX_DATA_TAG - FIRST_DATA_TAG + 1)
        record = TransferRecord(req_id, Side.CONSUMER, ids, hits, len(ids) - len(hits), tag=tag,
                                segment_blocks=self.segment_blocks,
                                segments=plan_segments(ids, hits, self.segment_blocks))
        self._table.add(record)
        if record.num_total == 0:
            self._table.finish(record, TransferState.DONE, detail="every block was present")
        return KVTicket(req_id=req_id, block_ids=tuple(ids), present=tuple(sorted(hits)),
                        tag=tag, segment_blocks=self.segment_blocks, consumer=self.address(),
                        secret=self._secret)

    def poll(self, req_id: str) -> TransferStatus | None:
        return self._table.status(req_id)

    def abort(self, req_id: str) -> bool:
        """End the transfer; False if it already ended. Nothing is written into its slots once
        ``poll`` says it ended, which for a posted transfer comes a moment after this returns
        (its receives are released first; the caller frees the slots when it sees the end)."""
        record = self._table.get(req_id)
        if record is None:
            return False
        return self.end(record, TransferState.ABORTED, None, Side.CONSUMER,
                        "aborted by the consumer")

    def end(self, record: TransferRecord, state: TransferState, reason: FailReason | None,
            side: Side | None, detail: str, *, tell_producer: bool = True) -> bool:
        """End ``record`` now, or, while receives of it are posted, once each has had its
        message (the End we send asks the producer to fill those it will not send into with
        an empty one). False: it already ended or is already ending."""
        with record.io_lock:  # a receive being posted (ConsumerLink._post) finishes first
            with self._table.lock:
                if record.state.is_terminal or record.cancel is not None:
                    return False
                posted = record.works is not None
                if posted:
                    record.cancel = (state, reason, side, detail)
                    record.cancel_since = time.monotonic()
            if not posted and not self._table.finish(record, state, reason, side, detail):
                return False
        if tell_producer and record.link is not None:
            record.link.send_end(wire.End(record.req_id, state, reason, side, detail, record.tag))
        return True

    def forget(self, req_id: str) -> TransferStatus | None:
        return self._table.forget(req_id)

    def drain_stats(self) -> list[TransferStats]:
        return self._table.drain_stats()

    def peers(self) -> list[str]:
        """Producer endpoint ids with an open pair group."""
        with self._links_lock:
            return [link.producer_id for link in self._links.values()]

    @property
    def num_refused_pairs(self) -> int:
        """Messages refused on the accept queue (no pair was opened for any of them)."""
        return self._accept_counts.total

    def is_healthy(self) -> bool:
        """False once the accept thread ended for good (it kept failing): no new pair can
        open here, and the worker reports itself unhealthy so that it is replaced."""
        return self._closed.is_set() or self._accept_thread.is_healthy

    def listener_stats(self) -> ListenerStats:
        """Every refusal so far, on the accept queue and on the pairs, and thread health."""
        pairs = RefusalCounts()
        pairs.add(self._closed_pair_counts)
        with self._links_lock:
            links = list(self._links.values())
        for link in links:
            pairs.add(link.counts)
        thread = self._accept_thread
        dead = () if thread.is_alive or self._closed.is_set() else (thread.name,)
        return ListenerStats(accept=self._accept_counts.snapshot(), pairs=pairs.snapshot(),
                             num_thread_restarts=thread.num_restarts, dead_threads=dead,
                             is_healthy=self.is_healthy())

    def close(self) -> None:
        """Abort live transfers, say goodbye to every producer, stop the server."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._watchdog.stop()
        for record in self._table.live():
            self.abort(record.req_id)
        with self._links_lock:
            links = list(self._links.values())
        for link in links:
            link.close(graceful=True)
        try:  # wake the accept thread (its own connection is blocked in pop)
            waker = self._backend.open_queue(self._server, self.config.connect_timeout_s)
            waker.push(ACCEPT_KEY, auth.seal(self._secret, ACCEPT_KEY, 0, wire.encode(wire.Bye())))
            waker.close()
        except ChannelError:
            pass
        self._accept_thread.join(timeout=2)
        for link in links:
            link.join(timeout=2)
            link.abandon()
        self._backend.shutdown()

    # -- internals ----------------------------------------------------------------------------

    @property
    def table(self) -> TransferTable:
        return self._table

    def _is_open(self) -> bool:
        return not self._closed.is_set()

    def _accept_loop(self) -> None:
        """The accept thread's body (a SupervisedThread restarts it if it ends while open):
        one message at a time, each refused or turned into a pair; nothing one message does
        ends it. A broken connection to our own store is opened again, then the loop ends
        and is restarted (counted: a store that keeps failing makes us unhealthy)."""
        while not self._closed.is_set():
            queue = self._accept_queue
            try:
                self._shed_excess(queue)
                raw = queue.pop(ACCEPT_KEY)
            except ChannelError as exc:
                if self._closed.is_set():
                    return
                log.error("kvtransfer consumer %s: accept queue failed: %s; reconnecting",
                          self.endpoint_id, exc)
                self._accept_queue = self._backend.open_queue(self._server,
                                                              self.config.connect_timeout_s)
                return
            try:
                self._accept(raw)
            except Exception:  # a bug in handling one message: that message only
                self._refuse_hello(Refusal.MALFORMED, "handling it failed")
                log.exception("kvtransfer consumer %s: a hello failed; dropped", self.endpoint_id)

    def _shed_excess(self, queue: MessageQueue) -> None:
        """More Hellos waiting than the bound: drop the excess unread (refused, counted)."""
        excess = queue.pending(ACCEPT_KEY) - self.config.max_pending_hellos
        for _ in range(max(0, excess)):
            queue.pop(ACCEPT_KEY)
            self._refuse_hello(Refusal.OVER_BOUND, "the accept queue is over its bound")

    def _refuse_hello(self, refusal: Refusal, detail: str) -> None:
        n = self._accept_counts.count(refusal)
        if worth_logging(n):
            log.warning("kvtransfer consumer %s: refused a message on the accept queue (%s, "
                        "%d so far): %s", self.endpoint_id, refusal.value, n, detail)

    def _accept(self, raw: bytes) -> None:
        """One message of the accept queue: a Hello that proves a ticket opens its pair."""
        try:
            _, payload = auth.unseal(self._secret, ACCEPT_KEY, raw,
                                     max_bytes=wire.MAX_MESSAGE_BYTES)
            msg = wire.decode(payload)
        except auth.AuthError as exc:
            self._refuse_hello(Refusal(exc.kind), str(exc))
            return
        except wire.ProtocolError as exc:
            self._refuse_hello(Refusal.MALFORMED, str(exc))
            return
        if isinstance(msg, wire.Bye) or self._closed.is_set():
            return
        if not isinstance(msg, wire.Hello):
            self._refuse_hello(Refusal.UNEXPECTED, f"a {type(msg).__name__}")
            return
        if msg.pair in self._pairs_seen:
            self._refuse_hello(Refusal.REPLAYED, f"pair {msg.pair[:64]!r} seen before")
            return
        if not auth.is_valid_proof(self._secret, msg.pair, msg.producer_id, msg.proof):
            self._refuse_hello(Refusal.FORGED, f"a wrong proof from {msg.producer_id[:64]!r}")
            return
        self._pairs_seen.add(msg.pair)
        link = ConsumerLink(self._link_context, msg)
        with self._links_lock:
            old = self._links.pop(msg.pair, None)
            self._links[msg.pair] = link
        if old is not None:
            old.close(graceful=False)
        link.start()

    def _drop_link(self, link: ConsumerLink) -> None:
        with self._links_lock:
            if self._links.get(link.pair) is link:
                del self._links[link.pair]
                self._closed_pair_counts.add(link.counts)

    def _on_overdue(self, record: TransferRecord) -> None:
        if record.cancel is not None:  # ending, but the producer did not release it
            if record.link is not None:
                record.link.give_up(f"no release of {record.req_id}'s receives within the "
                                    "stall timeout")
            return
        started = record.state is TransferState.TRANSFERRING
        detail = ("no block (nor a keepalive) arrived within the stall timeout" if started
                  else "the producer did not start (nor send a keepalive) within the start "
                  "timeout")
        self.end(record, TransferState.FAILED, FailReason.TIMEOUT, Side.PRODUCER, detail)
