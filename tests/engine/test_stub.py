"""The stub engine of bench-control: the engine's bookkeeping with no model behind it."""

from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from engine.stub import make_stub_engine


def test_the_stub_engine_runs_requests_to_their_length_without_a_model() -> None:
    engine = make_stub_engine(64)
    engine.add_request("a", list(range(40)), SamplingParams(max_tokens=3, temperature=0.0))
    engine.add_request("b", list(range(10)), SamplingParams(max_tokens=2, temperature=0.0))
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    finished: set[str] = set()
    for _ in range(20):
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
            if out.finished:
                finished.add(out.req_id)
        if len(finished) == 2:
            break
    assert finished == {"a", "b"}
    assert {rid: len(toks) for rid, toks in tokens.items()} == {"a": 3, "b": 2}
    assert engine.num_free_blocks == 64


def test_a_paced_stub_sleeps_a_fixed_cost_plus_one_per_token_computed(monkeypatch) -> None:
    import engine.stub as stub

    slept: list[float] = []
    monkeypatch.setattr(stub.time, "sleep", slept.append)
    engine = make_stub_engine(64, step_s=0.01, token_s=0.001)
    engine.add_request("a", list(range(40)), SamplingParams(max_tokens=2, temperature=0.0))
    engine.add_request("b", list(range(10)), SamplingParams(max_tokens=2, temperature=0.0))
    engine.step()  # both prompts: 50 tokens
    engine.step()  # one decode each: 2 tokens
    assert slept == [pytest.approx(0.01 + 0.05), pytest.approx(0.01 + 0.002)]
    with pytest.raises(ValueError, match="pace"):
        make_stub_engine(8, step_s=-1.0)
