"""The new sampling parameters through the engine: neutral values change no greedy token,
prompt log-probabilities, and n sequences on shared (copy-on-write) blocks, through swaps,
the disaggregated hand-over and both pool layouts."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.grammar import Grammar, GrammarKind
from engine.testing import make_tiny_checkpoint

PROMPT = list(b"the quick brown fox jumps over")  # 30 tokens: a partial last block


def make_engine(path: Path, **overrides) -> LLMEngine:
    settings = dict(model=str(path), dtype="float32", num_kv_blocks=128, prefill_chunk_size=32)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    return AutoModelForCausalLM.from_pretrained(str(tiny_checkpoints["llama"]),
                                                dtype=torch.float32).eval()


def raw_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the model's logits at every position (row j predicts token j+1)."""
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)


def check_logprobs(model, prompt: list[int], out_tokens: list[int], lps) -> None:
    """The engine's log-probability of each output token is the model's on the same text:
    the sequence attended to its own KV (no other sequence's writes leaked in)."""
    expected = raw_logprobs(model, prompt + out_tokens)[len(prompt) - 1 : -1]
    got = torch.tensor([lp.logprob for lp in lps])
    want = expected.gather(1, torch.tensor(out_tokens).unsqueeze(1)).squeeze(1)
    assert torch.allclose(got, want, atol=1e-4), (got, want)


def run_all(engine: LLMEngine, reqs: dict[str, tuple[list[int], SamplingParams]]):
    """Outputs per request and sequence: tokens and logprobs; the pool's peak use."""
    for rid, (prompt, params) in reqs.items():
        engine.add_request(rid, prompt, params)
    tokens = {rid: [[] for _ in range(p.n)] for rid, (_, p) in reqs.items()}
    lps = {rid: [[] for _ in range(p.n)] for rid, (_, p) in reqs.items()}
    peak = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert out.error is None
            tokens[out.req_id][out.seq] += out.new_token_ids
            lps[out.req_id][out.seq] += out.logprobs
        peak = max(peak, engine.num_total_blocks - engine.num_free_blocks)
    engine.pool.check_integrity()
    assert engine.num_free_blocks == engine.num_total_blocks
    return tokens, lps, peak


def test_neutral_parameters_change_no_greedy_token(tiny_checkpoints) -> None:
    engine = make_engine(tiny_checkpoints["qwen2"])
    prompts = [PROMPT, list(b"hello there"), list(b"x" * 40)]
    plain = engine.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    neutral = SamplingParams(max_tokens=12, ignore_eos=True, top_k=-1, top_p=1.0, min_p=0.0,
                             presence_penalty=0.0, frequency_penalty=0.0,
                             repetition_penalty=1.0, min_tokens=0, logit_bias=(), seed=3,
                             n=1)
    assert engine.generate(prompts, neutral) == plain
    # asking for logprobs, or a bias of 0, changes no choice either
    with_lp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=2,
                             logit_bias=((65, 0.0),))
    assert engine.generate(prompts, with_lp) == plain


def test_prompt_logprobs_match_the_model_and_skip_the_cache(tiny_checkpoints,
                                                            reference) -> None:
    engine = make_engine(tiny_checkpoints["llama"], prefill_chunk_size=8)
    prompt = PROMPT + list(b" the lazy dog")
    engine.generate([prompt], SamplingParams(max_tokens=2))  # its blocks are now cached
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=3))
    got = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.prefill_done:
                got = out
    assert got is not None and got.num_cached_tokens == 0
    assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(prompt) - 1
    expected = raw_logprobs(reference, prompt)[:-1]
    for j, lp in enumerate(got.prompt_logprobs):
        assert lp.token_id == prompt[j + 1]
        assert lp.logprob == pytest.approx(float(expected[j, prompt[j + 1]]), abs=1e-4)
        assert lp.top_token_ids == expected[j].topk(3).indices.tolist()
    engine.add_request("q", prompt, SamplingParams(max_tokens=1))
    hits = []
    while engine.has_unfinished():
        hits += [o for o in engine.step() if o.prefill_done]
    assert hits[0].num_cached_tokens == 32  # two full blocks from the cache


@pytest.mark.parametrize("attention", [
    "paged", pytest.param("flex", marks=pytest.mark.slow)])  # flex on CPU: the eager reference
def test_n_sequences_share_the_prompt_and_copy_its_last_block(tiny_checkpoints, reference,
                                                              attention: str) -> None:
    engine = make_engine(tiny_checkpoints["llama"], attention=attention, block_size=16)
    n4 = SamplingParams(max_tokens=20, temperature=1.0, seed=11, n=4, logprobs=0,
                        ignore_eos=True)
    tokens, lps, _ = run_all(engine, {"g": (PROMPT, n4), "solo": (list(b"other"), SamplingParams(
        max_tokens=5, temperature=1.0, ignore_eos=True))})
    seqs = tokens["g"]
    assert all(len(s) == 20 for s in seqs) and len({tuple(s) for s in seqs}) == 4
    for s, lp in zip(seqs, lps["g"], strict=True):
        check_logprobs(reference, PROMPT, s, lp)
    # seeded: the same sequences again, batched differently
    again, _, _ = run_all(engine, {"g2": (PROMPT, n4)})
    assert again["g2"] == seqs


def test_n4_uses_at_most_1_3x_the_blocks_of_n1(tmp_path_factory) -> None:
    """The issue's figure: a 1,000-token prompt and 64 new tokens."""
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("long") / "llama",
                                max_position_embeddings=2048)
    engine = make_engine(path, num_kv_blocks=512, prefill_chunk_size=512,
                         max_num_batched_tokens=512, enable_prefix_caching=False)
    prompt = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(5)).tolist()
    peaks = {}
    for n in (1, 4):
        params = SamplingParams(max_tokens=64, temperature=1.0, seed=1, n=n, ignore_eos=True)
        tokens, _, peaks[n] = run_all(engine, {f"n{n}": (prompt, params)})
        assert [len(t) for t in tokens[f"n{n}"]] == [64] * n
    # n=1: 1,064 tokens = 67 blocks; n=4: 62 shared + 4 x (a copied partial block + 4)
    assert peaks[1] == 67 and peaks[4] == 82
    assert peaks[4] <= 1.3 * peaks[1]


def test_a_forked_group_swaps_out_and_back(tiny_checkpoints, reference) -> None:
    engine = make_engine(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=4, n=3, logprobs=0,
                            ignore_eos=True)
    alone, _, _ = run_all(engine, {"a": (PROMPT, params)})
    engine.add_request("g", PROMPT, params)
    tokens = [[] for _ in range(3)]
    lps = [[] for _ in range(3)]
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.seq] += out.new_token_ids
            lps[out.seq] += out.logprobs
        steps += 1
        if steps == 5:
            used = engine.num_total_blocks - engine.num_free_blocks
            assert not engine.can_recompute("g") and not engine.preempt_recompute("g")
            assert engine.swap_out("g") and engine.num_free_blocks == engine.num_total_blocks
            assert engine.swap_in("g")
            assert engine.num_total_blocks - engine.num_free_blocks == used
            engine.pool.check_integrity()
    assert tokens == alone["a"]
    for s, lp in zip(tokens, lps, strict=True):
        check_logprobs(reference, PROMPT, s, lp)
    assert engine.num_free_blocks == engine.num_total_blocks


def test_the_engine_swaps_a_group_under_pressure(tiny_checkpoints) -> None:
    engine = make_engine(tiny_checkpoints["llama"], num_kv_blocks=14, prefill_chunk_size=64)
    group = SamplingParams(max_tokens=40, temperature=1.0, seed=2, n=3, ignore_eos=True)
    alone, _, _ = run_all(make_engine(tiny_checkpoints["llama"]), {"g": (PROMPT, group)})
    tokens, _, _ = run_all(engine, {"g": (PROMPT, group), "h": (list(b"pressure " * 4),
                                    SamplingParams(max_tokens=40, ignore_eos=True))})
    assert engine.num_preemptions > 0
    assert tokens["g"] == alone["g"]


@pytest.mark.parametrize("max_tokens", [12, 1])
def test_forked_sequences_on_the_decode_side(tiny_checkpoints, reference,
                                             max_tokens: int) -> None:
    """Prefill on one engine (n first tokens), decode on another from the moved KV; with
    max_tokens 1 the decode side only ends each sequence (no token of its own)."""
    prefill = make_engine(tiny_checkpoints["llama"])
    decode = make_engine(tiny_checkpoints["llama"], attention="flex")
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=9, n=3, logprobs=0,
                            ignore_eos=True)
    aggregated, _, _ = run_all(make_engine(tiny_checkpoints["llama"]), {"r": (PROMPT, params)})
    prefill.add_request("r", PROMPT, params, prefill_only=True)
    firsts = {}
    while len(firsts) < 3:
        for out in prefill.step():
            firsts[out.seq] = out.new_token_ids[0]
    blocks = decode.reserve("r", len(PROMPT))
    assert blocks is not None
    decode.pool.write_blocks(blocks, prefill.pool.read_blocks(prefill.block_ids("r")))
    prefill.release("r")
    decode.add_prefilled_request("r", PROMPT, [firsts[i] for i in range(3)], params, blocks)
    tokens = [[firsts[i]] for i in range(3)]
    finished = set()
    while decode.has_unfinished():
        for out in decode.step():
            tokens[out.seq] += out.new_token_ids
            if out.finished:
                finished.add(out.seq)
    assert tokens == aggregated["r"] and finished == {0, 1, 2}
    assert decode.num_free_blocks == decode.num_total_blocks


def test_json_schema_output_parses_and_validates(tiny_checkpoints) -> None:
    import json

    import jsonschema

    engine = make_engine(tiny_checkpoints["llama"])
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"], "additionalProperties": False}
    grammar = Grammar(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    params = [SamplingParams(max_tokens=120, temperature=1.0, seed=s, grammar=grammar, n=2)
              for s in range(4)]
    outs = engine.generate_n([PROMPT] * 4, params)
    texts = [bytes(t for t in seq if t < 256).decode() for seqs in outs for seq in seqs]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    choice = Grammar(GrammarKind.CHOICE, json.dumps(["yes", "no"]))
    got = engine.generate([PROMPT], SamplingParams(max_tokens=10, grammar=choice))[0]
    assert bytes(t for t in got if t < 256).decode() in ("yes", "no")
    with pytest.raises(ValueError, match="grammar|regex"):
        engine.add_request("bad", PROMPT, SamplingParams(grammar=Grammar(GrammarKind.REGEX,
                                                                         "(unclosed")))


def test_a_seeded_request_with_every_parameter_ignores_its_batch(tiny_checkpoints) -> None:
    """Seeded sampling with the penalties, filters and a bias gives the same tokens alone and
    in batches that differ in size, in what their other rows ask for, and in when it joins
    them (so its rows sit at other positions and its steps meet other prefills)."""
    busy = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, top_p=0.95, min_p=0.02,
                          presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2,
                          logit_bias=((101, 1.5),), min_tokens=4, seed=123, logprobs=2)
    others = {"o0": (list(b"first in"), SamplingParams(max_tokens=9, ignore_eos=True)),
              "o1": (list(b"another prompt here"),
                     SamplingParams(max_tokens=20, temperature=1.3, seed=5, n=2,
                                    ignore_eos=True)),
              "o2": (list(b"x" * 50), SamplingParams(max_tokens=7, temperature=0.7,
                                                      frequency_penalty=1.0))}
    alone, _, _ = run_all(make_engine(tiny_checkpoints["llama"]), {"r": (PROMPT, busy)})
    for join_at in (0, 3):
        engine = make_engine(tiny_checkpoints["llama"])
        for rid, (prompt, params) in others.items():
            engine.add_request(rid, prompt, params)
        tokens: list[int] = []
        steps = 0
        while engine.has_unfinished() or steps <= join_at:
            if steps == join_at:
                engine.add_request("r", PROMPT, busy)
            for out in engine.step():
                assert out.error is None
                if out.req_id == "r":
                    tokens += out.new_token_ids
            steps += 1
        assert tokens == alone["r"][0], join_at
        assert engine.num_free_blocks == engine.num_total_blocks
    again, _, _ = run_all(make_engine(tiny_checkpoints["llama"]),
                          {"r": (PROMPT, replace(busy, seed=124))})
    assert again["r"] != alone["r"]  # 16 tokens: the seed is what made them equal
