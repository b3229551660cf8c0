"""`tierserve calibrate`: measure this machine's engine, fit the simulator's cost model.

The simulator (``scheduler/sim/costmodel.py``) prices a prefill step as
``prefill_overhead_s + flops / (peak_flops x mfu)`` and a decode step as
``decode_overhead_s + max(bytes read / bandwidth, dense flops / rate)``. This command
runs the real engine with the cluster's worker settings (one torch thread, the
configured dtype, paged KV) on the default model and fits those constants:

1. Prefill: one request alone, prompts of 64 to 1,024 new tokens (and 256 new tokens
   after 768 cached ones); a least-squares line through (flops, seconds) gives the
   overhead (intercept) and the effective rate (1 / slope).
2. Decode: batches of 1 to 32 requests at 128 and 1,024 tokens of context, the median
   of several steps each; the bandwidth (log grid) and overhead (median residual) that
   give the least relative error in the cost model's own form.

Times are the calling thread's CPU time (``time.thread_time``): with one torch thread
the forward runs on it, so other jobs on the machine do not inflate the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

PREFILL_SIZES = (64, 128, 256, 512, 1024)
DECODE_BATCHES = (1, 4, 16, 32)
DECODE_CONTEXTS = (128, 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint (default: the prepared one)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16 or float32")
    parser.add_argument("--reps", type=int, default=3, help="repetitions per point")
    parser.add_argument("--json", type=Path, default=None, help="write points and fit here")


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - slope * mx, slope


def _engine(model: str, dtype: str, num_blocks: int) -> Any:
    from engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, dtype=dtype, device="cpu", block_size=16,
                                  num_kv_blocks=num_blocks, prefill_chunk_size=2048,
                                  max_num_batched_tokens=4096, max_num_seqs=64))


def _prefill_s(engine: Any, tokens: list[int], rid: str) -> float:
    """CPU seconds of the step that prefills ``tokens`` (one request alone)."""
    from engine import SamplingParams

    engine.add_request(rid, tokens, SamplingParams(max_tokens=1), prefill_only=True)
    t0 = time.thread_time()
    engine.step()
    dt = time.thread_time() - t0
    engine.release(rid)
    return dt


def measure(model: str, dtype: str, reps: int, log=print) -> dict[str, Any]:
    import torch

    from engine import SamplingParams

    torch.set_num_threads(1)
    engine = _engine(model, dtype, num_blocks=4096)
    vocab = int(engine.model.config.vocab_size)
    seed = [0]

    def prompt(n: int) -> list[int]:
        seed[0] += 1
        g = torch.Generator().manual_seed(seed[0])
        return torch.randint(100, vocab - 1, (n,), generator=g).tolist()

    _prefill_s(engine, prompt(64), "warm")
    prefill = []
    for n in PREFILL_SIZES:
        ts = [_prefill_s(engine, prompt(n), f"p{n}-{i}") for i in range(reps)]
        prefill.append({"new": n, "cached": 0, "s": statistics.median(ts)})
        log(f"prefill {n:5d} tokens: {prefill[-1]['s'] * 1e3:8.1f} ms")
    ts = []
    for i in range(reps):
        base = prompt(1024)
        _prefill_s(engine, base, f"c-base-{i}")  # its full blocks stay prefix-cached
        ts.append(_prefill_s(engine, base[:768] + prompt(256), f"c-{i}"))
    prefill.append({"new": 256, "cached": 768, "s": statistics.median(ts)})
    log(f"prefill   256 tokens after 768 cached: {prefill[-1]['s'] * 1e3:8.1f} ms")

    decode = []
    for ctx in DECODE_CONTEXTS:
        for b in DECODE_BATCHES:
            ids = [f"d{ctx}-{b}-{i}" for i in range(b)]
            for rid in ids:
                engine.add_request(rid, prompt(ctx), SamplingParams(max_tokens=reps + 3,
                                                                    ignore_eos=True))
            started: set[str] = set()
            while len(started) < b:  # prefills (several steps for the big batches)
                started.update(o.req_id for o in engine.step() if o.prefill_done)
            engine.step()  # the first step with every request decoding
            ts = []
            for _ in range(reps):
                t0 = time.thread_time()
                engine.step()
                ts.append(time.thread_time() - t0)
            while engine.has_unfinished():
                engine.step()
            decode.append({"batch": b, "context": ctx, "s": statistics.median(ts)})
            log(f"decode batch {b:3d} at {ctx:5d} tokens: {decode[-1]['s'] * 1e3:8.1f} ms")
    cfg = engine.model.config
    heads = int(getattr(cfg, "num_key_value_heads", cfg.num_attention_heads))
    head_dim = int(getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads))
    itemsize = engine.pool.kv_tensor().element_size()
    return {
        "model": model, "dtype": str(engine.dtype).removeprefix("torch."),
        "num_params": float(sum(p.numel() for p in engine.model.parameters())),
        "num_layers": int(cfg.num_hidden_layers), "hidden": int(cfg.hidden_size),
        "kv_bytes_per_token": 2 * int(cfg.num_hidden_layers) * heads * head_dim * itemsize,
        "weight_bytes": float(sum(p.numel() * p.element_size()
                                  for p in engine.model.parameters())),
        "prefill": prefill, "decode": decode,
    }


def fit(m: dict[str, Any]) -> dict[str, float]:
    """Cost-model constants from :func:`measure`'s points (same formulas as CostModel)."""
    dense = 2.0 * m["num_params"]
    attn = 4.0 * m["num_layers"] * m["hidden"]

    def flops(new: int, cached: int) -> float:
        return dense * new + attn * new * (cached + new / 2)

    pts = m["prefill"]
    overhead, slope = _fit_line([flops(p["new"], p["cached"]) for p in pts],
                                [p["s"] for p in pts])
    rate = 1.0 / slope
    # Decode: overhead + max(bytes / bandwidth, compute), the cost model's own form; the
    # bandwidth on a log grid, the overhead the median residual, least relative error.
    kv = m["kv_bytes_per_token"]
    pts = [(m["weight_bytes"] + p["batch"] * p["context"] * kv, dense * p["batch"] / rate, p["s"])
           for p in m["decode"]]
    best = None
    for i in range(241):
        bw = 1e8 * 10 ** (i / 60)  # 0.1 to 1,000 GB/s
        o = max(statistics.median(t - max(b / bw, c) for b, c, t in pts), 0.0)
        err = sum(((o + max(b / bw, c)) / t - 1) ** 2 for b, c, t in pts)
        if best is None or err < best[0]:
            best = (err, bw, o)
    _, bw, d_overhead = best
    return {"prefill_overhead_s": max(overhead, 0.0), "flops_rate": rate,
            "decode_overhead_s": d_overhead, "mem_bw": bw}


def run(args: argparse.Namespace) -> int:
    from engine.prepare_model import default_model_path, is_prepared

    model = args.model or str(default_model_path())
    if args.model is None and not is_prepared(Path(model)):
        print("calibrate: no default model; run `tierserve prepare-model` first", file=sys.stderr)
        return 2
    m = measure(model, args.dtype, args.reps)
    f = fit(m)
    print(f"prefill: {f['prefill_overhead_s'] * 1e3:.1f} ms + flops / "
          f"{f['flops_rate'] / 1e9:.1f} GFLOP/s; decode: {f['decode_overhead_s'] * 1e3:.1f} ms + "
          f"bytes / {f['mem_bw'] / 1e9:.1f} GB/s")
    if args.json:
        args.json.write_text(json.dumps({"measured": m, "fit": f}, indent=2))
        print(f"wrote {args.json}")
    return 0
