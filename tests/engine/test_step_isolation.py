"""No request can wedge the engine (issue 13 item 7): sampling is safe for every accepted
temperature, and a request that breaks a step fails alone while the others of that step
get their tokens from it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sampling import make_generator, sample

POISON = 7  # a prompt holding this token id breaks every forward it is part of


class PoisonRunner:
    """The real runner, except that a batch holding POISON raises (a stand-in for a
    request-specific kernel or numeric failure)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kernels = inner.kernels
        self.num_batches = 0

    def execute(self, decodes: Sequence[Any], chunks: Sequence[Any]) -> torch.Tensor:
        self.num_batches += 1
        if any(POISON in w.token_ids for w in (*decodes, *chunks)):
            raise RuntimeError("poisoned batch")
        return self.inner.execute(decodes, chunks)


def make_engine(path: Path, poison: bool = False) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                    prefill_chunk_size=16, max_model_len=200))
    if poison:
        engine.runner = PoisonRunner(engine.runner)
    return engine


def drive(engine: LLMEngine, decodes_of: dict[str, int], chunks: dict[str, int]
          ) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """Run every request to its end, each step planned as a caller would: one decode for
    a prefilled request, one chunk for a prompt. Returns tokens, errors, steps."""
    tokens: dict[str, list[int]] = {r: [] for r in [*decodes_of, *chunks]}
    errors: dict[str, str] = {}
    live = dict(chunks)
    decoding: set[str] = set()
    steps = 0
    while live or decoding:
        outs, refused = engine.run_plan(sorted(decoding), sorted(live.items()))
        assert not refused
        steps += 1
        for out in outs:
            tokens[out.req_id].extend(out.new_token_ids)
            if out.error is not None:
                errors[out.req_id] = out.error
            if out.prefill_done:
                live.pop(out.req_id, None)
                decoding.add(out.req_id)
            if out.finished:
                live.pop(out.req_id, None)
                decoding.discard(out.req_id)
    return tokens, errors, steps


def test_poisoned_request_fails_alone_and_delays_no_one_by_a_step(tiny_checkpoints) -> None:
    path = tiny_checkpoints["llama"]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    normal_prompt = [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12]
    alone = make_engine(path)
    alone.add_request("normal", normal_prompt, greedy)
    want, _, steps_alone = drive(alone, {}, {"normal": len(normal_prompt)})

    engine = make_engine(path, poison=True)
    free = engine.num_free_blocks
    engine.add_request("normal", normal_prompt, greedy)
    engine.add_request("poisoned", [1, POISON, 3, 4], greedy)
    got, errors, steps = drive(engine, {}, {"normal": len(normal_prompt), "poisoned": 4})
    assert errors == {"poisoned": "RuntimeError: poisoned batch"}
    assert got["normal"] == want["normal"] and got["poisoned"] == []
    # The failed batch was run again one request at a time within the same step, so the
    # normal request needed no more steps than alone, and the poisoned one is gone.
    assert steps == steps_alone
    assert engine.request_state("poisoned") is None
    assert engine.num_free_blocks == free and not engine.has_unfinished()


def test_a_step_of_one_failing_request_ends_it(tiny_checkpoints) -> None:
    engine = make_engine(tiny_checkpoints["llama"], poison=True)
    free = engine.num_free_blocks
    engine.add_request("p", [POISON, 1], SamplingParams(max_tokens=4))
    (out,), refused = engine.run_plan([], [("p", 2)])
    assert not refused and out.finished and out.error == "RuntimeError: poisoned batch"
    assert engine.num_free_blocks == free and not engine.has_unfinished()


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 1e-5, 5e-3, 1e-2, 0.7, 2.0])
def test_every_accepted_temperature_samples(tiny_checkpoints, temperature: float) -> None:
    # issue 13: temperature 1e-40 overflowed the sampler and the step retried forever.
    engine = make_engine(tiny_checkpoints["llama"])
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=3, ignore_eos=True)
    tokens = engine.generate([[1, 2, 3, 4]], params)[0]
    assert len(tokens) == 6
    if temperature < 1e-5:  # greedy, as in vLLM
        greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert params.is_greedy and tokens == engine.generate([[1, 2, 3, 4]], greedy)[0]


def test_non_finite_logits_sample_the_best_finite_token() -> None:
    logits = torch.tensor([[0.0, math.nan, 3.0, -1.0], [math.inf, 1.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=1.0, seed=1)] * 2
    gens = [make_generator(p, torch.device("cpu")) for p in params]
    ids, _ = sample(logits, params, gens)
    assert ids[0] == 2 and ids[1] == 0


def test_temperature_must_be_finite() -> None:
    for bad in (math.inf, math.nan, -1e-9):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
