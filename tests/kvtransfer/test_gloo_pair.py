"""Two real processes over a gloo pair group: streaming, refusals, abort, stalls, peer death.

The consumer (decode side) lives in a spawned process (kvtransfer.testing.PeerProcess); the
producer runs here, so the test drives prefill-side calls directly and the consumer through
msgpack commands.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvtransfer import (
    DistBackend,
    FailReason,
    KVConsumer,
    KVLocation,
    KVProducer,
    Side,
    TopologyClass,
    TransferConfig,
    TransferState,
)
from kvtransfer.testing import PeerProcess, make_layout, seeded_store, wait_terminal

torch.set_num_threads(1)

LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
CONFIG = {"stall_timeout_s": 2.5, "start_timeout_s": 15.0, "connect_timeout_s": 20.0,
          "part_bytes": 2 * BLOCK_BYTES, "checksum": True}
WAIT = 30.0


@pytest.fixture(scope="module")
def consumer_peer():
    peer = PeerProcess("consumer", LAYOUT, 64, config=CONFIG)
    yield peer
    peer.close()


SOURCE = seeded_store(make_layout(LAYOUT), 64, seed=7)


@pytest.fixture(scope="module")
def producer():
    endpoint = KVProducer(SOURCE, location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(**{**CONFIG, "checksum": False}),
                          backend=DistBackend())
    yield endpoint
    endpoint.close()


def src_blocks(producer: KVProducer, ids: list[int]) -> np.ndarray:
    return SOURCE.read_blocks(ids).float().numpy()


def dst_blocks(peer: PeerProcess, ids: list[int]) -> np.ndarray:
    raw = peer.call("read", block_ids=ids)["data"]
    return np.frombuffer(raw, dtype=np.float32).reshape(len(ids), 2, 2, 4, 2, 8)


def peer_wait(peer: PeerProcess, req_id: str) -> dict:
    return peer.call("wait", req_id=req_id, wait_s=WAIT, timeout_s=WAIT + 30)["status"]


def test_stream_in_chunks_skips_prefix_hits(consumer_peer, producer):
    ticket = consumer_peer.call("expect", req_id="r-stream", block_ids=[10, 11, 12, 13, 14, 15],
                                present=[0, 1])["ticket"]
    producer.begin(ticket)
    producer.push("r-stream", [40, 41, 42])  # one chunk finished: positions 0..2
    producer.push("r-stream", [43, 44, 45])  # the next chunk: positions 3..5
    status = wait_terminal(producer, "r-stream", WAIT)
    assert status.state is TransferState.DONE
    assert peer_wait(consumer_peer, "r-stream")["state"] == "done"
    np.testing.assert_array_equal(dst_blocks(consumer_peer, [12, 13, 14, 15]),
                                  src_blocks(producer, [42, 43, 44, 45]))
    assert not dst_blocks(consumer_peer, [10, 11]).any()  # prefix hits were not sent
    stats = [s for s in producer.drain_stats() if s.req_id == "r-stream"]
    assert len(stats) == 1
    assert (stats[0].num_blocks, stats[0].num_skipped_blocks) == (4, 2)
    assert stats[0].num_bytes == 4 * BLOCK_BYTES
    # two CPU pools on one node, no NVLink domain given: the scheduler's class for them
    assert stats[0].topology is TopologyClass.SAME_NODE and stats[0].backend == "gloo"
    remote = [s for s in consumer_peer.call("stats")["stats"] if s["req_id"] == "r-stream"]
    assert remote[0]["state"] == "done" and remote[0]["num_bytes"] == 4 * BLOCK_BYTES


def test_unknown_request_is_refused(consumer_peer, producer):
    ticket = consumer_peer.call("expect", req_id="r-real", block_ids=[20, 21])["ticket"]
    forged = replace(ticket, req_id="r-ghost")
    producer.begin(forged)
    producer.push("r-ghost", [1, 2])
    status = wait_terminal(producer, "r-ghost", WAIT)
    assert (status.state, status.reason, status.failed_side) == (
        TransferState.FAILED, FailReason.UNKNOWN_REQUEST, Side.CONSUMER)
    assert consumer_peer.call("abort", req_id="r-real")["aborted"]
    assert not dst_blocks(consumer_peer, [20, 21]).any()


def test_block_ids_not_matching_the_reservation_are_refused_before_any_write(consumer_peer, producer):
    ticket = consumer_peer.call("expect", req_id="r-ids", block_ids=[22, 23, 24])["ticket"]
    # a slot the consumer did not reserve for this request
    forged = replace(ticket, block_ids=(*ticket.block_ids[:2], 30))
    producer.begin(forged)
    producer.push("r-ids", [1, 2, 3])
    status = wait_terminal(producer, "r-ids", WAIT)
    assert (status.state, status.reason, status.failed_side) == (
        TransferState.FAILED, FailReason.MISMATCH, Side.PRODUCER)
    remote = peer_wait(consumer_peer, "r-ids")
    assert (remote["state"], remote["reason"]) == ("failed", "mismatch")
    assert not dst_blocks(consumer_peer, [22, 23, 24, 30]).any()


def test_block_count_not_matching_the_reservation_is_refused(consumer_peer, producer):
    ticket = consumer_peer.call("expect", req_id="r-count", block_ids=[25, 26])["ticket"]
    forged = replace(ticket, block_ids=(*ticket.block_ids, 27))
    producer.begin(forged)
    producer.push("r-count", [1, 2, 3])
    status = wait_terminal(producer, "r-count", WAIT)
    assert (status.state, status.reason) == (TransferState.FAILED, FailReason.MISMATCH)
    assert peer_wait(consumer_peer, "r-count")["reason"] == "mismatch"
    assert not dst_blocks(consumer_peer, [25, 26, 27]).any()


def test_checksummed_transfer_arrives_intact(consumer_peer, producer):
    checked = KVProducer(SOURCE, location=KVLocation("node-0", "cpu"),
                         config=TransferConfig(**CONFIG), backend=DistBackend())
    try:
        ticket = consumer_peer.call("expect", req_id="r-crc", block_ids=[47, 48, 49])["ticket"]
        checked.begin(ticket)
        checked.push("r-crc", [9, 10, 11])
        assert wait_terminal(checked, "r-crc", WAIT).state is TransferState.DONE
        np.testing.assert_array_equal(dst_blocks(consumer_peer, [47, 48, 49]),
                                      src_blocks(producer, [9, 10, 11]))
    finally:
        checked.close()


def test_runs_go_pool_to_pool_and_scattered_sources_are_staged(consumer_peer, producer):
    slots = [50, 51, 52, 53, 60, 58]  # segments [50, 51] [52, 53] [60] [58]
    ticket = consumer_peer.call("expect", req_id="r-runs", block_ids=slots)["ticket"]
    producer.begin(ticket)
    producer.push("r-runs", [30, 31, 33, 32, 12, 14])  # a run, a reversed pair, singles
    assert wait_terminal(producer, "r-runs", WAIT).state is TransferState.DONE
    assert peer_wait(consumer_peer, "r-runs")["state"] == "done"
    np.testing.assert_array_equal(dst_blocks(consumer_peer, slots),
                                  src_blocks(producer, [30, 31, 33, 32, 12, 14]))


def test_dtype_not_matching_the_reservation_is_refused(consumer_peer):
    layout = make_layout({**LAYOUT, "dtype": "bfloat16"})
    bf16 = KVProducer(seeded_store(layout, 8, seed=3), location=KVLocation("node-0", "cpu"),
                      config=TransferConfig(**CONFIG), backend=DistBackend())
    try:
        ticket = consumer_peer.call("expect", req_id="r-dtype", block_ids=[28, 29])["ticket"]
        # a stale ticket from another pool
        lying = replace(ticket, consumer=replace(
            ticket.consumer, layout=replace(ticket.consumer.layout, dtype="bfloat16")))
        bf16.begin(lying)
        bf16.push("r-dtype", [0, 1])
        status = wait_terminal(bf16, "r-dtype", WAIT)
        assert (status.state, status.reason) == (TransferState.FAILED, FailReason.MISMATCH), status
        assert "dtype" in status.detail
        assert peer_wait(consumer_peer, "r-dtype")["reason"] == "mismatch"
        assert not dst_blocks(consumer_peer, [28, 29]).any()
    finally:
        bf16.close()


def test_consumer_abort_reaches_the_producer(consumer_peer, producer):
    ticket = consumer_peer.call("expect", req_id="r-abort", block_ids=[32, 33, 34, 35])["ticket"]
    producer.begin(ticket)
    producer.push("r-abort", [1, 2])
    assert consumer_peer.call("abort", req_id="r-abort")["aborted"]
    status = wait_terminal(producer, "r-abort", WAIT)
    assert (status.state, status.failed_side) == (TransferState.ABORTED, Side.CONSUMER)
    producer.push("r-abort", [3, 4])  # the prefill side may still finish: ignored, no error
    assert peer_wait(consumer_peer, "r-abort")["state"] == "aborted"
    assert not dst_blocks(consumer_peer, [34, 35]).any()


def test_producer_abort_reaches_the_consumer(consumer_peer, producer):
    ticket = consumer_peer.call("expect", req_id="r-pabort", block_ids=[36, 37])["ticket"]
    producer.begin(ticket)
    assert producer.abort("r-pabort")
    remote = peer_wait(consumer_peer, "r-pabort")
    assert (remote["state"], remote["side"]) == ("aborted", "producer")
    assert not dst_blocks(consumer_peer, [36, 37]).any()


def test_stalled_producer_fails_on_both_sides(consumer_peer, producer):
    ticket = consumer_peer.call("expect", req_id="r-stall", block_ids=[38, 39, 40])["ticket"]
    producer.begin(ticket)
    producer.push("r-stall", [5, 6])  # the first segment, then the prefill never finishes
    remote = peer_wait(consumer_peer, "r-stall")
    assert (remote["state"], remote["reason"], remote["side"]) == ("failed", "timeout", "producer")
    status = wait_terminal(producer, "r-stall", WAIT)
    assert (status.state, status.reason, status.failed_side) == (
        TransferState.FAILED, FailReason.TIMEOUT, Side.PRODUCER)


def test_frozen_consumer_both_sides_agree_then_the_next_transfer_works(consumer_peer, producer):
    """A consumer stopped mid-transfer: the producer ends within its timeouts (DONE when its
    sends completed into the socket buffers, FAILED when the consumer never took them), and
    the consumer, once it runs again, ends the same way."""
    ticket = consumer_peer.call("expect", req_id="r-frozen", block_ids=[41, 42, 43, 44])["ticket"]
    producer.begin(ticket)
    consumer_peer.freeze()
    try:
        producer.push("r-frozen", [1, 2, 3, 4])
        status = wait_terminal(producer, "r-frozen", WAIT)
    finally:
        consumer_peer.thaw()
    assert status.state.is_terminal
    remote = peer_wait(consumer_peer, "r-frozen")
    assert remote["state"] == status.state.value
    if status.state is TransferState.DONE:
        np.testing.assert_array_equal(dst_blocks(consumer_peer, [41, 42, 43, 44]),
                                      src_blocks(producer, [1, 2, 3, 4]))
    ticket = consumer_peer.call("expect", req_id="r-after", block_ids=[45, 46])["ticket"]
    producer.begin(ticket)
    producer.push("r-after", [6, 7])
    assert wait_terminal(producer, "r-after", WAIT).state is TransferState.DONE
    np.testing.assert_array_equal(dst_blocks(consumer_peer, [45, 46]), src_blocks(producer, [6, 7]))


# Short clocks for the liveness tests: the pauses below last several times each of them.
KEEP = {**CONFIG, "stall_timeout_s": 1.0, "start_timeout_s": 1.0, "checksum": False}


def _vouch(keep, seconds: float) -> None:
    """A prefill worker's loop while the policy holds the prompt back: ``keep()`` (a
    keepalive) every turn, about 50 ms, for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert keep()
        time.sleep(0.05)


def test_a_paused_transfer_kept_alive_outlives_both_timeouts_and_completes():
    """Queued past the start timeout, then paused between segments past the stall timeout:
    the producer's caller vouches for it every turn, the Keepalive messages cross the pair,
    and neither side calls it stalled; it then completes byte for byte."""
    peer = PeerProcess("consumer", LAYOUT, 16, config=KEEP)
    producer = KVProducer(SOURCE, location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(**KEEP), backend=DistBackend())
    try:
        ticket = peer.call("expect", req_id="r-kept", block_ids=[1, 2, 3, 4])["ticket"]
        producer.begin(ticket)
        _vouch(lambda: producer.keepalive("r-kept"), 3.0)
        assert peer.call("poll", req_id="r-kept")["status"]["state"] == "pending"
        producer.push("r-kept", [20, 21])  # the first segment
        assert _wait_done_blocks(peer, "r-kept", 2)
        _vouch(lambda: producer.keepalive("r-kept"), 3.0)
        assert peer.call("poll", req_id="r-kept")["status"]["state"] == "transferring"
        producer.push("r-kept", [22, 23])
        assert wait_terminal(producer, "r-kept", WAIT).state is TransferState.DONE
        assert peer_wait(peer, "r-kept")["state"] == "done"
        np.testing.assert_array_equal(dst_blocks(peer, [1, 2, 3, 4]),
                                      src_blocks(producer, [20, 21, 22, 23]))
    finally:
        producer.close()
        peer.close()


def test_a_frozen_producer_is_still_found_stalled_while_its_transfer_is_paused():
    """Keepalives come from the producer's process: once it stops (SIGSTOP), none reaches
    the consumer and the paused transfer fails there on its stall timeout."""
    layout = make_layout(LAYOUT)
    consumer = KVConsumer(seeded_store(layout, 16, seed=None), location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(**KEEP), backend=DistBackend())
    peer = PeerProcess("producer", LAYOUT, 16, seed=2, config=KEEP)
    try:
        ticket = consumer.expect("r-hung", [1, 2, 3, 4])
        peer.call("begin", ticket=ticket)
        peer.call("push", req_id="r-hung", block_ids=[5, 6])
        assert _wait_local_done_blocks(consumer, "r-hung", 2).num_blocks_done == 2
        _vouch(lambda: peer.call("keepalive", req_id="r-hung")["alive"], 2.0)
        assert consumer.poll("r-hung").state is TransferState.TRANSFERRING
        peer.freeze()
        try:
            status = wait_terminal(consumer, "r-hung", WAIT)
        finally:
            peer.thaw()
        assert (status.state, status.reason, status.failed_side) == (
            TransferState.FAILED, FailReason.TIMEOUT, Side.PRODUCER), status
    finally:
        consumer.close()
        peer.kill()


BIG = {"num_layers": 4, "num_kv_heads": 8, "head_dim": 128, "block_size": 16,
       "dtype": "float32"}  # 512 KiB blocks: 48 of them outgrow any socket buffer


def test_frozen_consumer_that_cannot_take_the_blocks_fails_both_sides_and_the_pair():
    peer = PeerProcess("consumer", BIG, 50, config=CONFIG)
    producer = KVProducer(seeded_store(make_layout(BIG), 50, seed=4),
                          location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(**{**CONFIG, "checksum": False}),
                          backend=DistBackend())
    try:
        ticket = peer.call("expect", req_id="r-big", block_ids=list(range(1, 49)))["ticket"]
        producer.begin(ticket)
        time.sleep(1.0)  # Open, Ready
        peer.freeze()
        try:
            producer.push("r-big", list(range(1, 49)))
            status = wait_terminal(producer, "r-big", WAIT)
        finally:
            peer.thaw()
        assert (status.state, status.reason, status.failed_side) == (
            TransferState.FAILED, FailReason.TIMEOUT, Side.CONSUMER)
        assert peer_wait(peer, "r-big")["state"] == "failed"
        assert producer.peers() == []  # the pair was torn down
    finally:
        producer.close()
        peer.close()


def test_a_cancel_the_producer_never_releases_closes_the_pair():
    """The consumer aborts while the producer process is stopped: the posted receive waits
    for the producer's release, then, past the stall timeout, the pair is closed."""
    layout = make_layout(LAYOUT)
    consumer = KVConsumer(seeded_store(layout, 16, seed=None), location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(**CONFIG), backend=DistBackend())
    peer = PeerProcess("producer", LAYOUT, 16, seed=2, config={**CONFIG, "checksum": False})
    try:
        ticket = consumer.expect("r-hold", [1, 2, 3, 4])
        peer.call("begin", ticket=ticket)
        peer.call("push", req_id="r-hold", block_ids=[5, 6])
        assert _wait_local_done_blocks(consumer, "r-hold", 2).num_blocks_done == 2
        peer.freeze()
        try:
            started = time.monotonic()
            assert consumer.abort("r-hold")
            assert not consumer.poll("r-hold").state.is_terminal  # a receive is still posted
            status = wait_terminal(consumer, "r-hold", WAIT)
            elapsed = time.monotonic() - started
        finally:
            peer.thaw()
        assert status.state is TransferState.ABORTED
        assert elapsed >= CONFIG["stall_timeout_s"] * 0.8
        # the pair is closed by the same give-up that ends the transfer; its link leaves
        # the consumer's table a moment after the record ended
        deadline = time.monotonic() + WAIT
        while consumer.peers() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert consumer.peers() == []
    finally:
        consumer.close()
        peer.kill()


def test_consumer_death_mid_transfer_fails_the_producer():
    peer = PeerProcess("consumer", LAYOUT, 16, config=CONFIG)
    layout = make_layout(LAYOUT)
    producer = KVProducer(seeded_store(layout, 16, seed=1), location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(**{**CONFIG, "stall_timeout_s": 60.0}),
                          backend=DistBackend())
    try:
        ticket = peer.call("expect", req_id="r-death", block_ids=[1, 2, 3, 4])["ticket"]
        producer.begin(ticket)
        producer.push("r-death", [5, 6])
        assert _wait_done_blocks(peer, "r-death", 2)
        peer.die()
        status = wait_terminal(producer, "r-death", WAIT)
        assert (status.state, status.reason, status.failed_side) == (
            TransferState.FAILED, FailReason.PEER_LOST, Side.CONSUMER)
    finally:
        producer.close()
        peer.kill()


def test_producer_death_mid_transfer_fails_the_consumer():
    layout = make_layout(LAYOUT)
    consumer = KVConsumer(seeded_store(layout, 16, seed=None), location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(**{**CONFIG, "stall_timeout_s": 60.0}),
                          backend=DistBackend())
    peer = PeerProcess("producer", LAYOUT, 16, seed=2, config=CONFIG)
    try:
        ticket = consumer.expect("r-pdeath", [1, 2, 3, 4])
        peer.call("begin", ticket=ticket)
        peer.call("push", req_id="r-pdeath", block_ids=[5, 6])
        deadline_status = _wait_local_done_blocks(consumer, "r-pdeath", 2)
        assert deadline_status.num_blocks_done == 2
        peer.die()
        status = wait_terminal(consumer, "r-pdeath", WAIT)
        assert (status.state, status.reason, status.failed_side) == (
            TransferState.FAILED, FailReason.PEER_LOST, Side.PRODUCER)
    finally:
        consumer.close()
        peer.kill()


def _wait_done_blocks(peer: PeerProcess, req_id: str, n: int) -> bool:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if peer.call("poll", req_id=req_id)["status"]["done"] >= n:
            return True
        time.sleep(0.01)
    return False


def _wait_local_done_blocks(consumer: KVConsumer, req_id: str, n: int):
    deadline = time.monotonic() + WAIT
    status = consumer.poll(req_id)
    while status.num_blocks_done < n and time.monotonic() < deadline:
        time.sleep(0.01)
        status = consumer.poll(req_id)
    return status
