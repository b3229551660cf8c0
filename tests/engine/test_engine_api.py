"""Engine API: bad input, stop conditions, sampling, logprobs, events, abort, loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config

from engine import (
    BlockStored,
    EngineConfig,
    EngineSettingError,
    FinishReason,
    LLMEngine,
    PromptTooLong,
    SamplingParams,
    UnsupportedArchitecture,
    compute_block_hashes,
    load_model,
)


def make_engine(path: Path, **overrides) -> LLMEngine:
    settings = dict(model=str(path), dtype="float32", num_kv_blocks=64, prefill_chunk_size=16)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def engine(tiny_checkpoints) -> LLMEngine:
    return make_engine(tiny_checkpoints["llama"], max_model_len=200)


def run(engine: LLMEngine, req_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(req_id, prompt, params)
    tokens: list[int] = []
    logprobs: list[float] = []
    last = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.req_id == req_id:
                tokens.extend(out.new_token_ids)
                logprobs.extend(out.logprobs)
                last = out
    assert last is not None and last.finished
    return tokens, logprobs, last


def test_prompt_too_long_is_refused_before_allocating(engine: LLMEngine) -> None:
    free = engine.num_free_blocks
    with pytest.raises(PromptTooLong, match="context"):
        engine.add_request("long", [1] * 200, SamplingParams())
    assert engine.num_free_blocks == free and not engine.has_unfinished()
    small_pool = make_engine(engine.config.model, num_kv_blocks=2)
    with pytest.raises(PromptTooLong, match="KV pool"):
        small_pool.add_request("x", [1] * 40, SamplingParams())
    with pytest.raises(PromptTooLong):
        small_pool.reserve("z", 40)


def test_bad_requests_are_value_errors(engine: LLMEngine) -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(top_k=-2)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request("v", [10_000], SamplingParams())
    engine.add_request("dup", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already"):
        engine.add_request("dup", [1, 2], SamplingParams())
    engine.abort("dup")
    engine.abort("never-added")  # ignored
    assert not engine.has_unfinished()
    with pytest.raises(ValueError):
        EngineConfig(model="x", dtype="float16")
    with pytest.raises(ValueError):
        EngineConfig(model="x", block_size=0)


def test_unsupported_architecture_names_it(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedArchitecture) as info:
        load_model(tmp_path)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message
    assert "Qwen2ForCausalLM" in message and "MistralForCausalLM" in message


def test_settings_the_device_cannot_honour_name_the_setting(tiny_checkpoints) -> None:
    path = str(tiny_checkpoints["llama"])
    with pytest.raises(EngineSettingError, match="^dtype: float16 does not run on cpu"):
        EngineConfig(model=path, dtype="float16")
    with pytest.raises(EngineSettingError, match="^dtype: 'int8' is not one of"):
        EngineConfig(model=path, dtype="int8")
    with pytest.raises(EngineSettingError, match=r"^kv_cache_bytes: .* GiB asked, more than"):
        LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_bytes=2**50))
    with pytest.raises(EngineSettingError, match="^kv_cache_bytes: .*holds no block") as info:
        LLMEngine(EngineConfig(model=path, dtype="float32", kv_cache_bytes=100))
    assert info.value.setting == "kv_cache_bytes"
    if not torch.cuda.is_available():
        with pytest.raises(EngineSettingError, match="^device: cuda asked, but torch sees no"):
            LLMEngine(EngineConfig(model=path, device="cuda"))


def test_max_tokens_and_stop_conditions(engine: LLMEngine) -> None:
    prompt = list(b"hello world")
    greedy, _, last = run(engine, "a", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(greedy) == 12 and last.finish_reason is FinishReason.LENGTH
    assert last.finish_reason == "length"
    # Stop at the 4th greedy token given as a stop token id.
    stop_at = greedy[3]
    first = greedy.index(stop_at)
    tokens, _, last = run(
        engine, "b", prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_at,))
    )
    assert tokens == greedy[: first + 1]
    assert last.finish_reason == "stop" and last.stop_reason == stop_at
    # A stop string made of the decoded 5th and 6th tokens.
    text = engine.tokenizer.decode(greedy[4:6])
    if text.strip():
        tokens, _, last = run(engine, "c", prompt, SamplingParams(max_tokens=12, stop=(text,)))
        assert last.finish_reason == "stop" and last.stop_reason == text
        assert text in engine.tokenizer.decode(tokens) and len(tokens) <= 6


def test_eos_stops_unless_ignored(tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    prompt = list(b"abc")
    greedy = make_engine(path).generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    # The same model whose generation config names the 3rd greedy token as EOS.
    model, tokenizer = load_model(path, dtype="float32")
    model.generation_config.eos_token_id = [greedy[2]]
    engine = LLMEngine(
        EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64),
        model=model,
        tokenizer=tokenizer,
    )
    tokens, _, last = run(engine, "eos", prompt, SamplingParams(max_tokens=8))
    assert tokens == greedy[: greedy.index(greedy[2]) + 1]
    assert last.finish_reason == "stop" and last.stop_reason == greedy[2]
    tokens, _, last = run(engine, "ign", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    assert tokens == greedy and last.finish_reason == "length"


def test_logprobs_match_the_model(tiny_checkpoints, engine: LLMEngine) -> None:
    prompt = list(b"the quick brown fox")
    tokens, logprobs, _ = run(
        engine, "lp", prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True)
    )
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["llama"]), dtype=torch.float32)
    with torch.inference_mode():
        logits = ref(torch.tensor([prompt + tokens])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(
        1, torch.tensor(tokens).unsqueeze(1)
    )
    assert [lp.token_id for lp in logprobs] == tokens
    got = torch.tensor([lp.logprob for lp in logprobs])
    assert torch.allclose(got, expected.squeeze(1), atol=1e-4)
    no_lp, lps, _ = run(engine, "nolp", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    assert no_lp == tokens and lps == []


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = engine.generate([list(b"sample me")], params)[0]
    batched = engine.generate(
        [list(b"other"), list(b"sample me"), list(b"third one")],
        [SamplingParams(max_tokens=5, temperature=1.0), params, SamplingParams(max_tokens=3)],
    )[1]
    assert alone == batched
    other_seed = engine.generate(
        [list(b"sample me")],
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=8, ignore_eos=True),
    )[0]
    assert other_seed != alone  # 10 tokens from 259 choices: equal only by a fluke


def test_top_k_one_and_tiny_top_p_are_greedy(engine: LLMEngine) -> None:
    prompt = list(b"greedy?")
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    k1 = SamplingParams(max_tokens=8, temperature=1.5, top_k=1, seed=1, ignore_eos=True)
    p0 = SamplingParams(max_tokens=8, temperature=1.5, top_p=1e-6, seed=2, ignore_eos=True)
    assert engine.generate([prompt, prompt], [k1, p0]) == [greedy, greedy]


def test_block_events_mirror_the_cache(tiny_checkpoints) -> None:
    engine = make_engine(tiny_checkpoints["mistral"], num_kv_blocks=8)
    engine.drain_events()
    prompt = list(range(40))
    tokens, _, _ = run(engine, "ev", prompt, SamplingParams(max_tokens=9, ignore_eos=True))
    events = engine.drain_events()
    stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
    expected = compute_block_hashes(prompt + tokens, engine.pool.block_size)
    # Every full block of prompt + output (but the last token's, never computed) is published.
    assert stored == expected[: (len(prompt) + len(tokens) - 1) // 16]
    assert events[0].to_dict()["type"] == "stored" and events[0].parent_hash is None
    # Filling the pool with other prompts evicts them and reports the removals.
    engine.generate([list(range(100, 220))], SamplingParams(max_tokens=2, ignore_eos=True))
    removed = [e for e in engine.drain_events() if e.to_dict()["type"] == "removed"]
    assert removed and set(removed[0].block_hashes) <= set(stored)


def test_abort_frees_blocks_in_every_state(tiny_checkpoints) -> None:
    engine = make_engine(tiny_checkpoints["qwen2"])
    total = engine.num_total_blocks
    engine.add_request("w", list(range(30)), SamplingParams(max_tokens=50))
    engine.add_request("r", list(range(30)), SamplingParams(max_tokens=50))
    engine.add_request("s", list(range(50, 90)), SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.swap_out("s")
    reserved = engine.reserve("res", 40)
    assert reserved is not None and len(reserved) == 3
    for req_id in ("w", "r", "s", "res"):
        engine.abort(req_id)
    assert engine.num_free_blocks == total and not engine.has_unfinished()
    engine.pool.check_integrity()


def test_reserve_is_all_or_nothing(tiny_checkpoints) -> None:
    engine = make_engine(tiny_checkpoints["llama"], num_kv_blocks=4)
    assert engine.reserve("a", 48) is not None
    assert engine.reserve("b", 32) is None  # 2 blocks asked, 1 left
    assert engine.num_free_blocks == 1
    with pytest.raises(ValueError, match="reservation"):
        engine.add_prefilled_request("b", [1] * 32, 5, SamplingParams(), [0, 1])
    engine.release("a")
    assert engine.num_free_blocks == 4


def test_run_plan_runs_exactly_the_plan_and_matches_the_engines_own_steps(
        tiny_checkpoints) -> None:
    """A caller-composed step (scheduler.step_planner's plans) runs what it names, in
    chunks of its choosing, refuses what cannot run, and gives the same greedy tokens as
    the engine's own schedule."""
    path = tiny_checkpoints["llama"]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = {"a": list(range(3, 40)), "b": list(range(50, 61))}
    ref = make_engine(path).generate(list(prompts.values()), greedy)
    eng = make_engine(path)
    for rid, p in prompts.items():
        eng.add_request(rid, p, greedy)
    assert eng.admit("b") and eng.num_free_blocks < 64  # blocks held at once
    out: dict[str, list[int]] = {"a": [], "b": []}
    # Step 1: only b's prompt (a waits: not in the plan); step 2: a's first chunk while
    # b decodes; then a's rest; then both decode.
    plans = [([], [("b", 11)]), (["b"], [("a", 20)]), (["b"], [("a", 17)])]
    for decodes, chunks in plans:
        outs, refused = eng.run_plan(decodes, chunks)
        assert refused == []
        for o in outs:
            out[o.req_id].extend(o.new_token_ids)
    assert len(out["b"]) == 3 and len(out["a"]) == 1
    while len(out["a"]) < 6 or len(out["b"]) < 6:
        live = [r for r in ("a", "b") if len(out[r]) < 6]
        outs, refused = eng.run_plan(live, [])
        assert refused == []
        for o in outs:
            out[o.req_id].extend(o.new_token_ids)
    assert [out["a"], out["b"]] == ref
    # Unknown ids, a decode of a finished request and an empty chunk are refused.
    _, refused = eng.run_plan(["a", "nope"], [("b", 0), ("zz", 5)])
    assert refused == ["a", "nope", "b", "zz"]


def test_a_sequence_ends_with_length_where_the_whole_pool_is_full(tiny_checkpoints) -> None:
    """The longest sequence served is no longer than the pool holds (4 blocks of 16
    tokens here): a request that would outgrow it ends with "length" there, as at the
    model's context, rather than being preempted and never placed again (the
    checker's starvation counterexamples of issue 23)."""
    engine = make_engine(tiny_checkpoints["llama"], num_kv_blocks=4, max_model_len=200)
    assert engine.model_max_len == 200 and engine.max_model_len == 64
    engine.add_request("r", list(range(1, 41)), SamplingParams(max_tokens=100, ignore_eos=True))
    outs = []
    for _ in range(200):
        outs += engine.step()
        if not engine.has_unfinished():
            break
    last = [o for o in outs if o.req_id == "r"][-1]
    assert last.finished and last.finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outs if o.req_id == "r") == 64 - 40
    assert engine.num_free_blocks == engine.num_total_blocks
