"""`tierserve bench-engine --device cuda`: the CUDA path on a GPU, on a 1B-scale Llama.

No model hub is reachable from the GPU machines, so the model is a Llama-architecture
checkpoint with random weights, shaped like Llama 3.2 1B (16 layers, hidden 2048, 32 query
and 8 KV heads of 64, MLP 8192, vocab 128,256, tied embeddings), written once under the
cache folder (``--model`` takes any other checkpoint). Random weights make the tokens
meaningless, not the time: prompts are random token ids, EOS is ignored.

Three variants of the same engine, one after the other on the same GPU, each warmed first:

    flex+graphs   the default: FlexAttention through block tables, decode steps replayed
                  from CUDA graphs
    flex          the same without graphs (cuda_graph_max_batch=0)
    paged         the block-major torch path (gathered SDPA), the reference

For each: decode tok/s and time per step at batch 1, 16 and 64 (prompts of --context
tokens, --decode-tokens new ones), prefill tok/s of one --prefill-tokens prompt. Plus
greedy equivalence of the CUDA path against ``generate`` in float32 on the tiny Llama,
Qwen2 and Mistral test models (token for token), and the bf16 agreement of flex with paged
on the 1B model. Writes JSON (--json).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.report import write_report

VARIANTS = {
    "flex+graphs": {"attention": "flex"},
    "flex": {"attention": "flex", "cuda_graph_max_batch": 0},
    "paged": {"attention": "paged"},
}
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                max_position_embeddings=8192, rope_theta=500000.0, tie_word_embeddings=True,
                rms_norm_eps=1e-5, bos_token_id=256, eos_token_id=257, pad_token_id=258)


def log(message: str) -> None:
    print(f"[bench-engine cuda {time.strftime('%H:%M:%S')}] {message}", flush=True)


def random_llama_1b(directory: Path) -> Path:
    """A random-weight Llama of 1B scale (bf16 safetensors) and the byte tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from engine.testing import make_byte_tokenizer

    if (directory / "config.json").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    log(f"writing a random-weight 1B Llama to {directory}")
    config = LlamaConfig(**LLAMA_1B, initializer_range=0.02)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    make_byte_tokenizer().save_pretrained(directory)
    return directory


def _engine(model: Path, device: str, dtype: str, variant: str, num_blocks: int):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    settings = dict(model=str(model), dtype=dtype, device=device, num_kv_blocks=num_blocks,
                    max_num_seqs=64, prefill_chunk_size=4096, max_num_batched_tokens=4096)
    settings.update(VARIANTS[variant])
    return LLMEngine(EngineConfig(**settings))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(engine, device: str, batches: list[int], context: int, decode_tokens: int,
            prefill_tokens: int, vocab: int) -> dict[str, object]:
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(0)
    result: dict[str, object] = {"decode": {}}
    for batch in batches:
        prompts = [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
        ids = [f"d{batch}-{i}" for i in range(batch)]
        for rid, prompt in zip(ids, prompts, strict=True):
            engine.add_request(rid, prompt, params)
        while any(engine.num_computed_tokens(r) < context for r in ids):
            engine.step()  # prefill (and the first token)
        _sync(device)
        steps, tokens = 0, 0
        started = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                tokens += len(out.new_token_ids)
            steps += 1
        _sync(device)
        elapsed = time.perf_counter() - started
        result["decode"][str(batch)] = {
            "tok_s": round(tokens / elapsed, 1), "step_ms": round(elapsed / steps * 1e3, 3),
            "steps": steps}
        log(f"  decode batch {batch}: {tokens / elapsed:.0f} tok/s, "
            f"{elapsed / steps * 1e3:.2f} ms a step")
    best = float("inf")
    for rep in range(3):  # a new prompt each time: no prefix-cache hit
        prompt = torch.randint(0, vocab, (prefill_tokens,), generator=g).tolist()
        engine.add_request(f"p{rep}", prompt, SamplingParams(max_tokens=1))
        _sync(device)
        started = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        _sync(device)
        best = min(best, time.perf_counter() - started)
    result["prefill"] = {"tokens": prefill_tokens, "s": round(best, 4),
                         "tok_s": round(prefill_tokens / best, 1)}
    log(f"  prefill {prefill_tokens}: {prefill_tokens / best:.0f} tok/s")
    graphs = getattr(engine.runner, "graphs", None)
    result["graph_replays"] = 0 if graphs is None else graphs.num_runs
    return result


def equivalence(device: str) -> dict[str, object]:
    """Greedy tokens of the CUDA path vs ``generate`` (float32, tiny models)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling import SamplingParams
    from engine.testing import FAMILIES, make_tiny_checkpoint

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 40, 70, 100)]
    cases, failed = 0, []
    with tempfile.TemporaryDirectory() as root:
        for family in FAMILIES:
            path = make_tiny_checkpoint(family, Path(root) / family)
            ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
            expected = []
            for p in prompts:
                with torch.inference_mode():
                    out = ref.generate(torch.tensor([p], device=device), max_new_tokens=24,
                                       do_sample=False, pad_token_id=258)
                expected.append(out[0, len(p):].tolist())
            for variant in VARIANTS:
                settings = dict(model=str(path), dtype="float32", device=device,
                                num_kv_blocks=256, prefill_chunk_size=32)
                settings.update(VARIANTS[variant])
                engine = LLMEngine(EngineConfig(**settings))
                got = engine.generate(prompts, SamplingParams(max_tokens=24))
                cases += 1
                if got != expected:
                    failed.append(f"{family}/{variant}")
    return {"cases": cases, "failed": failed, "passed": not failed}


def run_cuda(args: argparse.Namespace) -> int:
    from engine.prepare_model import cache_root

    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        log("no CUDA device: nothing to measure (this bench is for a GPU machine)")
        return 2
    model = Path(args.model) if args.model else random_llama_1b(
        cache_root() / "models" / "random-llama-1b")
    dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    batches = [int(b) for b in args.decode_batches.split(",") if b]
    report: dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
        "torch": torch.__version__, "model": str(model), "dtype": dtype,
        "context": args.context, "decode_tokens": args.decode_tokens,
    }
    if "equivalence" not in args.skip:
        log("equivalence: tiny models, float32, every variant vs generate")
        report["equivalence"] = equivalence(device)
        log(f"  {report['equivalence']}")
    variants: dict[str, object] = {}
    first_tokens: dict[str, list[int]] = {}
    for variant in VARIANTS:
        log(f"{variant}: starting (compiles and captures first)")
        started = time.perf_counter()
        engine = _engine(model, device, dtype, variant, args.num_kv_blocks)
        vocab = int(engine.model.config.vocab_size)
        start_s = time.perf_counter() - started
        from engine.sampling import SamplingParams

        probe = torch.randint(0, vocab, (64,), generator=torch.Generator().manual_seed(9)).tolist()
        first_tokens[variant] = engine.generate([probe], SamplingParams(max_tokens=32,
                                                                        ignore_eos=True))[0]
        result = measure(engine, device, batches, args.context, args.decode_tokens,
                         args.prefill_tokens, vocab)
        result["start_s"] = round(start_s, 1)
        variants[variant] = result
        del engine
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    report["variants"] = variants
    agree = [sum(a == b for a, b in zip(first_tokens[v], first_tokens["paged"], strict=True))
             / len(first_tokens["paged"]) for v in VARIANTS]
    report["bf16_agreement_with_paged"] = dict(zip(VARIANTS, agree, strict=True))
    write_report(report, args.json, log)
    return 0
