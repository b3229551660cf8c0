"""Greedy equivalence cases for bench-engine: the engine against transformers' ``generate``.

A case = (model, dtype, batch size, prefill chunk size, mode). Modes:
  * ``plain``: a batch of prompts of different lengths;
  * ``prefix``: one prompt first, then the batch, all sharing a 50-token prefix (cache hits
    are checked to happen);
  * ``swap``: every request decodes a few tokens, half of them are swapped out for a step and
    swapped back in, then all run to completion.
The reference is ``model.generate`` one prompt at a time (no padding), greedy, same dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.sampling import SamplingParams

MODES = ("plain", "prefix", "swap")


@dataclass(slots=True)
class CaseResult:
    name: str
    passed: bool
    num_prompts: int
    num_tokens: int
    num_identical: int = 0  # prompts whose output is identical
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "passed": self.passed,
            "num_prompts": self.num_prompts,
            "num_tokens": self.num_tokens,
            "num_identical": self.num_identical,
            "detail": self.detail,
        }


class GenerateReference:
    """Memoized ``model.generate`` outputs, one prompt at a time."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache: dict[tuple[int, ...], list[int]] = {}

    @torch.inference_mode()
    def __call__(self, prompt: Sequence[int], max_tokens: int) -> list[int]:
        key = (*prompt, -max_tokens)
        if key not in self.cache:
            ids = torch.tensor([list(prompt)], device=self.model.device)
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.model.generation_config.pad_token_id
                or self.model.config.pad_token_id
                or 0,
            )
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]


def run_case(
    make_engine: Callable[[int], LLMEngine],
    reference: GenerateReference,
    prompts: Sequence[Sequence[int]],
    *,
    name: str,
    chunk: int,
    mode: str,
    max_tokens: int,
    shared_prefix: Sequence[int] = (),
) -> CaseResult:
    engine = make_engine(chunk)
    params = SamplingParams(max_tokens=max_tokens)
    detail = ""
    if mode == "plain":
        outputs = engine.generate(prompts, params)
    elif mode == "prefix":
        prompts = [list(shared_prefix) + list(p) for p in prompts]
        outputs = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
        if len(prompts) > 1 and engine.num_prefix_hit_tokens == 0:
            detail = "no prefix-cache hit happened"
    elif mode == "swap":
        outputs = _run_with_swap(engine, prompts, params)
    else:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    expected = [reference(p, max_tokens) for p in prompts]
    mismatches = [i for i, (a, b) in enumerate(zip(outputs, expected, strict=True)) if a != b]
    if mismatches:
        detail = (detail + "; " if detail else "") + f"prompts {mismatches} differ"
    return CaseResult(
        name=name,
        passed=not detail,
        num_prompts=len(prompts),
        num_tokens=sum(len(o) for o in outputs),
        num_identical=len(prompts) - len(mismatches),
        detail=detail,
    )


def _run_with_swap(
    engine: LLMEngine, prompts: Sequence[Sequence[int]], params: SamplingParams
) -> list[list[int]]:
    ids = [f"s{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(req_id, prompt, params)
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    finished: set[str] = set()
    swapped: list[str] = []
    done_swap = False
    while engine.has_unfinished() or swapped:
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.req_id)
        if swapped:
            for req_id in swapped:
                if not engine.swap_in(req_id):
                    raise RuntimeError(f"swap_in({req_id}) found no room")
            swapped = []
        elif not done_swap and all(len(o) >= 3 or i in finished for i, o in outputs.items()):
            swapped = [i for i in ids[::2] if i not in finished and engine.swap_out(i)]
            done_swap = True
    return [outputs[i] for i in ids]


def random_prompts(seed: int, lengths: Sequence[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def engine_factory(path: str, dtype: str, **overrides) -> Callable[[int], LLMEngine]:
    """An engine per case (fresh pool), sharing one loaded model per factory."""
    from engine.model_loader import load_model

    model, tokenizer = load_model(path, dtype=dtype)

    def make(chunk: int) -> LLMEngine:
        settings = dict(
            model=path,
            dtype=dtype,
            num_kv_blocks=1024,
            prefill_chunk_size=chunk,
            max_num_batched_tokens=max(256, chunk),
        )
        settings.update(overrides)
        return LLMEngine(EngineConfig(**settings), model=model, tokenizer=tokenizer)

    make.model = model  # type: ignore[attr-defined]
    return make
