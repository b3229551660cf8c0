"""Least privilege on the KV-transfer rendezvous (issue 13 item 8): the store listens only
on the address the endpoint advertises, and a consumer opens a pair only with a producer
that holds one of its tickets (the ticket's secret, proven by an HMAC in the Hello)."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest
import torch

from cluster.testing import wait_until
from kvtransfer import (
    DistBackend,
    KVConsumer,
    KVLayout,
    KVLocation,
    KVProducer,
    MockBackend,
    MockHub,
    Refusal,
    TensorKVStore,
    TransferConfig,
    TransferState,
    auth,
    wire,
)
from kvtransfer.testing import wait_terminal
from scheduler.messages import KVServer

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32,
                  device=torch.device("cpu"))


def _connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_the_store_listens_on_the_advertised_address_only() -> None:
    backend = DistBackend()
    address = backend.listen("127.0.0.1")
    try:
        assert _connects("127.0.0.1", address.port)
        # Another address of this machine (still loopback, so the test stays on it): a
        # server bound to every interface would accept here too (TCPStore's default).
        assert not _connects("127.0.0.2", address.port)
    finally:
        backend.shutdown()


def make_pair(connect_timeout_s: float = 1.0, hub: MockHub | None = None
              ) -> tuple[TensorKVStore, KVConsumer, KVProducer]:
    hub = hub or MockHub()
    cfg = TransferConfig(stall_timeout_s=5.0, start_timeout_s=5.0,
                         connect_timeout_s=connect_timeout_s)
    dst = TensorKVStore(LAYOUT, 16)
    consumer = KVConsumer(dst, location=KVLocation("n0", "cpu"), config=cfg,
                          backend=MockBackend(hub))
    producer = KVProducer(TensorKVStore(LAYOUT, 16, fill="random"),
                          location=KVLocation("n0", "cpu"), config=cfg, backend=MockBackend(hub))
    return dst, consumer, producer


def test_a_producer_without_the_secret_is_refused() -> None:
    _, consumer, producer = make_pair()
    try:
        ticket = consumer.expect("r", [1, 2])
        forged = replace(ticket, secret="guessed")
        producer.begin(forged)
        producer.push("r", [3, 4])
        status = wait_terminal(producer, "r", 20.0)
        assert status.state is TransferState.FAILED
        assert consumer.num_refused_pairs == 1 and consumer.peers() == []
        # Nothing was received into the reservation: it is still waiting for its producer.
        assert consumer.poll("r").state is TransferState.PENDING
    finally:
        producer.close()
        consumer.close()


def test_the_real_ticket_opens_the_pair_and_a_replayed_hello_is_refused() -> None:
    hub = MockHub()
    dst, consumer, producer = make_pair(connect_timeout_s=10.0, hub=hub)
    try:
        ticket = consumer.expect("r", [1, 2])
        producer.begin(ticket)
        producer.push("r", [3, 4])
        assert wait_terminal(consumer, "r", 20.0).state is TransferState.DONE
        assert consumer.num_refused_pairs == 0 and consumer.peers() == [producer.endpoint_id]
        # A Hello seen once (a valid proof for its pair) is refused the second time.
        consumer_at = ticket.consumer
        hello = auth.seal(ticket.secret, wire.ACCEPT_KEY, 0, wire.encode(wire.Hello(
            "p-x-1", "p-x", consumer_at.server, consumer_at.location, consumer_at.layout,
            auth.pair_proof(ticket.secret, "p-x-1", "p-x"))))
        queue = MockBackend(hub).open_queue(consumer_at.server, 5.0)
        queue.push(wire.ACCEPT_KEY, hello)
        queue.push(wire.ACCEPT_KEY, hello)
        assert wait_until(lambda: consumer.num_refused_pairs == 1, 10.0)
        assert consumer.listener_stats().accept[Refusal.REPLAYED] == 1
    finally:
        producer.close()
        consumer.close()


def test_ticket_without_secret_is_refused_by_the_producer() -> None:
    _, consumer, producer = make_pair()
    try:
        ticket = consumer.expect("r", [1])
        with pytest.raises(ValueError, match="secret"):
            producer.begin(replace(ticket, secret=""))
    finally:
        producer.close()
        consumer.close()


def test_proofs_bind_the_pair_and_the_producer() -> None:
    proof = auth.pair_proof("s", "pair-1", "p-1")
    assert auth.is_valid_proof("s", "pair-1", "p-1", proof)
    assert not auth.is_valid_proof("s", "pair-2", "p-1", proof)
    assert not auth.is_valid_proof("s", "pair-1", "p-2", proof)
    assert not auth.is_valid_proof("t", "pair-1", "p-1", proof)
    hello = wire.Hello("pair-1", "p-1", KVServer("127.0.0.1", 1), KVLocation("n0"),
                       LAYOUT.shape(), proof)
    assert wire.decode(wire.encode(hello)) == hello


def test_a_malformed_hello_is_refused_and_later_pairs_still_open() -> None:
    """A Hello whose proof is not ASCII used to raise in ``compare_digest`` and end the
    consumer's accept thread: no pair opened again until a restart (issue 24)."""
    hub = MockHub()
    dst, consumer, producer = make_pair(connect_timeout_s=10.0, hub=hub)
    try:
        ticket = consumer.expect("r", [1, 2])
        at = ticket.consumer
        queue = MockBackend(hub).open_queue(at.server, 5.0)
        for proof in ("\u00e9" * 64, "\U0001f600"):
            queue.push(wire.ACCEPT_KEY, wire.encode(wire.Hello(
                "p-bad-1", "p-bad", at.server, at.location, at.layout, proof)))
        assert wait_until(lambda: consumer.num_refused_pairs == 2, 10.0)
        producer.begin(ticket)
        producer.push("r", [3, 4])
        assert wait_terminal(consumer, "r", 20.0).state is TransferState.DONE
        assert consumer.peers() == [producer.endpoint_id]
    finally:
        producer.close()
        consumer.close()


def test_a_non_ascii_proof_is_invalid_not_an_error() -> None:
    assert not auth.is_valid_proof("s", "pair-1", "p-1", "\u00e9" * 64)
    assert not auth.is_valid_proof("s", "pair-1", "p-1", None)  # type: ignore[arg-type]
    assert auth.is_valid_proof("s", "pair-1", "p-1", auth.pair_proof("s", "pair-1", "p-1"))
