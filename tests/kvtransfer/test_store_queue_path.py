"""The announced path with its headers through the store queue (every segment through the
group, its receive posted when its Blocks header is read), which NCCL uses because a posted
receive would occupy its GPU; exercised here over gloo with ``DistBackend(frames=False)`` on
both ends."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvtransfer import (
    DistBackend,
    FailReason,
    KVLocation,
    KVProducer,
    TransferConfig,
    TransferState,
)
from kvtransfer.testing import PeerProcess, make_layout, seeded_store, wait_terminal

torch.set_num_threads(1)

LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
CONFIG = {"stall_timeout_s": 2.0, "start_timeout_s": 15.0, "part_bytes": 2 * BLOCK_BYTES}
SOURCE = seeded_store(make_layout(LAYOUT), 32, seed=11)


@pytest.fixture(scope="module")
def endpoints():
    peer = PeerProcess("consumer", LAYOUT, 32, config=CONFIG, frames=False)
    producer = KVProducer(SOURCE, location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(**CONFIG), backend=DistBackend(frames=False))
    yield peer, producer
    producer.close()
    peer.close()


def received(peer: PeerProcess, ids: list[int]) -> np.ndarray:
    raw = peer.call("read", block_ids=ids)["data"]
    return np.frombuffer(raw, dtype=np.float32).reshape(len(ids), 2, 2, 4, 2, 8)


@pytest.mark.parametrize("checksum", [False, True])
def test_segments_through_store_headers(endpoints, checksum):
    peer, producer = endpoints
    endpoint = producer
    if checksum:
        endpoint = KVProducer(SOURCE, location=KVLocation("node-0", "cpu"),
                              config=TransferConfig(**{**CONFIG, "checksum": True}),
                              backend=DistBackend(frames=False))
    try:
        req = f"q-{checksum}"
        slots = [1, 2, 3, 4, 9, 7, 12] if not checksum else [13, 14, 15, 16, 20, 18, 22]
        ticket = peer.call("expect", req_id=req, block_ids=slots, present=[6])["ticket"]
        endpoint.begin(ticket)
        endpoint.push(req, [20, 21, 23, 22])  # a run from the pool, a reversed pair staged
        endpoint.push(req, [5, 6, 0])
        assert wait_terminal(endpoint, req, 30).state is TransferState.DONE
        np.testing.assert_array_equal(received(peer, slots[:6]),
                                      SOURCE.read_blocks([20, 21, 23, 22, 5, 6]).numpy())
        assert not received(peer, slots[6:]).any()
    finally:
        if endpoint is not producer:
            endpoint.close()


def test_refusal_and_abort_through_store_headers(endpoints):
    peer, producer = endpoints
    ticket = peer.call("expect", req_id="q-bad", block_ids=[25, 26])["ticket"]
    forged = replace(ticket, block_ids=(ticket.block_ids[0], 27))
    producer.begin(forged)
    producer.push("q-bad", [1, 2])
    status = wait_terminal(producer, "q-bad", 30)
    assert (status.state, status.reason) == (TransferState.FAILED, FailReason.MISMATCH)
    assert not received(peer, [25, 26, 27]).any()
    ticket = peer.call("expect", req_id="q-abort", block_ids=[28, 29])["ticket"]
    producer.begin(ticket)
    assert peer.call("abort", req_id="q-abort")["aborted"]
    assert wait_terminal(producer, "q-abort", 30).state is TransferState.ABORTED
    # the pair still works afterwards
    ticket = peer.call("expect", req_id="q-after", block_ids=[30, 31])["ticket"]
    producer.begin(ticket)
    producer.push("q-after", [3, 4])
    assert wait_terminal(producer, "q-after", 30).state is TransferState.DONE


def test_keepalives_through_the_store_queue_keep_a_paused_transfer(endpoints):
    """The Keepalive messages of a transfer paused between segments travel the store queue
    like its headers: past the stall timeout it is alive on both ends, then completes."""
    peer, producer = endpoints
    ticket = peer.call("expect", req_id="q-kept", block_ids=[5, 6, 7, 8])["ticket"]
    producer.begin(ticket)
    producer.push("q-kept", [10, 11])
    deadline = time.monotonic() + 30
    while peer.call("poll", req_id="q-kept")["status"]["done"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    end = time.monotonic() + 2.5 * CONFIG["stall_timeout_s"]  # the pause: a loop's turns
    while time.monotonic() < end:
        assert producer.keepalive("q-kept")
        time.sleep(0.05)
    assert peer.call("poll", req_id="q-kept")["status"]["state"] == "transferring"
    producer.push("q-kept", [12, 13])
    assert wait_terminal(producer, "q-kept", 30).state is TransferState.DONE
    np.testing.assert_array_equal(received(peer, [5, 6, 7, 8]),
                                  SOURCE.read_blocks([10, 11, 12, 13]).numpy())
