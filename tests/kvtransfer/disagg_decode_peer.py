"""Decode worker for test_engine_disagg.py, run as its own process (``python THIS_FILE``).

Reads length-prefixed msgpack commands on stdin and answers on stdout; hosts a real
``engine.LLMEngine`` and a ``kvtransfer.KVConsumer`` on its block pool.
"""

from __future__ import annotations

import struct
import sys
import time

import msgpack
import torch

from scheduler.messages import encode


def read_message(stream) -> dict:
    head = stream.read(4)
    if len(head) < 4:
        raise EOFError
    (n,) = struct.unpack("<I", head)
    return msgpack.unpackb(stream.read(n))


def write_message(stream, msg: dict) -> None:
    body = msgpack.packb(msg)
    stream.write(struct.pack("<I", len(body)) + body)
    stream.flush()


def main() -> int:
    torch.set_num_threads(1)
    from engine import EngineConfig, LLMEngine, SamplingParams
    from kvtransfer import DistBackend, KVConsumer, KVLocation, TransferConfig, TransferState
    from kvtransfer.testing import wait_terminal

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    init = read_message(stdin)
    engine = LLMEngine(EngineConfig(**init["engine"]))
    consumer = KVConsumer(engine.pool, location=KVLocation("node-0", "cpu"),
                          config=TransferConfig(stall_timeout_s=30.0), backend=DistBackend())
    write_message(stdout, {"ready": True, "block_major": engine.pool.block_major})
    while True:
        try:
            cmd = read_message(stdin)
        except EOFError:
            break
        op = cmd["op"]
        if op == "warm_prefix":  # a finished request leaves its full prompt blocks cached
            engine.generate([cmd["prompt"]], SamplingParams(max_tokens=1))
            write_message(stdout, {})
        elif op == "reserve":
            block_ids = engine.reserve(cmd["req_id"], len(cmd["prompt"]),
                                       prompt_token_ids=cmd["prompt"])
            cached = engine.num_reserved_cached_blocks(cmd["req_id"])
            ticket = consumer.expect(cmd["req_id"], block_ids, present=list(range(cached)))
            write_message(stdout, {"ticket": encode(ticket), "cached": cached})
        elif op == "decode":
            status = wait_terminal(consumer, cmd["req_id"], 60)
            if status is None or status.state is not TransferState.DONE:
                engine.release(cmd["req_id"])  # the reservation is ours to free
                write_message(stdout, {"error": f"transfer ended as {status}"})
                continue
            params = SamplingParams(max_tokens=cmd["max_tokens"])
            block_ids = cmd["ticket_block_ids"]
            engine.add_prefilled_request(cmd["req_id"], cmd["prompt"], cmd["first_token"],
                                         params, block_ids)
            tokens: list[int] = [cmd["first_token"]]
            deadline = time.monotonic() + 120
            done = False
            while not done and time.monotonic() < deadline:
                for out in engine.step():
                    if out.req_id == cmd["req_id"]:
                        tokens.extend(out.new_token_ids)
                        done = done or out.finished
            write_message(stdout, {"tokens": tokens})
        elif op == "exit":
            break
    consumer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
