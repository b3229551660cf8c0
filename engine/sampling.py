"""How one request picks its tokens and when it stops: ``SamplingParams``, and the random
numbers a seeded request draws.

Every parameter has a neutral value (the default) at which it changes nothing, so a greedy
request with every parameter neutral takes the sampler's fast path (one batched argmax)
and gives exactly the tokens it gave before these parameters existed. The batched sampler
that applies them is ``engine.sampler``.

Random draws are counter-based: the uniform number behind output token ``k`` of sequence
``s`` of a request seeded ``seed`` is a hash of ``(seed, s, k)`` (SplitMix64's finalizer,
as Philox-style generators do in hardware). A seeded request therefore gives the same
tokens whatever else is in its batch, whichever worker samples which of its tokens (a
prefill worker samples the first, a decode worker the rest), and after a preemption.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from engine.grammar import Grammar

# As vLLM: a temperature below SAMPLING_EPS is greedy, and one below MIN_TEMPERATURE is
# raised to it (logits / 1e-40 overflow to inf and softmax turns them into NaN).
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit for chat)
MAX_N = 16  # sequences per request (n, best_of)

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops (vLLM's parameters, same meaning).

    * ``temperature`` 0 (or below ``SAMPLING_EPS``) is greedy; a positive one below
      ``MIN_TEMPERATURE`` is raised to it. ``top_k`` 0 or -1 is off; ``top_p`` 1 and
      ``min_p`` 0 are off.
    * Penalties (vLLM's): ``presence_penalty`` and ``frequency_penalty`` subtract from the
      logits of tokens already in the output (once, and once per occurrence);
      ``repetition_penalty`` divides a positive logit (multiplies a negative one) of any
      token in the prompt or the output. Neutral: 0, 0, 1.
    * ``seed``: the request's counter-based random stream (None: a random seed).
    * Stops: EOS (unless ``ignore_eos``), ``stop_token_ids``, ``stop`` strings (checked on
      the decoded output); none of them before ``min_tokens`` output tokens (EOS and the
      stop tokens are masked until then).
    * ``logit_bias``: (token id, bias) pairs added to the logits; ``allowed_token_ids``:
      when set, every other token is masked.
    * ``logprobs``: None off, k >= 0: each token's log-probability, its rank and the k most
      likely tokens' (log-softmax of the model's raw logits, as vLLM's default
      ``raw_logprobs``); ``True``/``False`` mean 0/None. ``prompt_logprobs`` likewise for
      every prompt token but the first (the request then computes its whole prompt: no
      prefix-cache hit can give logits).
    * ``n``: sequences generated from the prompt (they share its KV blocks).
    * ``grammar``: structured output; each sequence's tokens are masked to the grammar.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.temperature < SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)
        elif self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or -1 = off), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be finite and > 0, got "
                             f"{self.repetition_penalty}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {self.n}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, bool):
                value = 0 if value else None
                object.__setattr__(self, name, value)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(not math.isfinite(b) for _, b in bias):
            raise ValueError("logit_bias values must be finite")
        object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "allowed_token_ids",
                           tuple(int(t) for t in self.allowed_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        # read for every row of every step: computed once
        penalized = (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                     or self.repetition_penalty != 1.0)
        object.__setattr__(self, "_penalized", penalized)
        object.__setattr__(self, "_processes", (
            penalized or bool(self.logit_bias) or bool(self.allowed_token_ids)
            or self.min_tokens > 0 or self.grammar is not None))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self._penalized  # type: ignore[attr-defined,no-any-return]

    @property
    def processes_logits(self) -> bool:
        """Anything that changes the logits before the choice (a greedy request without
        any takes the sampler's fast path)."""
        return self._processes  # type: ignore[attr-defined,no-any-return]

    def token_ids_out_of(self, vocab_size: int) -> list[int]:
        """Token ids this request names (bias, allow list, stop ids) outside the vocabulary."""
        named = [t for t, _ in self.logit_bias] + list(self.allowed_token_ids)
        named += list(self.stop_token_ids)
        return sorted({t for t in named if not 0 <= t < vocab_size})


def random_seed() -> int:
    """A seed for a request that gave none."""
    return random.getrandbits(63)


def uniform(seed: int, seq: int, step: int) -> float:
    """The uniform number in [0, 1) behind output token ``step`` of sequence ``seq``."""
    x = (seed * 0x9E3779B97F4A7C15 + (seq + 1) * 0xD1B54A32D192ED03
         + (step + 1) * 0x8CB92BA72F3D8DD7) & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return (x >> 11) / float(1 << 53)
