"""engine/books.py: the engine's books change under one lock, which a step lets go while
the model runs, so a decode worker's reservation never waits for a forward in flight."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.books import BooksLock


class BlockingRunner:
    """The engine's runner; once ``hang`` is set, the next forward blocks until ``release``."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.kernels = getattr(inner, "kernels", None)
        self.hang, self.hanging, self.release = (threading.Event(), threading.Event(),
                                                 threading.Event())

    def execute(self, decodes: Any, chunks: Any) -> Any:
        if self.hang.is_set():
            self.hanging.set()
            self.release.wait(60)
        return self.inner.execute(decodes, chunks)


def _engine(path: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64,
                                  prefill_chunk_size=64))


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t, out


def test_a_reservation_is_made_while_the_forward_runs_and_the_books_stay_whole(
        tiny_checkpoints) -> None:
    engine = _engine(tiny_checkpoints["llama"])
    engine.add_request("r1", list(range(1, 40)), SamplingParams(max_tokens=8))
    with engine.books:  # as the engine thread runs each call
        engine.run_plan([], [("r1", 39)])
    runner = BlockingRunner(engine.runner)
    engine.runner = runner
    runner.hang.set()

    def decode_step() -> Any:
        with engine.books:
            return engine.run_plan(["r1"], [])

    step, _ = _in_thread(decode_step)
    assert runner.hanging.wait(60), "the decode step's forward never started"
    reserve, got = _in_thread(lambda: engine.reserve("r2", 40, prompt_token_ids=range(40)))
    reserve.join(60)
    # The reservation was made while the forward still runs (the old engine thread made
    # it wait for the step: a dispatch waited for a whole decode step).
    assert not reserve.is_alive() and step.is_alive()
    assert got[0] is not None and len(got[0]) == 3  # 40 tokens, 16 per block
    runner.release.set()
    step.join(60)
    assert not step.is_alive()
    used = sum(len(engine.block_ids(r)) for r in ("r1", "r2"))
    assert engine.num_free_blocks + used == engine.num_total_blocks


def test_the_books_exclude_a_reservation_outside_the_forward(tiny_checkpoints) -> None:
    """A control call on the engine thread (here: the books held) and a reservation from
    elsewhere never interleave: the reservation waits until the call let the books go."""
    engine = _engine(tiny_checkpoints["llama"])
    held, go = threading.Event(), threading.Event()

    def control_call() -> None:
        with engine.books:
            held.set()
            go.wait(60)

    call, _ = _in_thread(control_call)
    assert held.wait(60)
    reserve, got = _in_thread(lambda: engine.reserve("r", 16))
    reserve.join(0.2)
    assert reserve.is_alive() and not got  # waiting for the books
    go.set()
    reserve.join(60)
    call.join(60)
    assert got and got[0] is not None and len(got[0]) == 1


def _hold(books: BooksLock) -> bool:
    with books:
        return books.is_held


def test_books_lock_is_reentrant_and_released_lets_go_at_any_depth() -> None:
    books = BooksLock()
    with books, books:
        assert books.is_held
        with books.released():
            assert not books.is_held
            other, got = _in_thread(lambda: _hold(books))
            other.join(60)
            assert got == [True]  # another thread took it (and let it go) meanwhile
        assert books.is_held
    assert not books.is_held
    with books.released():  # not held here: nothing to let go
        pass
    with pytest.raises(RuntimeError):
        books.__exit__(None, None, None)
