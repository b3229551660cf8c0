"""The NCCL path: the same producer/consumer code over a ProcessGroupNCCL pair group.

Marked ``gpu`` (skipped without CUDA). NCCL refuses two ranks on one GPU, so the pair needs
two devices: the consumer process on cuda:1, the producer here on cuda:0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer import DistBackend, KVLocation, KVProducer, TransferConfig, TransferState
from kvtransfer.testing import PeerProcess, make_layout, seeded_store, wait_terminal

pytestmark = pytest.mark.gpu

LAYOUT = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_size": 16,
          "dtype": "bfloat16"}


@pytest.fixture(scope="module")
def nccl_pair():
    if torch.cuda.device_count() < 2:
        pytest.skip("the NCCL pair test needs two CUDA devices")
    peer = PeerProcess("consumer", {**LAYOUT, "device": "cuda:1"}, 64,
                       config={"stall_timeout_s": 20.0})
    source = seeded_store(make_layout({**LAYOUT, "device": "cuda:0"}), 64, seed=5)
    producer = KVProducer(source, location=KVLocation("node-0", "cuda:0", "nvl-0"),
                          config=TransferConfig(stall_timeout_s=20.0),
                          backend=DistBackend())
    yield peer, source, producer
    producer.close()
    peer.close()


def test_blocks_stream_over_nccl(nccl_pair):
    peer, source, producer = nccl_pair
    slots = [3, 4, 5, 6, 20, 9, 11]  # a run of slots and scattered ones
    ticket = peer.call("expect", req_id="g1", block_ids=slots, present=[0])["ticket"]
    producer.begin(ticket)
    producer.push("g1", [40, 41, 43, 42])  # sources: a run (from the pool) and not (staged)
    producer.push("g1", [7, 8, 1])
    status = wait_terminal(producer, "g1", 60)
    assert status.state is TransferState.DONE
    assert producer.drain_stats()[0].backend == "nccl"
    raw = peer.call("read", block_ids=slots[1:])["data"]
    got = np.frombuffer(raw, dtype=np.float32).reshape(6, 4, 2, 16, 2, 64)
    want = source.read_blocks([41, 43, 42, 7, 8, 1]).float().cpu().numpy()
    np.testing.assert_array_equal(got, want)


def test_consumer_death_fails_the_nccl_producer(nccl_pair):
    peer, _, producer = nccl_pair
    ticket = peer.call("expect", req_id="g2", block_ids=[30, 31, 32])["ticket"]
    producer.begin(ticket)
    producer.push("g2", [1])
    peer.die()
    status = wait_terminal(producer, "g2", 90)
    assert status.state is TransferState.FAILED
