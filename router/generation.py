"""One prompt's generation in flight: the backend's delta stream turned into the text,
tokens and logprobs of each of its sequences.

A request with ``n`` sequences (``best_of`` for completions) is one backend stream whose
deltas name their sequence; each sequence has its own :class:`~router.text.TextAssembler`
(stop strings cut each one alone) and ends with its own finish. The stream is read until
every sequence has ended; one that a stop string ended goes on in the engine until the
others end too, and then the request is aborted (its blocks freed) instead of read on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.backend import (
    Backend,
    BackendError,
    BackendErrorKind,
    FinishReason,
    GenerationSpec,
    TokenDelta,
    TokenLogprobs,
)
from router.text import TextAssembler


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """How a sequence's tokens become text (the request's detokenizing parameters)."""

    stops: tuple[str, ...] = ()
    include_stop_str: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = 0


@dataclass(slots=True)
class Piece:
    """What one delta added to sequence ``seq``: text to send, its tokens and logprobs,
    the sequence's finish once it has ended."""

    seq: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...]
    finish: str | None


@dataclass(slots=True)
class SeqState:
    index: int
    text: TextAssembler
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish: str | None = None
    engine_done: bool = False  # the backend said this sequence ended

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


class Generation:
    def __init__(self, backend: Backend, spec: GenerationSpec, opts: OutputOptions) -> None:
        self.backend = backend
        self.spec = spec
        self.seqs = [SeqState(i, TextAssembler(backend.tokenizer, opts.stops,
                                               include_stop=opts.include_stop_str,
                                               skip_special_tokens=opts.skip_special_tokens,
                                               min_tokens=opts.min_tokens))
                     for i in range(spec.sampling.n)]
        self.stream = backend.generate(spec)
        self.prompt_logprobs: tuple[TokenLogprobs, ...] = ()
        self.num_cached_tokens = 0
        self.first_token_time: float | None = None
        self.outcome = "client_gone"
        self.deadline = time.monotonic()

    @property
    def is_done(self) -> bool:
        return all(s.finish is not None for s in self.seqs)

    @property
    def finish(self) -> str | None:
        """The request's finish once every sequence has one (sequence 0's)."""
        return self.seqs[0].finish if self.is_done else None

    @property
    def num_tokens(self) -> int:
        return sum(s.text.num_tokens for s in self.seqs)

    async def next(self) -> Piece | None:
        """What the next delta added, or None once every sequence has ended."""
        if self.is_done:
            return None
        remaining = self.deadline - time.monotonic()
        try:
            delta: TokenDelta = await asyncio.wait_for(anext(self.stream), max(remaining, 0.001))
        except StopAsyncIteration:
            raise BackendError(BackendErrorKind.FAILED, "the stream ended without a finish") from None
        except asyncio.TimeoutError:
            raise BackendError(BackendErrorKind.TIMEOUT, "request ran past its time limit") from None
        if self.first_token_time is None and delta.token_ids:
            self.first_token_time = time.time()
        if delta.prompt_logprobs:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.num_cached_tokens:
            self.num_cached_tokens = delta.num_cached_tokens
        if not 0 <= delta.seq < len(self.seqs):
            raise BackendError(BackendErrorKind.FAILED, f"a delta of sequence {delta.seq}")
        s = self.seqs[delta.seq]
        final = delta.finish is not None
        s.engine_done = s.engine_done or final
        if s.finish is not None:  # a stop string ended it: the rest is not output
            return Piece(s.index, "", (), (), None)
        text = s.text.push(delta.token_ids, final=final)
        s.token_ids.extend(delta.token_ids)
        s.logprobs.extend(delta.logprobs)
        if s.text.is_stopped:
            s.finish = FinishReason.STOP.value
        elif final:
            s.finish = delta.finish.value  # type: ignore[union-attr]
        return Piece(s.index, text, tuple(delta.token_ids), tuple(delta.logprobs), s.finish)

    async def close(self) -> None:
        """Close the stream; abort the request unless every sequence ended on its own."""
        try:
            await self.stream.aclose()
        finally:
            if not all(s.engine_done for s in self.seqs):
                await self.backend.abort(self.spec.req_id)

    def best(self, n: int) -> Sequence[SeqState]:
        """The ``n`` sequences returned: all of them, or the most likely of ``best_of``."""
        if n >= len(self.seqs):
            return self.seqs
        return sorted(self.seqs, key=lambda s: -s.cumulative_logprob)[:n]
