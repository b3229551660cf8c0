"""The KV listener under attack (issue 24 item 2): a real consumer and producer over gloo on
real TCPStores, and an attacker that reaches the stores' ports and nothing else (it lists
keys, pushes, overwrites; it holds no secret). Every malformed message is refused and
counted on its connection, no thread dies, and a genuine pairing and a real block transfer
still work afterwards."""

from __future__ import annotations

import datetime
import random
from collections import Counter

import numpy as np
import torch
import torch.distributed as dist

from cluster.testing import wait_until
from kvtransfer import (
    DistBackend,
    KVConsumer,
    KVLocation,
    KVProducer,
    Refusal,
    TensorKVStore,
    TransferConfig,
    TransferState,
    auth,
    wire,
)
from kvtransfer.testing import make_layout, seeded_store, wait_terminal
from scheduler.messages import KVTicket

torch.set_num_threads(1)

HOST = "127.0.0.1"
LAYOUT = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 4, "block_size": 2, "dtype": "float32"}
CONFIG = {"stall_timeout_s": 10.0, "start_timeout_s": 300.0, "connect_timeout_s": 5.0}
SOURCE = seeded_store(make_layout(LAYOUT), 32, seed=5)
WAIT = 60.0


def make_consumer(frames: bool | None = None, **config) -> tuple[KVConsumer, TensorKVStore]:
    dst = seeded_store(make_layout(LAYOUT), 32, seed=None)
    consumer = KVConsumer(dst, location=KVLocation(HOST, "cpu"),
                          config=TransferConfig(**{**CONFIG, **config}),
                          backend=DistBackend(frames=frames))
    return consumer, dst


def make_producer(frames: bool | None = None) -> KVProducer:
    return KVProducer(SOURCE, location=KVLocation(HOST, "cpu"), config=TransferConfig(**CONFIG),
                      backend=DistBackend(frames=frames))


def attacker(ticket: KVTicket) -> dist.TCPStore:
    """A client of the consumer's store, as anyone who reaches its port can open."""
    server = ticket.consumer.server
    return dist.TCPStore(server.host, server.port, is_master=False,
                         timeout=datetime.timedelta(seconds=10))


def landed(dst: TensorKVStore, slots: list[int], src: list[int]) -> None:
    np.testing.assert_array_equal(dst.read_blocks(slots).numpy(), SOURCE.read_blocks(src).numpy())


def transfer(consumer: KVConsumer, dst: TensorKVStore, producer: KVProducer, req: str,
             slots: list[int], src: list[int]) -> None:
    """One real transfer, checked block by block."""
    ticket = consumer.expect(req, slots)
    producer.begin(ticket)
    producer.push(req, src)
    assert wait_terminal(producer, req, WAIT).state is TransferState.DONE
    assert wait_terminal(consumer, req, WAIT).state is TransferState.DONE
    landed(dst, slots, src)


def live_pairs(store: dist.TCPStore) -> set[str]:
    """Pair names, as an attacker learns them: the group rendezvous keys are listed."""
    return {key.split("/")[2] for key in store.list_keys() if key.startswith("kvx/pg/")}


def hello(ticket: KVTicket, pair: str, proof: str) -> bytes:
    at = ticket.consumer
    return wire.encode(wire.Hello(pair, "p-fuzz", at.server, at.location, at.layout, proof))


def fuzz_messages(ticket: KVTicket, good_hello: bytes, count: int, seed: int
                  ) -> tuple[list[bytes], Counter[Refusal]]:
    """``count`` messages no consumer may act on, of every kind an attacker can make (and a
    buggy producer: sealed junk), and how each must be refused."""
    rng = random.Random(seed)
    secret = ticket.secret
    out: list[bytes] = []
    want: Counter[Refusal] = Counter()
    while len(out) < count:
        kind = len(out) % 10
        pair = f"p-fuzz-{len(out)}"
        sealed = auth.seal(secret, wire.ACCEPT_KEY, 0,
                           hello(ticket, pair, auth.pair_proof(secret, pair, "p-fuzz")))
        if kind == 0:  # random bytes
            out.append(rng.randbytes(rng.randrange(0, 600)))
        elif kind == 1:  # a truncated frame
            out.append(sealed[:rng.randrange(0, len(sealed))])
        elif kind == 2:  # one bit flipped
            flip = rng.randrange(len(sealed))
            out.append(sealed[:flip] + bytes([sealed[flip] ^ 1 << rng.randrange(8)])
                       + sealed[flip + 1:])
        elif kind == 3:  # sealed with a guessed secret
            out.append(auth.seal("guessed", wire.ACCEPT_KEY, 0,
                                 hello(ticket, pair, auth.pair_proof("guessed", pair, "p-fuzz"))))
        elif kind == 4:  # the old, unsealed Hello with a wrong proof
            out.append(hello(ticket, pair, rng.randbytes(32).hex()))
        elif kind == 5:  # non-ASCII everywhere
            out.append(hello(ticket, "p-\u00e9\U0001f600", "\u00e9" * 64))
        elif kind == 6:  # a replay of a good Hello already seen
            out.append(good_hello)
        elif kind == 7:  # a valid seal moved from another queue
            out.append(auth.seal(secret, f"kvx/{pair}/rev", 1, wire.encode(wire.Bye())))
        elif kind == 8:  # sealed right (a producer's bug): junk, or not a Hello
            body = (rng.randbytes(40) if len(out) % 20 == 8
                    else wire.encode(wire.Ready("r", 16)))
            out.append(auth.seal(secret, wire.ACCEPT_KEY, 0, body))
            want[Refusal.MALFORMED if len(out) % 20 == 9 else Refusal.UNEXPECTED] += 1
            continue
        else:  # oversize (rarely: each is 2 MiB)
            big = len(out) % 1000 == 9
            out.append(rng.randbytes(2 << 20) if big else b"\x00" * 11)
            want[Refusal.OVERSIZE if big else Refusal.FORGED] += 1
            continue
        want[Refusal.REPLAYED if kind == 6 else Refusal.FORGED] += 1
    return out, want


def refused_on_rev(pair: str, count: int, seed: int, ticket: KVTicket) -> list[bytes]:
    """Messages for a live pair's rev queue (the producer reads it): forged acks, every
    fourth a replay of a sequence number already seen."""
    rng = random.Random(seed)
    key = f"kvx/{pair}/rev"
    forged_done = wire.encode(wire.End(ticket.req_id, TransferState.DONE, tag=ticket.tag))
    out: list[bytes] = []
    while len(out) < count:
        kind = len(out) % 4
        if kind == 0:
            out.append(forged_done)  # what the old code took for the consumer's word
        elif kind == 1:
            out.append(rng.randbytes(rng.randrange(1, 300)))
        elif kind == 2:
            out.append(auth.seal("guessed", key, 10**9 + len(out), forged_done))
        else:  # a sequence number the producer has already seen: a replay
            out.append(auth.seal(ticket.secret, key, 1, forged_done))
    return out


def run_fuzz(num_accept: int, num_rev: int) -> None:
    # No shedding here, so that each message's refusal is known (the bound: its own test).
    consumer, dst = make_consumer(max_pending_hellos=1 << 20)
    producer = make_producer()
    try:
        transfer(consumer, dst, producer, "warm", [1, 2, 3], [4, 5, 6])
        warm = consumer.expect("held", [20])  # a transfer the forged acks name
        producer.begin(warm)
        store = attacker(warm)
        (pair,) = live_pairs(store)
        # A good Hello, seen once: it opens a pair (which finds no producer and fails),
        # then every replay of it is refused.
        good = auth.seal(warm.secret, wire.ACCEPT_KEY, 0,
                         hello(warm, "p-fuzz-good", auth.pair_proof(warm.secret, "p-fuzz-good",
                                                                    "p-fuzz")))
        store.queue_push(wire.ACCEPT_KEY, good)
        messages, want = fuzz_messages(warm, good, num_accept, seed=1)
        for msg in messages:
            store.queue_push(wire.ACCEPT_KEY, msg)
        for msg in refused_on_rev(pair, num_rev, seed=2, ticket=warm):
            store.queue_push(f"kvx/{pair}/rev", msg)
        store.set(f"kvx/pg/{pair}/0/0", b"overwritten after the group was built")

        assert wait_until(lambda: consumer.listener_stats().num_refused >= num_accept, WAIT)
        assert wait_until(
            lambda: sum(producer.listener_stats().pairs.values()) >= num_rev, WAIT)
        stats = consumer.listener_stats()
        assert {k: n for k, n in stats.accept.items() if n} == dict(want)  # each, once
        assert stats.dead_threads == () and stats.num_thread_restarts == 0 and stats.is_healthy
        acks = producer.listener_stats().pairs
        assert acks[Refusal.REPLAYED] == num_rev // 4
        assert acks[Refusal.FORGED] == num_rev - num_rev // 4
        # The forged End(DONE)s were not taken for the consumer's word.
        assert producer.poll("held").state is TransferState.PENDING
        assert producer.endpoint_id in consumer.peers()

        producer.push("held", [7])
        assert wait_terminal(consumer, "held", WAIT).state is TransferState.DONE
        landed(dst, [20], [7])
        transfer(consumer, dst, producer, "after", [8, 9], [10, 11])  # the same pair
        fresh = make_producer()
        try:  # a new pairing, through the store the attacker wrote into
            transfer(consumer, dst, fresh, "fresh", [12, 13], [14, 15])
        finally:
            fresh.close()
        assert consumer.listener_stats().dead_threads == ()
    finally:
        producer.close()
        consumer.close()


def test_listener_survives_ten_thousand_malformed_messages() -> None:
    """About 5 s on the 2-core development VM: not marked slow."""
    run_fuzz(num_accept=10_000, num_rev=1_000)


def test_a_forged_done_on_the_rev_queue_is_not_taken() -> None:
    """The old code took any End(DONE) popped from the consumer's store as the consumer's
    word: the producer finished a transfer whose blocks never left."""
    (consumer, dst), producer = make_consumer(), make_producer()
    try:
        transfer(consumer, dst, producer, "warm", [1], [2])
        ticket = consumer.expect("r", [3, 4])
        producer.begin(ticket)
        store = attacker(ticket)
        (pair,) = live_pairs(store)
        store.queue_push(f"kvx/{pair}/rev", wire.encode(
            wire.End("r", TransferState.DONE, tag=ticket.tag)))
        assert wait_until(lambda: producer.listener_stats().pairs[Refusal.FORGED] == 1, WAIT)
        assert producer.poll("r").state is TransferState.PENDING
        producer.push("r", [5, 6])
        assert wait_terminal(consumer, "r", WAIT).state is TransferState.DONE
        landed(dst, [3, 4], [5, 6])
    finally:
        producer.close()
        consumer.close()


def test_junk_on_the_store_fwd_queue_leaves_the_pair_up() -> None:
    """The store-queue path (NCCL's): the fwd queue lives on the producer's store, open to
    anyone. The old code tore the pair down on the first message it could not decode."""
    consumer, dst = make_consumer(frames=False)
    producer = make_producer(frames=False)
    try:
        transfer(consumer, dst, producer, "warm", [1], [2])
        ticket = consumer.expect("r", [3, 4])
        (pair,) = live_pairs(attacker(ticket))
        at = producer.address().server
        theirs = dist.TCPStore(at.host, at.port, is_master=False,
                               timeout=datetime.timedelta(seconds=10))
        key = f"kvx/{pair}/fwd"
        junk = [b"\x00", b"kvx1" + b"\x00" * 60, wire.encode(wire.Bye()),
                auth.seal(ticket.secret, key, 1, wire.encode(wire.Bye()))]  # a replayed Bye
        for msg in junk:
            theirs.queue_push(key, msg)
        assert wait_until(lambda: consumer.listener_stats().pairs[Refusal.FORGED] == 3, WAIT)
        assert wait_until(lambda: consumer.listener_stats().pairs[Refusal.REPLAYED] == 1, WAIT)
        assert consumer.peers() == [producer.endpoint_id]
        producer.begin(ticket)
        producer.push("r", [5, 6])
        assert wait_terminal(consumer, "r", WAIT).state is TransferState.DONE
        landed(dst, [3, 4], [5, 6])
    finally:
        producer.close()
        consumer.close()


def test_a_flood_of_hellos_is_shed_past_the_bound() -> None:
    """More Hellos waiting than ``max_pending_hellos``: the excess is dropped unread."""
    consumer, _ = make_consumer(max_pending_hellos=2)
    try:
        ticket = consumer.expect("r", [1])
        clients = [attacker(ticket) for _ in range(4)]
        for i in range(2_000):
            clients[i % 4].queue_push(wire.ACCEPT_KEY, b"\x00" * 8)
        assert wait_until(lambda: consumer.num_refused_pairs == 2_000, WAIT)
        stats = consumer.listener_stats()
        assert stats.accept[Refusal.OVER_BOUND] > 0
        assert stats.accept[Refusal.OVER_BOUND] + stats.accept[Refusal.FORGED] == 2_000
        producer = make_producer()
        try:
            producer.begin(ticket)
            producer.push("r", [2])
            assert wait_terminal(consumer, "r", WAIT).state is TransferState.DONE
        finally:
            producer.close()
    finally:
        consumer.close()
