"""Greedy output is token-identical to transformers' generate (same model, same dtype).

Three families, batch 1..16, prefill chunks of 16 and 64, with and without prefix-cache hits,
after swap-out/swap-in or recompute in the middle of decoding, and under pool pressure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams, StepOutput
from engine.testing import FAMILIES

MAX_TOKENS = 20
LENGTHS = [3, 17, 33, 64, 70, 100, 5, 48, 16, 31, 90, 12, 7, 55, 80, 41]


def make_prompts(seed: int, lengths: list[int], prefix: list[int] | None = None) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    head = prefix or []
    return [head + torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


PROMPTS = make_prompts(1, LENGTHS)
SHARED = make_prompts(2, [50])[0]
PREFIXED = make_prompts(3, [1, 9, 20, 30, 14], prefix=SHARED)


class Reference:
    """transformers' generate, one prompt at a time (no padding), memoized."""

    def __init__(self, path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        key = (*prompt, -max_tokens)
        if key not in self.cache:
            with torch.inference_mode():
                out = self.model.generate(
                    torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                    pad_token_id=self.model.config.pad_token_id,
                )
            self.cache[key] = out[0, len(prompt) :].tolist()
        return self.cache[key]


@pytest.fixture(scope="module")
def references(tiny_checkpoints: dict[str, Path]) -> dict[str, Reference]:
    return {family: Reference(path) for family, path in tiny_checkpoints.items()}


def make_engine(path: Path, **overrides) -> LLMEngine:
    settings = dict(model=str(path), dtype="float32", num_kv_blocks=256, prefill_chunk_size=16)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


GREEDY = SamplingParams(max_tokens=MAX_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_batched_chunked_greedy_matches_generate(
    tiny_checkpoints, references, family: str, chunk: int, batch: int
) -> None:
    engine = make_engine(
        tiny_checkpoints[family], prefill_chunk_size=chunk, max_num_batched_tokens=max(chunk, 64)
    )
    prompts = PROMPTS[5 : 5 + batch] if batch == 1 else PROMPTS[:batch]
    outputs = engine.generate(prompts, GREEDY)
    assert outputs == [references[family](p) for p in prompts]
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.pool.check_integrity()


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_attention_path_matches_generate(tiny_checkpoints, references, family) -> None:
    """Without the native kernels (no compiler on the machine, or switched off), decodes
    take the torch path (grouped SDPA over gathered blocks): the same tokens."""
    engine = make_engine(tiny_checkpoints[family], native_kernels=False, prefill_chunk_size=16,
                         max_num_batched_tokens=64)
    assert not engine.runner.uses_kernel
    outputs = engine.generate(PROMPTS[:8], GREEDY)
    assert outputs == [references[family](p) for p in PROMPTS[:8]]
    prefixed = engine.generate(PREFIXED, GREEDY)
    assert prefixed == [references[family](p) for p in PREFIXED]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefix_cache_hits_give_identical_output(tiny_checkpoints, references, family) -> None:
    engine = make_engine(tiny_checkpoints[family])
    first = engine.generate(PREFIXED[:1], GREEDY)
    assert engine.num_prefix_hit_tokens == 0
    rest = engine.generate(PREFIXED[1:], GREEDY)
    # Every later prompt reuses at least the 3 full blocks of the shared 50-token prefix.
    assert engine.num_prefix_hit_tokens >= 3 * 16 * len(PREFIXED[1:])
    assert first + rest == [references[family](p) for p in PREFIXED]
    # A repeated prompt hits up to its last full block and still matches.
    again = engine.generate(PREFIXED[2:3], GREEDY)
    assert again == [references[family](PREFIXED[2])]
    engine.pool.check_integrity()


def run_with_interruption(engine: LLMEngine, prompts, action) -> list[list[int]]:
    """Step until every request decoded a few tokens, apply ``action``, run to completion."""
    ids = [f"r{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(req_id, prompt, GREEDY)
    outputs: dict[str, list[int]] = {i: [] for i in ids}
    interrupted = False
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.req_id].extend(out.new_token_ids)
        if not interrupted and all(len(o) >= 5 for o in outputs.values()):
            for out in action(engine, ids):  # outputs of steps the action ran
                outputs[out.req_id].extend(out.new_token_ids)
            interrupted = True
    assert interrupted
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("family", FAMILIES)
def test_swap_out_and_in_mid_decode(tiny_checkpoints, references, family) -> None:
    engine = make_engine(tiny_checkpoints[family])
    prompts = PROMPTS[:6]

    def swap(engine: LLMEngine, ids: list[str]) -> list[StepOutput]:
        free_before = engine.num_free_blocks
        assert engine.swap_out(ids[1]) and engine.swap_out(ids[4])
        assert engine.num_free_blocks > free_before
        assert not engine.swap_out(ids[1])  # already swapped
        meanwhile = engine.step()  # the others keep decoding
        assert {o.req_id for o in meanwhile}.isdisjoint({ids[1], ids[4]})
        assert engine.swap_in(ids[4]) and engine.swap_in(ids[1])
        return meanwhile

    outputs = run_with_interruption(engine, prompts, swap)
    assert outputs == [references[family](p) for p in prompts]
    engine.pool.check_integrity()


@pytest.mark.parametrize("family", FAMILIES)
def test_recompute_preemption_mid_decode(tiny_checkpoints, references, family) -> None:
    engine = make_engine(tiny_checkpoints[family])
    prompts = PROMPTS[:4]

    def preempt(engine: LLMEngine, ids: list[str]) -> list[StepOutput]:
        assert engine.preempt_recompute(ids[0])
        assert engine.swap_out(ids[2]) and engine.preempt_recompute(ids[2])
        return []

    outputs = run_with_interruption(engine, prompts, preempt)
    assert outputs == [references[family](p) for p in prompts]


def test_pool_pressure_preempts_and_still_matches(tiny_checkpoints, references) -> None:
    # 24 blocks of 16 tokens cannot hold 8 of these requests at once.
    engine = make_engine(tiny_checkpoints["llama"], num_kv_blocks=24)
    prompts = PROMPTS[2:10]
    outputs = engine.generate(prompts, GREEDY)
    assert engine.num_preemptions > 0
    assert outputs == [references["llama"](p) for p in prompts]
    assert engine.num_free_blocks == engine.num_total_blocks


def test_prefill_chunks_and_decodes_share_a_forward(tiny_checkpoints, references) -> None:
    engine = make_engine(tiny_checkpoints["qwen2"], prefill_chunk_size=16)
    engine.add_request("short", PROMPTS[0], GREEDY)
    short: list[int] = []
    while len(short) < 3:
        for out in engine.step():
            short.extend(out.new_token_ids)
    engine.add_request("long", PROMPTS[5], GREEDY)  # 100 tokens: 7 chunks of 16
    outs = {o.req_id: o for o in engine.step()}
    assert outs["short"].new_token_ids and not outs["long"].new_token_ids
    assert outs["long"].num_computed_tokens == 16
    short.extend(outs["short"].new_token_ids)
    long: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            (short if out.req_id == "short" else long).extend(out.new_token_ids)
    assert short == references["qwen2"](PROMPTS[0])
    assert long == references["qwen2"](PROMPTS[5])


@pytest.mark.parametrize("family", FAMILIES)
def test_disaggregated_prefill_then_decode_elsewhere(tiny_checkpoints, references, family) -> None:
    prefill = make_engine(tiny_checkpoints[family])
    decode = make_engine(tiny_checkpoints[family])
    prompts = PROMPTS[3:6]
    bs = prefill.pool.block_size
    streamed: dict[str, list[int]] = {}
    first: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"p{i}", prompt, GREEDY, prefill_only=True)
    while prefill.has_unfinished():
        for out in prefill.step():
            streamed.setdefault(out.req_id, []).extend(out.ready_block_ids)
            if out.prefill_done:
                first[out.req_id] = out.new_token_ids[0]
    results = []
    for i, prompt in enumerate(prompts):
        req_id = f"p{i}"
        # Every prompt block was reported ready exactly once, in block-table order.
        assert streamed[req_id] == prefill.block_ids(req_id)
        assert len(streamed[req_id]) == -(-len(prompt) // bs)
        reserved = decode.reserve(req_id, len(prompt), prompt_token_ids=prompt)
        assert reserved is not None
        skip = decode.num_reserved_cached_blocks(req_id)
        data = prefill.pool.read_blocks(streamed[req_id][skip:])
        decode.pool.write_blocks(reserved[skip:], data)
        prefill.release(req_id)
        decode.add_prefilled_request(req_id, prompt, first[req_id], GREEDY, reserved)
        tokens = [first[req_id]]
        while decode.has_unfinished():
            for out in decode.step():
                tokens.extend(out.new_token_ids)
        results.append(tokens)
    assert results == [references[family](p) for p in prompts]
    assert prefill.num_free_blocks == prefill.num_total_blocks
    assert decode.num_free_blocks == decode.num_total_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_flex_attention_path_matches_generate(tiny_checkpoints, references, family) -> None:
    """The CUDA path's attention (FlexAttention through the block tables of a layer-major
    pool), run here in FlexAttention's eager reference mode: the same tokens, with prefix
    hits, mixed decode/chunk steps, swap and recompute."""
    engine = make_engine(tiny_checkpoints[family], attention="flex", prefill_chunk_size=16,
                         max_num_batched_tokens=64)
    assert engine.runner.uses_flex and not engine.pool.block_major
    outputs = engine.generate(PROMPTS[:6], GREEDY)
    assert outputs == [references[family](p) for p in PROMPTS[:6]]
    prefixed = engine.generate(PREFIXED[:1], GREEDY) + engine.generate(PREFIXED[1:3], GREEDY)
    assert prefixed == [references[family](p) for p in PREFIXED[:3]]
    assert engine.num_prefix_hit_tokens > 0

    def swap(engine: LLMEngine, ids: list[str]) -> list[StepOutput]:
        assert engine.swap_out(ids[1]) and engine.preempt_recompute(ids[0])
        meanwhile = engine.step()
        assert engine.swap_in(ids[1])
        return meanwhile

    prompts = PROMPTS[6:9]
    assert run_with_interruption(engine, prompts, swap) == [references[family](p)
                                                            for p in prompts]
    assert engine.num_free_blocks == engine.num_total_blocks
    engine.pool.check_integrity()


def test_blocks_move_between_flex_and_paged_pools(tiny_checkpoints, references) -> None:
    """A block-major (CPU) prefill feeds a layer-major (CUDA-path) decode: blocks travel in
    the same block-major shape whatever the pools' order."""
    prefill = make_engine(tiny_checkpoints["llama"])
    decode = make_engine(tiny_checkpoints["llama"], attention="flex")
    prompt = PROMPTS[5]
    prefill.add_request("p", prompt, GREEDY, prefill_only=True)
    first = None
    while prefill.has_unfinished():
        for out in prefill.step():
            if out.prefill_done:
                first = out.new_token_ids[0]
    reserved = decode.reserve("p", len(prompt), prompt_token_ids=prompt)
    assert reserved is not None and first is not None
    decode.pool.write_blocks(reserved, prefill.pool.read_blocks(prefill.block_ids("p")))
    prefill.release("p")
    decode.add_prefilled_request("p", prompt, first, GREEDY, reserved)
    tokens = [first]
    while decode.has_unfinished():
        for out in decode.step():
            tokens.extend(out.new_token_ids)
    assert tokens == references["llama"](prompt)


def test_decode_graph_buffers_give_the_same_tokens(tiny_checkpoints, references) -> None:
    """The CUDA-graph runner's static buffers, padding (null block) and buckets, with the
    forward called on the buffers instead of a replay (no GPU here; the captured graphs
    are tested in test_gpu.py): the same tokens as generate."""
    engine = make_engine(tiny_checkpoints["qwen2"], attention="flex")
    engine.runner.enable_decode_graphs(max_batch=4, max_model_len=engine.max_model_len,
                                       capture=False)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    prompts = PROMPTS[:3] + PROMPTS[10:13]  # 6 requests: steps of 6 run eagerly, then 3..1
    outputs = engine.generate(prompts, GREEDY)
    assert outputs == [references["qwen2"](p) for p in prompts]
    assert graphs.num_runs > 0
    assert engine.num_free_blocks == engine.num_total_blocks
