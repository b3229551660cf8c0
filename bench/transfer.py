"""`tierserve bench-transfer`: KV block transfer bandwidth, latency and streaming tail.

Two processes (multiprocessing spawn): this one is the producer (prefill side), the child is
the consumer (decode side) with a pool of the same layout. Both also join a raw two-rank
group of the same backend, the baseline: one contiguous tensor of the same byte count, sent
with one ``send`` and received with one ``recv``. Timestamps are ``time.time()`` on one
machine (one clock for both processes): a transfer is timed from ``push`` (producer) to the
consumer's DONE (its ``TransferStats.end_time``); a raw message from ``send`` to the end of
``recv``. Each figure is the median over repetitions, after a warm-up.

Figures (JSON): ``memcpy_gbps`` (one in-process tensor copy, the machine's limit), per size
(1 MB, 16 MB, 256 MB of SmolLM2-135M-shaped blocks) ``gbps``, ``raw_gbps``, ``ratio`` and
``memcpy_ratio``; ``one_block_latency_ratio`` (one block vs a raw message of one block's
bytes; ``one_block_vs_tiny_ratio`` against a 4-byte message too); and
``streaming_tail_fraction``: a 2,000-token prompt prefilled chunk by chunk by the engine on
SmolLM2-135M, each chunk's finished blocks pushed while the next chunk computes, the last
block's arrival after the prefill ends, as a fraction of the prefill time.

``--layer-major``: both synthetic pools (and the consumer's streaming pool; the engine's own
pool, the streaming producer, stays block-major) are layer-major, so every segment is gathered
into a slab on the producer and scattered from one on the consumer: the figures then price
that staging against the same raw messages.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from kvtransfer.consumer import KVConsumer
from kvtransfer.dist_backend import DistBackend
from kvtransfer.layout import KVLayout, TensorKVStore
from kvtransfer.producer import KVProducer
from kvtransfer.state import KVLocation, TransferConfig, TransferState
from kvtransfer.testing import make_layout, wait_terminal
from scheduler.messages import KVTicket, decode, encode

MB = 1 << 20
SIZES = {"1MB": 1 * MB, "16MB": 16 * MB, "256MB": 256 * MB}
# SmolLM2-135M: 30 layers, 3 KV heads of 64, block 16.
SMOL_GEOMETRY = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "block_size": 16}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL; needs 2 GPUs)")
    parser.add_argument("--reps", type=int, default=0, help="repetitions per size (0: by size)")
    parser.add_argument("--sizes", default="1MB,16MB,256MB", help="comma list of 1MB,16MB,256MB")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--model", default=None, help="checkpoint for the streaming figure "
                        "(default: the prepared SmolLM2-135M)")
    parser.add_argument("--skip-streaming", action="store_true")
    parser.add_argument("--no-scattered", dest="scattered", action="store_false",
                        help="skip the scattered-slot (staged) bandwidth figures")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--part-bytes", type=int, default=TransferConfig().part_bytes,
                        help="most bytes one message carries (the consumer's segment size)")
    parser.add_argument("--layer-major", action="store_true",
                        help="layer-major pools [layers, 2, blocks, ...] on both sides "
                        "(every segment staged) instead of block-major")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"bench-transfer: unknown sizes {unknown}; choose from {list(SIZES)}", file=sys.stderr)
        return 2
    engine = None
    if not args.skip_streaming:
        engine = _load_engine(args.model, args.device)
    # Synthetic sizes: SmolLM2-135M blocks in its checkpoint dtype (bf16); streaming: the
    # engine's own pool layout (its dtype may be float32 on CPUs without native bf16).
    spec = {**SMOL_GEOMETRY, "dtype": "bfloat16", "device": _peer_device(args.device)}
    layout = make_layout({**spec, "device": args.device})
    max_blocks = max(_num_blocks(SIZES[s], layout) for s in sizes) if sizes else 1
    num_blocks = 2 * max_blocks + 1
    stream_spec = None
    if engine is not None:
        pool_layout = KVLayout.of(engine.pool.kv_layout())
        stream_spec = {**dataclasses.asdict(pool_layout.shape()), "device": _peer_device(args.device),
                       "num_blocks": _num_blocks_for_prompt(args.prompt_tokens, pool_layout) + 1}
    result: dict[str, Any] = {"backend": "nccl" if args.device.startswith("cuda") else "gloo",
                              "device": args.device, "layout": {**spec, "device": args.device},
                              "layer_major": args.layer_major,
                              "memcpy_gbps": _memcpy_gbps(layout.device)}
    print(f"memcpy: {result['memcpy_gbps']:.2f} GB/s", flush=True)
    raw_server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_consumer_main, daemon=True,
                        args=(child_conn, spec, num_blocks, stream_spec, int(raw_server.port),
                              args.threads, args.part_bytes, args.layer_major))
    child.start()
    child_conn.close()
    peer = _Peer(conn)
    producer = KVProducer(TensorKVStore(layout, num_blocks, fill="random",
                                        layer_major=args.layer_major),
                          location=KVLocation("bench-node", args.device),
                          config=TransferConfig(part_bytes=args.part_bytes),
                          backend=DistBackend())
    try:
        peer.wait_ready()
        raw = _raw_group(raw_server, rank=0, device=layout.device)
        result["sizes"] = {}
        for label in sizes:
            nblocks = _num_blocks(SIZES[label], layout)
            reps = args.reps or (100 if SIZES[label] <= MB else 20 if SIZES[label] <= 16 * MB else 5)
            nbytes = nblocks * layout.bytes_per_block
            kv_s, (raw_s,) = _time_side_by_side(producer, peer, raw, nblocks, [nbytes],
                                                layout.device, reps)
            entry = {"bytes": nbytes, "blocks": nblocks, "gbps": nbytes / kv_s / 1e9,
                     "raw_gbps": nbytes / raw_s / 1e9, "ratio": raw_s / kv_s,
                     "memcpy_ratio": nbytes / kv_s / 1e9 / result["memcpy_gbps"]}
            result["sizes"][label] = entry
            print(f"{label}: kv {entry['gbps']:.2f} GB/s, raw {entry['raw_gbps']:.2f} GB/s, "
                  f"ratio {entry['ratio']:.2f}", flush=True)
        # The same sizes into scattered slots (a fragmented pool): every block is staged.
        result["scattered_sizes"] = {}
        for label in sizes if args.scattered else []:
            nblocks = _num_blocks(SIZES[label], layout)
            reps = args.reps or (10 if SIZES[label] <= 16 * MB else 2)
            nbytes = nblocks * layout.bytes_per_block
            kv_s, (raw_s,) = _time_side_by_side(producer, peer, raw, nblocks, [nbytes],
                                                layout.device, reps, scattered=True)
            result["scattered_sizes"][label] = {"gbps": nbytes / kv_s / 1e9,
                                                "raw_gbps": nbytes / raw_s / 1e9,
                                                "ratio": raw_s / kv_s}
            print(f"{label} scattered: kv {nbytes / kv_s / 1e9:.2f} GB/s, "
                  f"ratio {raw_s / kv_s:.2f}", flush=True)
        one_kv, (one_raw, tiny_raw) = _time_side_by_side(
            producer, peer, raw, 1, [layout.bytes_per_block, 4], layout.device, 100)
        result.update({"one_block_latency_s": one_kv, "raw_one_block_latency_s": one_raw,
                       "raw_tiny_latency_s": tiny_raw,
                       "one_block_latency_ratio": one_kv / one_raw,
                       "one_block_vs_tiny_ratio": one_kv / tiny_raw})
        print(f"one block: {one_kv * 1e6:.0f} us, raw {one_raw * 1e6:.0f} us "
              f"(tiny {tiny_raw * 1e6:.0f} us)", flush=True)
        if engine is not None:
            result.update(_streaming(engine, peer, args.prompt_tokens, args.device))
            print(f"streaming tail fraction: {result['streaming_tail_fraction']:.4f}", flush=True)
        else:
            result["streaming_tail_fraction"] = None
    finally:
        producer.close()
        peer.call("exit")
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.write_text(text + "\n")
    print(text)
    return 0


# -- measurements (producer side) -----------------------------------------------------------


def _memcpy_gbps(device: torch.device) -> float:
    src = torch.ones(256 * MB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best / 1e9


def _time_side_by_side(producer: KVProducer, peer: _Peer, raw: Any, nblocks: int,
                       raw_sizes: list[int], device: torch.device, reps: int,
                       scattered: bool = False) -> tuple[float, list[float]]:
    """Median seconds of a KV transfer of ``nblocks`` and of a raw message of each of
    ``raw_sizes`` bytes, interleaved rep by rep (the order turning each rep) so that all see
    the same machine; the first rep is a warm-up (and opens the pair)."""
    kv_times: list[float] = []
    raw_times: list[list[float]] = [[] for _ in raw_sizes]
    tensors = [torch.ones(n, dtype=torch.uint8, device=device) for n in raw_sizes]
    for rep in range(reps + 1):
        jobs: list[Any] = [None, *range(len(raw_sizes))]
        shift = rep % len(jobs)
        for job in jobs[shift:] + jobs[:shift]:
            if job is None:
                seconds = _time_transfer(producer, peer, nblocks, rep, scattered)
                if rep:
                    kv_times.append(seconds)
            else:
                seconds = _time_raw_once(raw, peer, tensors[job])
                if rep:
                    raw_times[job].append(seconds)
    producer.drain_stats()
    return statistics.median(kv_times), [statistics.median(t) for t in raw_times]


def _time_transfer(producer: KVProducer, peer: _Peer, nblocks: int, rep: int,
                   scattered: bool) -> float:
    """Seconds from push to the consumer's DONE. Slots are consecutive (a fresh pool hands
    out runs) or, with ``scattered``, every other slot in reverse (no two adjacent)."""
    slots = list(range(1, nblocks + 1))
    if scattered:
        slots = list(range(2 * nblocks - 1, 0, -2))
    req = f"bench-{nblocks}-{rep}-{time.monotonic_ns()}"
    ticket = peer.call("expect", req_id=req, block_ids=slots)["ticket"]
    producer.begin(decode(ticket, expect=KVTicket))
    time.sleep(0.02)  # the Open is delivered: the consumer waits like a reserved decode
    t0 = time.time()
    producer.push(req, list(range(nblocks)))
    status = wait_terminal(producer, req, 120)
    if status is None or status.state is not TransferState.DONE:
        raise RuntimeError(f"bench transfer {req} ended as {status}")
    end = peer.call("end_time", req_id=req)["end_time"]
    producer.forget(req)
    return end - t0


def _time_raw_once(group: Any, peer: _Peer, tensor: torch.Tensor) -> float:
    """One contiguous message: the consumer posts its receive, we wait as for a transfer and
    send; seconds from the send to the end of the receive."""
    peer.call("raw_post", nbytes=tensor.numel())
    time.sleep(0.02)
    start = time.time()
    group.send([tensor], 1, 0).wait()
    return peer.recv()["end"] - start


def _streaming(engine: Any, peer: _Peer, prompt_tokens: int, device: str) -> dict[str, Any]:
    from engine import SamplingParams

    pool = engine.pool
    producer = KVProducer(pool, location=KVLocation("bench-node", device), backend=DistBackend())
    try:
        layout = KVLayout.of(pool.kv_layout())
        nblocks = _num_blocks_for_prompt(prompt_tokens, layout)
        gen = torch.Generator().manual_seed(0)
        vocab = int(engine.model.config.vocab_size)
        prompt = torch.randint(0, vocab, (prompt_tokens,), generator=gen).tolist()
        req = "bench-stream"
        ticket = peer.call("expect", req_id=req, block_ids=list(range(1, nblocks + 1)),
                           pool="stream")["ticket"]
        producer.begin(decode(ticket, expect=KVTicket))
        time.sleep(0.05)
        engine.add_request(req, prompt, SamplingParams(max_tokens=1), prefill_only=True)
        t_start = time.time()
        t_end = None
        num_chunks = 0
        while t_end is None:
            for out in engine.step():
                if out.req_id != req:
                    continue
                if out.ready_block_ids:
                    producer.push(req, out.ready_block_ids)
                num_chunks += 1
                if out.prefill_done:
                    t_end = time.time()
        status = wait_terminal(producer, req, 120)
        if status is None or status.state is not TransferState.DONE:
            raise RuntimeError(f"streaming transfer ended as {status}")
        last_block = peer.call("end_time", req_id=req, pool="stream")["end_time"]
        engine.release(req)
        prefill_s = t_end - t_start
        return {"streaming_tail_fraction": max(0.0, last_block - t_end) / prefill_s,
                "streaming": {"prompt_tokens": prompt_tokens, "blocks": nblocks,
                              "chunks": num_chunks, "prefill_s": prefill_s,
                              "tail_s": last_block - t_end, "engine": "engine.LLMEngine",
                              "chunk_size": engine.config.prefill_chunk_size}}
    finally:
        producer.close()


def _load_engine(model: str | None, device: str) -> Any:
    from engine import EngineConfig, LLMEngine
    from engine.prepare_model import default_model_path, prepare

    path = Path(model) if model else default_model_path()
    if not path.exists():
        prepare(path, log=lambda m: print(m, flush=True))
    return LLMEngine(EngineConfig(model=str(path), device=device, num_kv_blocks=256,
                                  prefill_chunk_size=512, max_num_batched_tokens=512))


# -- helpers --------------------------------------------------------------------------------


def _num_blocks(nbytes: int, layout: KVLayout) -> int:
    return max(1, round(nbytes / layout.bytes_per_block))


def _num_blocks_for_prompt(tokens: int, layout: KVLayout) -> int:
    return -(-tokens // layout.block_size)


def _peer_device(device: str) -> str:
    return "cuda:1" if device.startswith("cuda") else "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _raw_group(server: dist.TCPStore, rank: int, device: torch.device) -> Any:
    store = dist.PrefixStore("bench-raw", server)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, 2)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=300)
    return dist.ProcessGroupGloo(store, rank, 2, opts)


class _Peer:
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def send(self, msg: dict[str, Any]) -> None:
        self._conn.send_bytes(msgpack.packb(msg))

    def recv(self) -> dict[str, Any]:
        if not self._conn.poll(300):
            raise TimeoutError("bench consumer did not answer")
        return msgpack.unpackb(self._conn.recv_bytes())

    def call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        self.send({"op": op, **kwargs})
        return self.recv()

    def wait_ready(self) -> None:
        self.recv()


# -- the consumer process -------------------------------------------------------------------


def _consumer_main(conn: Any, spec: dict[str, Any], num_blocks: int,
                   stream_spec: dict[str, Any] | None, raw_port: int, threads: int,
                   part_bytes: int, layer_major: bool) -> None:
    torch.set_num_threads(threads)
    layout = make_layout(spec)
    location = KVLocation("bench-node", spec["device"])
    config = TransferConfig(part_bytes=part_bytes)
    consumers = {"sizes": KVConsumer(TensorKVStore(layout, num_blocks, layer_major=layer_major),
                                     location=location, config=config, backend=DistBackend())}
    if stream_spec is not None:
        consumers["stream"] = KVConsumer(
            TensorKVStore(make_layout(stream_spec), stream_spec["num_blocks"],
                          layer_major=layer_major),
            location=location, config=config, backend=DistBackend())
    client = dist.TCPStore("127.0.0.1", raw_port, is_master=False,
                           timeout=datetime.timedelta(seconds=60))
    conn.send_bytes(msgpack.packb({"ready": True}))
    raw = _raw_group(client, rank=1, device=layout.device)
    raw_buffers: dict[int, torch.Tensor] = {}
    while True:
        cmd = msgpack.unpackb(conn.recv_bytes())
        op = cmd["op"]
        consumer = consumers[cmd.get("pool", "sizes")]
        if op == "expect":
            reply: dict[str, Any] = {
                "ticket": encode(consumer.expect(cmd["req_id"], cmd["block_ids"]))}
        elif op == "end_time":
            status = wait_terminal(consumer, cmd["req_id"], 120)
            stats = [s for s in consumer.drain_stats() if s.req_id == cmd["req_id"]]
            if status is None or status.state is not TransferState.DONE or not stats:
                raise RuntimeError(f"consumer side of {cmd['req_id']} ended as {status}")
            consumer.forget(cmd["req_id"])
            reply = {"end_time": stats[-1].end_time}
        elif op == "raw_post":
            tensor = raw_buffers.get(cmd["nbytes"])
            if tensor is None:
                tensor = raw_buffers[cmd["nbytes"]] = torch.empty(
                    cmd["nbytes"], dtype=torch.uint8, device=layout.device)
            work = raw.recv([tensor], 0, 0)
            conn.send_bytes(msgpack.packb({"posted": True}))
            work.wait()
            _sync(layout.device)
            reply = {"end": time.time()}
        elif op == "exit":
            for endpoint in consumers.values():
                endpoint.close()
            conn.send_bytes(msgpack.packb({}))
            return
        else:
            reply = {"error": f"unknown op {op!r}"}
        conn.send_bytes(msgpack.packb(reply))
