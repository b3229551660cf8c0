"""Transfers between pools of either layout over real gloo pairs: block-major and layer-major
producers (here) into layer-major and block-major consumers (spawned processes), on the posted
path, the announced path (checksums on) and with headers through the store queue (the path
NCCL takes); byte-identical once landed, and cancels that leave unsent slots alone.

The wire layout is the same for both pool layouts, so the pairs are the same as in
test_gloo_pair.py; what differs is where a segment is sent from (a run of the pool or a slab
gathered from it) and where it is received into (the slots, or a slab then scattered).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from kvtransfer import DistBackend, KVLocation, KVProducer, Side, TransferConfig, TransferState
from kvtransfer.testing import PeerProcess, make_layout, seeded_store, wait_terminal

torch.set_num_threads(1)

LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float32"}
BLOCK_SHAPE = (2, 2, 4, 2, 8)
BLOCK_BYTES = 2 * 2 * 4 * 2 * 8 * 4
# Two blocks a segment and two segments in flight: a consumer's staging window is smaller
# than every transfer here, so its receives are posted as earlier ones land. No test here is
# about stalls: the timeout stays well above a pair's setup (a fresh producer's first TCPStore
# connections were seen to take 5 s on this VM, and the stall clock runs from the push).
CONFIG = {"stall_timeout_s": 20.0, "start_timeout_s": 30.0, "connect_timeout_s": 20.0,
          "part_bytes": 2 * BLOCK_BYTES, "max_in_flight_parts": 2}
NUM_BLOCKS = 128
WAIT = 30.0
SOURCES = {False: seeded_store(make_layout(LAYOUT), 64, seed=7),
           True: seeded_store(make_layout(LAYOUT), 64, seed=8, layer_major=True)}
# (producer, consumer) pool layouts, layer-major or not
CROSS = [(False, True), (True, False), (True, True)]
CROSS_IDS = ["block-to-layer", "layer-to-block", "layer-to-layer"]


@pytest.fixture(scope="module")
def consumers():
    """A layer-major and a block-major consumer; each test takes slots nobody used before."""
    peers = {True: PeerProcess("consumer", LAYOUT, NUM_BLOCKS, config=CONFIG, layer_major=True),
             False: PeerProcess("consumer", LAYOUT, NUM_BLOCKS, config=CONFIG)}
    yield peers
    for peer in peers.values():
        peer.close()


@pytest.fixture(scope="module")
def producer_for():
    made: dict[tuple, KVProducer] = {}

    def get(layer_major: bool, checksum: bool = False, frames: bool | None = None) -> KVProducer:
        key = (layer_major, checksum, frames)
        if key not in made:
            made[key] = KVProducer(SOURCES[layer_major], location=KVLocation("node-0", "cpu"),
                                   config=TransferConfig(**{**CONFIG, "checksum": checksum}),
                                   backend=DistBackend(frames=frames))
        return made[key]

    yield get
    for producer in made.values():
        producer.close()


_next_free = {True: 0, False: 0}


def fresh_slots(layer_major: bool, count: int) -> int:
    """The first of ``count`` slots of that consumer no test has used."""
    first = _next_free[layer_major]
    _next_free[layer_major] += count
    assert _next_free[layer_major] <= NUM_BLOCKS
    return first


def landed(peer: PeerProcess, ids: list[int]) -> np.ndarray:
    raw = peer.call("read", block_ids=ids)["data"]
    return np.frombuffer(raw, dtype=np.float32).reshape(len(ids), *BLOCK_SHAPE)


def sent(layer_major: bool, ids: list[int]) -> np.ndarray:
    return SOURCES[layer_major].read_blocks(ids).float().numpy()


def peer_wait(peer: PeerProcess, req_id: str) -> dict:
    return peer.call("wait", req_id=req_id, wait_s=WAIT, timeout_s=WAIT + 30)["status"]


@pytest.mark.parametrize("checksum", [False, True], ids=["posted", "announced"])
@pytest.mark.parametrize(("producer_lm", "consumer_lm"), CROSS, ids=CROSS_IDS)
def test_blocks_land_byte_identical_whatever_the_layouts(consumers, producer_for, producer_lm,
                                                         consumer_lm, checksum):
    peer, producer = consumers[consumer_lm], producer_for(producer_lm, checksum)
    b = fresh_slots(consumer_lm, 12)
    # segments [b] [b+2, b+3] [b+9] [b+6] [b+10, b+11]; position 1 is a prefix hit
    slots = [b, b + 1, b + 2, b + 3, b + 9, b + 6, b + 10, b + 11]
    sources = [20, 21, 22, 23, 40, 5, 31, 30]  # a run, then scattered and reversed ones
    req = f"x-{producer_lm}-{consumer_lm}-{checksum}"
    ticket = peer.call("expect", req_id=req, block_ids=slots, present=[1])["ticket"]
    producer.begin(ticket)
    producer.push(req, sources[:4])
    producer.push(req, sources[4:])
    assert wait_terminal(producer, req, WAIT).state is TransferState.DONE
    assert peer_wait(peer, req)["state"] == "done"
    travelled = [0, 2, 3, 4, 5, 6, 7]
    np.testing.assert_array_equal(landed(peer, [slots[i] for i in travelled]),
                                  sent(producer_lm, [sources[i] for i in travelled]))
    untouched = [b + 1, b + 4, b + 5, b + 7, b + 8]  # the prefix hit and slots not reserved
    assert not landed(peer, untouched).any()


@pytest.mark.parametrize(("producer_lm", "consumer_lm"), CROSS, ids=CROSS_IDS)
def test_a_consumer_cancel_mid_transfer_lands_nothing_more_and_the_pair_goes_on(
        consumers, producer_for, producer_lm, consumer_lm):
    """The consumer aborts after its first segment landed: every posted receive (of the
    window, and those posted after it) gets the producer's empty release, none of which is
    scattered; then the next transfer on the same pair arrives intact."""
    peer, producer = consumers[consumer_lm], producer_for(producer_lm)
    b = fresh_slots(consumer_lm, 10)
    req = f"c-{producer_lm}-{consumer_lm}"
    ticket = peer.call("expect", req_id=req, block_ids=list(range(b, b + 8)))["ticket"]
    producer.begin(ticket)
    producer.push(req, [11, 12])
    assert _wait_done_blocks(peer, req, 2)
    assert peer.call("abort", req_id=req)["aborted"]
    status = wait_terminal(producer, req, WAIT)
    assert (status.state, status.failed_side) == (TransferState.ABORTED, Side.CONSUMER)
    producer.push(req, [13, 14, 15, 16, 17, 18])  # the prefill finishes anyway: nothing sent
    assert peer_wait(peer, req)["state"] == "aborted"
    np.testing.assert_array_equal(landed(peer, [b, b + 1]), sent(producer_lm, [11, 12]))
    assert not landed(peer, list(range(b + 2, b + 8))).any()
    after = f"{req}-after"
    ticket = peer.call("expect", req_id=after, block_ids=[b + 8, b + 9])["ticket"]
    producer.begin(ticket)
    producer.push(after, [33, 2])
    assert wait_terminal(producer, after, WAIT).state is TransferState.DONE
    assert peer_wait(peer, after)["state"] == "done"
    np.testing.assert_array_equal(landed(peer, [b + 8, b + 9]), sent(producer_lm, [33, 2]))


@pytest.mark.parametrize("producer_lm", [False, True], ids=["from-block", "from-layer"])
def test_a_producer_abort_mid_transfer_leaves_a_layer_major_consumer_clean(
        consumers, producer_for, producer_lm):
    peer, producer = consumers[True], producer_for(producer_lm)
    b = fresh_slots(True, 6)
    req = f"p-{producer_lm}"
    ticket = peer.call("expect", req_id=req, block_ids=list(range(b, b + 6)))["ticket"]
    producer.begin(ticket)
    producer.push(req, [50, 51, 52, 53])
    assert _wait_done_blocks(peer, req, 4)
    assert producer.abort(req)
    remote = peer_wait(peer, req)
    assert (remote["state"], remote["side"]) == ("aborted", "producer")
    np.testing.assert_array_equal(landed(peer, list(range(b, b + 4))),
                                  sent(producer_lm, [50, 51, 52, 53]))
    assert not landed(peer, [b + 4, b + 5]).any()


@pytest.fixture(scope="module")
def store_queue_consumer():
    """A layer-major consumer whose headers come through the store queue (as over NCCL)."""
    peer = PeerProcess("consumer", LAYOUT, 32, config=CONFIG, frames=False, layer_major=True)
    yield peer
    peer.close()


@pytest.mark.parametrize("checksum", [False, True])
@pytest.mark.parametrize("producer_lm", [False, True], ids=["from-block", "from-layer"])
def test_a_layer_major_consumer_through_store_headers(store_queue_consumer, producer_for,
                                                      producer_lm, checksum):
    peer = store_queue_consumer
    producer = producer_for(producer_lm, checksum, frames=False)
    b = 16 * checksum + 8 * producer_lm
    slots = [b, b + 1, b + 2, b + 5, b + 4, b + 6]  # segments [b, b+1] [b+2] [b+5] [b+4] [b+6]
    sources = [3, 4, 5, 9, 7, 60]
    req = f"q-{producer_lm}-{checksum}"
    ticket = peer.call("expect", req_id=req, block_ids=slots)["ticket"]
    producer.begin(ticket)
    producer.push(req, sources)
    assert wait_terminal(producer, req, WAIT).state is TransferState.DONE
    assert peer_wait(peer, req)["state"] == "done"
    np.testing.assert_array_equal(landed(peer, slots), sent(producer_lm, sources))
    assert not landed(peer, [b + 3, b + 7]).any()


def _wait_done_blocks(peer: PeerProcess, req_id: str, n: int) -> bool:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if peer.call("poll", req_id=req_id)["status"]["done"] >= n:
            return True
        time.sleep(0.01)
    return False
