"""Greedy equivalence of the engine with transformers' ``generate``, as
``tierserve bench-engine`` reports it: the full set (its ``equivalence`` section) and the
quick set that ``--peer`` runs end with (bench.engine_peer)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from bench.report import log


def bench_equivalence(model_path: Path) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    from bench.engine_baselines import sharegpt_prompts
    from engine.equivalence import (
        MODES,
        GenerateReference,
        engine_factory,
        random_prompts,
        run_case,
    )
    from engine.testing import FAMILIES, NUM_BYTE_TOKENS, make_tiny_checkpoint

    cases = []
    lengths = [3, 17, 33, 64, 70, 100, 5, 48, 16, 31, 90, 12, 7, 55, 80, 41]
    prompts = random_prompts(1, lengths, NUM_BYTE_TOKENS)
    shared = random_prompts(2, [50], NUM_BYTE_TOKENS)[0]
    with tempfile.TemporaryDirectory(prefix="tierserve-bench-") as tmp:
        for family in FAMILIES:
            path = str(make_tiny_checkpoint(family, Path(tmp) / family))
            make = engine_factory(path, "float32")
            ref_model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="sdpa"
            ).eval()
            reference = GenerateReference(ref_model)
            for batch in (1, 4, 16):
                for chunk in (16, 64):
                    for mode in MODES:
                        chosen = prompts[5:6] if batch == 1 else prompts[:batch]
                        if mode == "prefix":
                            chosen = [p[: max(1, len(p) // 3)] for p in chosen]
                        name = f"{family}-fp32-b{batch}-c{chunk}-{mode}"
                        cases.append(run_case(make, reference, chosen, name=name, chunk=chunk,
                                              mode=mode, max_tokens=24, shared_prefix=shared))
            passed = sum(c.passed for c in cases)
            log(f"equivalence: {family} done ({passed}/{len(cases)} cases pass so far)")
    # The real model: fp32 must be identical; bf16 agreement is reported.
    smol = {}
    for dtype in ("float32", "bfloat16"):
        make = engine_factory(str(model_path), dtype, num_kv_blocks=2048)
        torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        ref_model = AutoModelForCausalLM.from_pretrained(
            str(model_path), dtype=torch_dtype, attn_implementation="sdpa"
        ).eval()
        reference = GenerateReference(ref_model)
        tokenizer = make(64).tokenizer
        real_prompts = sharegpt_prompts(tokenizer, 8)
        results = []
        for chunk, mode in ((64, "plain"), (16, "plain"), (64, "swap"), (64, "prefix")):
            chosen = real_prompts if mode != "prefix" else [p[-20:] for p in real_prompts[:4]]
            prefix = real_prompts[0][:40] if mode == "prefix" else ()
            results.append(run_case(make, reference, chosen, name=f"smollm2-{dtype}-b{len(chosen)}"
                                    f"-c{chunk}-{mode}", chunk=chunk, mode=mode, max_tokens=32,
                                    shared_prefix=prefix))
        if dtype == "float32":
            cases.extend(results)
        else:
            smol = {"prompts_identical": sum(r.num_identical for r in results),
                    "prompts": sum(r.num_prompts for r in results),
                    "cases_identical": sum(r.passed for r in results), "cases": len(results),
                    "details": [r.to_dict() for r in results]}
        log(f"equivalence: smollm2 {dtype} done")
        del make, ref_model
    failed = [c.to_dict() for c in cases if not c.passed]
    return {
        "passed": not failed,
        "cases": len(cases),
        "cases_passed": len(cases) - len(failed),
        "failed": failed,
        "case_names": [c.name for c in cases],
        "smollm2_bf16_agreement": smol,
    }


def bench_equivalence_quick(model_path: Path) -> dict[str, object]:
    """The short form for --peer runs: tiny Llama/Qwen2/Mistral in fp32 at batch 16, chunk
    16, plain/prefix/swap, and SmolLM2-135M in fp32 on 8 ShareGPT prompts, against
    ``generate`` token for token."""
    from transformers import AutoModelForCausalLM

    from bench.engine_baselines import sharegpt_prompts
    from engine.equivalence import (
        MODES,
        GenerateReference,
        engine_factory,
        random_prompts,
        run_case,
    )
    from engine.testing import FAMILIES, NUM_BYTE_TOKENS, make_tiny_checkpoint

    lengths = [3, 17, 33, 64, 70, 100, 5, 48, 16, 31, 90, 12, 7, 55, 80, 41]
    prompts = random_prompts(1, lengths, NUM_BYTE_TOKENS)
    shared = random_prompts(2, [50], NUM_BYTE_TOKENS)[0]
    cases = []
    with tempfile.TemporaryDirectory(prefix="tierserve-bench-") as tmp:
        for family in FAMILIES:
            path = str(make_tiny_checkpoint(family, Path(tmp) / family))
            make = engine_factory(path, "float32")
            reference = GenerateReference(AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="sdpa").eval())
            for mode in MODES:
                chosen = [p[: max(1, len(p) // 3)] for p in prompts] if mode == "prefix" else prompts
                cases.append(run_case(make, reference, chosen, name=f"{family}-fp32-b16-c16-{mode}",
                                      chunk=16, mode=mode, max_tokens=24, shared_prefix=shared))
    make = engine_factory(str(model_path), "float32", num_kv_blocks=1024)
    reference = GenerateReference(AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, attn_implementation="sdpa").eval())
    real = sharegpt_prompts(make(64).tokenizer, 8)
    cases.append(run_case(make, reference, real, name="smollm2-fp32-b8-c64-plain", chunk=64,
                          mode="plain", max_tokens=32))
    failed = [c.to_dict() for c in cases if not c.passed]
    log(f"equivalence (quick): {len(cases) - len(failed)}/{len(cases)} cases pass")
    return {"passed": not failed, "cases": len(cases), "cases_passed": len(cases) - len(failed),
            "failed": failed, "case_names": [c.name for c in cases]}
