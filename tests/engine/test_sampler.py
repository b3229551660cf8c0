"""The batched sampler on crafted logits: each parameter does what vLLM's does, alone and
batched with rows that do not use it."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import SampleRow, sample
from engine.sampling import SamplingParams, uniform

V = 8


def row(params: SamplingParams, *, seed: int = 1, step: int = 0, prompt=(), output=()
        ) -> SampleRow:
    return SampleRow(params, seed, 0, step, prompt, output)


def peaked() -> torch.Tensor:
    # token 0 best, token 1 a close second, the rest far behind
    return torch.tensor([5.0, 4.5, 0.0, -1.0, -2.0, 1.0, 0.5, -3.0])


def choose(params: SamplingParams, **kw) -> int:
    ids, _ = sample(peaked().unsqueeze(0), [row(params, **kw)], stop_ids=frozenset({7}))
    return ids[0]


def test_neutral_parameters_choose_the_argmax() -> None:
    neutral = SamplingParams(top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0,
                             repetition_penalty=1.0, min_tokens=0, logit_bias=(),
                             allowed_token_ids=())
    assert not neutral.processes_logits
    assert choose(neutral, output=[0, 0, 0]) == 0


@pytest.mark.parametrize(("params", "output", "prompt"), [
    (SamplingParams(frequency_penalty=1.0), [0, 0], ()),  # 5 - 2 < 4.5
    (SamplingParams(presence_penalty=0.6), [0], ()),  # 5 - 0.6 < 4.5
    (SamplingParams(repetition_penalty=2.0), [], [0]),  # 5 / 2 < 4.5 (prompt tokens count)
])
def test_penalties_move_the_choice(params: SamplingParams, output, prompt) -> None:
    assert choose(SamplingParams(), output=output, prompt=prompt) == 0
    assert choose(params, output=output, prompt=prompt) == 1


def test_repetition_penalty_multiplies_negative_logits() -> None:
    logits = torch.tensor([[-1.0, -1.5, -9.0, -9.0, -9.0, -9.0, -9.0, -9.0]])
    ids, _ = sample(logits, [row(SamplingParams(repetition_penalty=2.0), output=[0])])
    assert ids == [1]  # -1 * 2 = -2 < -1.5


def test_masks_and_bias() -> None:
    assert choose(SamplingParams(logit_bias=((3, 100.0),))) == 3
    assert choose(SamplingParams(logit_bias=((0, -100.0),))) == 1
    assert choose(SamplingParams(allowed_token_ids=(2, 6))) == 6
    # min_tokens masks EOS (7 here) and the stop tokens until enough tokens came
    biased = SamplingParams(logit_bias=((7, 50.0),), min_tokens=2, stop_token_ids=(1,))
    assert choose(biased, step=0) == 0
    assert choose(biased, step=2) == 7
    assert choose(SamplingParams(logit_bias=((7, 50.0),), min_tokens=2, ignore_eos=True)) == 7


def test_random_filters() -> None:
    # top_k 1 and min_p 1 leave only the best token, whatever the draw
    for seed in range(20):
        assert choose(SamplingParams(temperature=1.0, top_k=1), seed=seed) == 0
        assert choose(SamplingParams(temperature=1.0, min_p=1.0), seed=seed) == 0
        assert choose(SamplingParams(temperature=1.0, top_p=0.01), seed=seed) == 0
        assert choose(SamplingParams(temperature=1.0, top_k=2), seed=seed) in (0, 1)
    drawn = {choose(SamplingParams(temperature=1.0), seed=s) for s in range(200)}
    assert {0, 1} <= drawn and len(drawn) > 2


def test_a_seeded_row_draws_the_same_whatever_its_batch() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g)
    seeded = SampleRow(SamplingParams(temperature=0.8, top_p=0.9, top_k=40), 42, 0, 3, (), ())
    alone, _ = sample(logits[2:3].clone(), [seeded])
    others = [SampleRow(SamplingParams(temperature=1.3, min_p=0.1), s, 0, 0, (), ())
              for s in (1, 2)]
    greedy = SampleRow(SamplingParams(frequency_penalty=0.5), 0, 0, 0, (), (1, 2))
    batch, _ = sample(logits.clone(), [others[0], greedy, seeded, others[1],
                                       SampleRow(SamplingParams(), 0, 0, 0, (), ())])
    assert batch[2] == alone[0]
    assert uniform(42, 0, 3) != uniform(42, 1, 3) != uniform(42, 0, 4)


def test_logprobs_are_of_the_raw_logits() -> None:
    logits = peaked().unsqueeze(0)
    params = SamplingParams(logprobs=3, logit_bias=((1, 10.0),))
    ids, lps = sample(logits.clone(), [row(params)])
    expected = torch.log_softmax(logits[0], -1)
    lp = lps[0]
    assert ids == [1] and lp is not None
    assert lp.token_id == 1 and lp.rank == 2
    assert lp.logprob == pytest.approx(float(expected[1]), abs=1e-5)
    assert lp.top_token_ids == [0, 1, 5]
    assert lp.top_logprobs == pytest.approx([float(expected[i]) for i in (0, 1, 5)], abs=1e-5)


def test_bad_values_are_refused() -> None:
    for kwargs in ({"min_p": 1.5}, {"top_k": -2}, {"presence_penalty": 3.0},
                   {"repetition_penalty": 0.0}, {"min_tokens": 20, "max_tokens": 10},
                   {"logprobs": 21}, {"n": 0}, {"logit_bias": ((1, float("nan")),)}):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logprobs=True).logprobs == 0
    assert SamplingParams(stop_token_ids=(9,)).token_ids_out_of(8) == [9]
