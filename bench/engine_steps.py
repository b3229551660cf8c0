"""Step times of the engine: one prefill step of N tokens, one decode step at batch B.

The figures engine/README.md quotes (``python -m bench.engine_steps``). Each point is the
median of ``--reps`` steps, as wall time and as the calling thread's CPU time
(``time.thread_time``; with one torch thread the forward runs on it, so other jobs on a
shared machine inflate it less than the wall time).

* prefill N: one request alone, N random prompt tokens, its whole prompt in one step
  (prefix caching off, so every repeat computes all N);
* decode B: B requests of ``--context`` prompt tokens each, all decoding, one step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PREFILL_SIZES = (16, 256, 1000, 2000)
DECODE_BATCHES = (1, 16, 64)


def _engine(model: str, dtype: str, num_blocks: int) -> Any:
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, dtype=dtype, num_kv_blocks=num_blocks,
                                  prefill_chunk_size=2048, max_num_batched_tokens=2048,
                                  max_num_seqs=64, enable_prefix_caching=False))


def _timed(fn) -> tuple[float, float]:
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def measure(engine: Any, reps: int, context: int, prefill_sizes=PREFILL_SIZES,
            decode_batches=DECODE_BATCHES, log=print) -> dict[str, Any]:
    import torch

    from engine import SamplingParams

    vocab = int(engine.model.config.vocab_size)
    g = torch.Generator().manual_seed(0)

    def prompt(n: int) -> list[int]:
        return torch.randint(100, vocab - 1, (n,), generator=g).tolist()

    out: dict[str, Any] = {"prefill": {}, "decode": {}}
    serial = [0]

    def prefill_once(n: int) -> tuple[float, float]:
        serial[0] += 1
        rid = f"p{serial[0]}"
        engine.add_request(rid, prompt(n), SamplingParams(max_tokens=1), prefill_only=True)
        t = _timed(engine.step)
        engine.release(rid)
        return t

    prefill_once(16)  # warm-up
    for n in prefill_sizes:
        prefill_once(n)
        ts = [prefill_once(n) for _ in range(reps)]
        out["prefill"][str(n)] = _summary(ts)
        log(f"prefill {n:5d}: {out['prefill'][str(n)]}")
    for b in decode_batches:
        ids = []
        for _ in range(b):
            serial[0] += 1
            ids.append(f"d{serial[0]}")
            engine.add_request(ids[-1], prompt(context),
                               SamplingParams(max_tokens=reps + 4, ignore_eos=True))
        started: set[str] = set()
        while len(started) < b:
            started.update(o.req_id for o in engine.step() if o.prefill_done)
        engine.step()
        ts = [_timed(engine.step) for _ in range(reps)]
        for rid in ids:
            engine.abort(rid)
        out["decode"][str(b)] = _summary(ts)
        log(f"decode  {b:5d}: {out['decode'][str(b)]}")
    return out


def _summary(ts: list[tuple[float, float]]) -> dict[str, float]:
    return {"wall_ms": round(statistics.median(t[0] for t in ts) * 1e3, 1),
            "cpu_ms": round(statistics.median(t[1] for t in ts) * 1e3, 1)}


def main(argv: list[str] | None = None) -> int:
    import torch

    from engine.prepare_model import default_model_path

    parser = argparse.ArgumentParser(prog="python -m bench.engine_steps")
    parser.add_argument("--model", default=str(default_model_path()))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--context", type=int, default=128, help="decode prompt length")
    parser.add_argument("--prefill", default=",".join(map(str, PREFILL_SIZES)))
    parser.add_argument("--decode", default=",".join(map(str, DECODE_BATCHES)))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    prefill = tuple(int(x) for x in args.prefill.split(",") if x)
    decode = tuple(int(x) for x in args.decode.split(",") if x)
    load = os.getloadavg()[0]
    engine = _engine(args.model, args.dtype, num_blocks=2048)
    result = measure(engine, args.reps, args.context, prefill, decode)
    result.update(load_before=load, load_after=os.getloadavg()[0], threads=args.threads,
                  dtype=args.dtype, context=args.context)
    text = json.dumps(result)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
