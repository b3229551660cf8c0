"""What one engine step reports per request."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(str, enum.Enum):
    """Why a request ended (a str enum, so it equals "stop" / "length" on the wire)."""

    STOP = "stop"  # a stop token, EOS or stop string
    LENGTH = "length"  # max_tokens, or the model's context is full


@dataclass(slots=True)
class StepOutput:
    """One request's progress in one step.

    ``new_token_ids``/``logprobs``: tokens sampled in this step (zero or one; none while a
    prompt's prefill is still running). ``prefill_done``: this step finished the prompt's
    prefill (the first token is in ``new_token_ids``). ``num_computed_tokens``: tokens whose KV
    is in the pool after this step. ``ready_block_ids``: blocks whose KV became final in this
    step, in block-table order (what a prefill worker streams to its decode worker).
    ``error``: the request failed this step on its own (the batched step failed and so did
    its run alone): it has left the engine and its blocks are free; ``finished`` is set.
    """

    req_id: str
    new_token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prefill_done: bool = False
    num_computed_tokens: int = 0
    ready_block_ids: list[int] = field(default_factory=list)
    error: str | None = None
