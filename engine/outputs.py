"""What one engine step reports per request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampler import TokenLogprobs


class FinishReason(str, enum.Enum):
    """Why a request ended (a str enum, so it equals "stop" / "length" on the wire)."""

    STOP = "stop"  # a stop token, EOS or stop string
    LENGTH = "length"  # max_tokens, or the model's context is full


@dataclass(slots=True)
class StepOutput:
    """One sequence's progress in one step (a request of ``n`` sequences gives one output
    per sequence that sampled, ``seq`` naming it; sequence 0 carries the request's prefill
    progress).

    ``new_token_ids``/``logprobs``: tokens sampled in this step (zero or one; none while a
    prompt's prefill is still running), with their log-probabilities when the request asked.
    ``finished``: this sequence ended; ``request_finished``: the request did (its last
    sequence ended, or it failed): it has left the engine. ``prompt_logprobs``: on the
    output that ends the prefill of a request that asked, one entry per prompt token after
    the first. ``num_cached_tokens``: there too, the prompt tokens the prefix cache gave. ``prefill_done``: this step finished the prompt's
    prefill (the first token is in ``new_token_ids``). ``num_computed_tokens``: tokens whose KV
    is in the pool after this step. ``ready_block_ids``: blocks whose KV became final in this
    step, in block-table order (what a prefill worker streams to its decode worker).
    ``error``: the request failed this step on its own (the batched step failed and so did
    its run alone): it has left the engine and its blocks are free; ``finished`` and
    ``request_finished`` are set.
    """

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    request_finished: bool = False
    seq: int = 0
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prefill_done: bool = False
    num_computed_tokens: int = 0
    ready_block_ids: list[int] = field(default_factory=list)
    error: str | None = None
