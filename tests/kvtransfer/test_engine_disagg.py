"""Done-when test of issue 4: two processes exchange blocks of real engine KV caches and the
decode side produces the same tokens as a single-process run.

Prefill side (this process): an ``engine.LLMEngine`` with a small prefill chunk, a
``prefill_only`` request, each step's ``ready_block_ids`` pushed to a ``KVProducer`` while the
next chunk computes. Decode side (``disagg_decode_peer.py``, its own process): reserves blocks
(prefix hits reused), receives them through a ``KVConsumer`` and continues decoding, with the
paged attention of a block-major pool or the flex attention of a layer-major one (the CUDA
path's, in FlexAttention's eager mode here), whose blocks kvtransfer stages.
"""

from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch

from scheduler.messages import KVTicket, decode

engine = pytest.importorskip("engine")
from engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from engine.testing import make_tiny_checkpoint  # noqa: E402
from kvtransfer import DistBackend, KVLocation, KVProducer, TransferConfig, TransferState  # noqa: E402
from kvtransfer.testing import wait_terminal  # noqa: E402

torch.set_num_threads(1)
PEER = Path(__file__).with_name("disagg_decode_peer.py")
REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 6


class DecodePeer:
    def __init__(self, engine_config: dict) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, str(PEER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=str(REPO))
        self.send({"engine": engine_config})
        ready = self.recv(180)
        assert ready["ready"]
        self.block_major: bool = ready["block_major"]

    def send(self, msg: dict) -> None:
        body = msgpack.packb(msg)
        self.proc.stdin.write(struct.pack("<I", len(body)) + body)
        self.proc.stdin.flush()

    def recv(self, timeout_s: float = 120) -> dict:
        head = self._read(4, timeout_s)
        return msgpack.unpackb(self._read(struct.unpack("<I", head)[0], timeout_s))

    def _read(self, n: int, timeout_s: float) -> bytes:
        out = b""
        fd = self.proc.stdout.fileno()
        while len(out) < n:
            ready, _, _ = select.select([fd], [], [], timeout_s)
            if not ready:
                raise TimeoutError("decode peer did not answer")
            chunk = os.read(fd, n - len(out))
            if not chunk:
                raise EOFError("decode peer exited")
            out += chunk
        return out

    def call(self, op: str, **kwargs) -> dict:
        self.send({"op": op, **kwargs})
        reply = self.recv()
        if "error" in reply:
            raise AssertionError(reply["error"])
        return reply

    def close(self) -> None:
        try:
            self.send({"op": "exit"})
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))
    config = {"model": str(path), "dtype": "float32", "device": "cpu", "block_size": 16,
              "num_kv_blocks": 64, "prefill_chunk_size": 16, "max_num_batched_tokens": 64}
    prefill = LLMEngine(EngineConfig(**config))
    producer = KVProducer(prefill.pool, location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(stall_timeout_s=30.0), backend=DistBackend())
    peer = DecodePeer(config)
    yield config, prefill, producer, peer
    peer.close()
    producer.close()


@pytest.fixture(scope="module")
def flex_peer(setup):
    """A decode worker whose engine runs flex attention over a layer-major pool."""
    peer = DecodePeer({**setup[0], "attention": "flex"})
    yield peer
    peer.close()


def reference_tokens(config: dict, prompt: list[int]) -> list[int]:
    single = LLMEngine(EngineConfig(**config))
    return single.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0]


def disaggregated_tokens(prefill, producer, peer, req_id: str, prompt: list[int]) -> tuple[list[int], int]:
    reply = peer.call("reserve", req_id=req_id, prompt=prompt)
    ticket = decode(reply["ticket"], expect=KVTicket)  # as a decode worker's StartPrefill has it
    producer.begin(ticket)
    prefill.add_request(req_id, prompt, SamplingParams(max_tokens=MAX_TOKENS), prefill_only=True)
    first_token = None
    num_pushes = 0
    while first_token is None:
        for out in prefill.step():
            if out.req_id != req_id:
                continue
            if out.ready_block_ids:
                producer.push(req_id, out.ready_block_ids)
                num_pushes += 1
            if out.prefill_done:
                first_token = out.new_token_ids[0]
    status = wait_terminal(producer, req_id, 60)
    assert status.state is TransferState.DONE, status
    prefill.release(req_id)  # the producer side is terminal: the source blocks are ours again
    tokens = peer.call("decode", req_id=req_id, prompt=prompt, first_token=first_token,
                       max_tokens=MAX_TOKENS, ticket_block_ids=list(ticket.block_ids))["tokens"]
    return tokens, reply["cached"], num_pushes


@pytest.mark.parametrize("decode_attention", ["paged", "flex"])
def test_decode_side_continues_from_streamed_kv_like_a_single_process(setup, flex_peer,
                                                                      decode_attention):
    config, prefill, producer, peer = setup
    if decode_attention == "flex":
        peer = flex_peer
    assert peer.block_major is (decode_attention == "paged")
    offset = 0 if decode_attention == "paged" else 5  # no prefix hit on the prefill side
    prompt = [(7 * i + 3 + offset) % 200 + 1 for i in range(45)]  # 3 blocks: 16 + 16 + 13
    tokens, cached, num_pushes = disaggregated_tokens(prefill, producer, peer,
                                                      f"d-1-{decode_attention}", prompt)
    assert cached == 0 and num_pushes >= 3  # streamed chunk by chunk
    assert tokens == reference_tokens(config, prompt)


def test_prefix_hits_on_the_decode_side_are_not_resent(setup):
    config, prefill, producer, peer = setup
    shared = [(11 * i + 5) % 200 + 1 for i in range(32)]  # two full blocks
    peer.call("warm_prefix", prompt=shared + [9, 9, 9])
    prompt = shared + [(3 * i) % 200 + 1 for i in range(20)]
    producer.drain_stats()
    tokens, cached, _ = disaggregated_tokens(prefill, producer, peer, "d-2", prompt)
    assert cached == 2
    [stats] = [s for s in producer.drain_stats() if s.req_id == "d-2"]
    assert (stats.num_blocks, stats.num_skipped_blocks) == (2, 2)
    assert tokens == reference_tokens(config, prompt)
