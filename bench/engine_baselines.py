"""The transformers baselines bench-engine compares against, and the workload they share.

* ``sharegpt_prompts``: the first N ShareGPT prompts, chat template applied, natural lengths.
* ``run_generate_static``: ``model.generate`` over static batches (left padding, greedy).
* ``run_generate_batch``: transformers' continuous batching (``model.generate_batch``).
* ``time_plain_forward``: one plain ``model(input_ids)`` forward.
Each returns the generated token lists (EOS included, padding excluded) and the wall time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

# The ShareGPT prompts that ship with the project (traces/ at the repository root).
SHAREGPT = Path(__file__).resolve().parents[1] / "traces" / "sharegpt_v3_first_turn_500.json"


def sharegpt_prompts(tokenizer, num_prompts: int, path: Path = SHAREGPT) -> list[list[int]]:
    records = json.loads(path.read_text())
    prompts: list[list[int]] = []
    for record in records[:num_prompts]:
        text = record["conversations"][0]["value"]
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        prompts.append(list(ids))
    return prompts


def long_prompt(tokenizer, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of ShareGPT's opening turns, joined: one long prompt."""
    records = json.loads(SHAREGPT.read_text())
    ids: list[int] = []
    for record in records:
        ids.extend(tokenizer(record["conversations"][0]["value"]).input_ids)
        if len(ids) >= num_tokens:
            break
    return ids[:num_tokens]


def trim_generated(tokens: Sequence[int], eos_ids: set[int], pad_id: int | None) -> list[int]:
    """Generated tokens up to and including the first EOS (what the engine returns)."""
    out: list[int] = []
    for t in tokens:
        out.append(int(t))
        if t in eos_ids:
            break
    if pad_id is not None and pad_id not in eos_ids:
        while out and out[-1] == pad_id:
            out.pop()
    return out


def eos_ids_of(model) -> set[int]:
    value = model.generation_config.eos_token_id
    if value is None:
        value = model.config.eos_token_id
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


@torch.inference_mode()
def run_generate_static(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
    pad_id: int,
    log: Callable[[str], None] = print,
) -> tuple[list[list[int]], float]:
    eos = eos_ids_of(model)
    outputs: list[list[int]] = []
    started = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, p in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        gen = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
        for row in range(len(batch)):
            outputs.append(trim_generated(gen[row, width:].tolist(), eos, pad_id))
        log(f"  generate: {min(first + batch_size, len(prompts))}/{len(prompts)} prompts")
    return outputs, time.perf_counter() - started


@torch.inference_mode()
def run_generate_batch(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    pad_id: int,
    *,
    max_batch_tokens: int = 2048,
    max_requests: int = 64,
    kv_tokens: int = 32768,
) -> tuple[list[list[int]], float]:
    """transformers' continuous batching with the engine's limits: the same token budget per
    step, requests per batch and KV capacity (left alone, it sizes its cache from free memory,
    which on a CPU host means gigabytes)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    eos = eos_ids_of(model)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(eos) if eos else None,
        pad_token_id=pad_id,
    )
    page_size = 256
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=max(1, kv_tokens // page_size),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
    )
    started = time.perf_counter()
    result = model.generate_batch(
        inputs=[list(p) for p in prompts],
        generation_config=config,
        continuous_batching_config=cb_config,
    )
    elapsed = time.perf_counter() - started
    by_index: dict[int, list[int]] = {}
    for req_id, out in result.items():
        by_index[int(str(req_id).rsplit("_", 1)[-1])] = trim_generated(
            out.generated_tokens, eos, None
        )
    return [by_index[i] for i in range(len(prompts))], elapsed


@torch.inference_mode()
def time_plain_forward(model, prompt: Sequence[int], repeats: int) -> float:
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        best = min(best, time.perf_counter() - started)
    return best
