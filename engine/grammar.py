"""Structured output: a grammar a sequence's tokens must follow, as a token mask.

The grammar library is llguidance (PyPI ``llguidance``; the Rust core of Microsoft's
guidance, one of vLLM's structured-output backends). Why it and not the others the issue
names: it installs alone (one wheel, no dependencies), where xgrammar's wheel brings
triton and apache-tvm-ffi into a CPU project; it compiles a grammar lazily (no ahead-of-time
index over the vocabulary, which is what makes outlines-core slow to start on a large JSON
schema); and a batch-16 mask (filled from 16 matchers and applied) costs about 1 % of a decode
step of SmolLM2-135M on CPU, under the 10 % the issue allows (``python -m
bench.engine_sampling`` measures it; figures in the README). JSON Schema, regular
expressions, choices and Lark grammars all go through the same matcher.

* :class:`Grammar` is what a request asks for (kind and text); it crosses processes.
* :class:`GrammarCompiler` is built once per engine from its tokenizer; ``matcher(grammar)``
  gives a fresh :class:`Matcher` per sequence, or raises ``ValueError`` naming what is wrong
  with the grammar (the router checks with the same call before it accepts a request).
* A matcher consumes each sampled token (``accept``) and fills its row of the step's
  bitmask (``fill``); ``is_finished`` once the grammar is complete (only EOS may follow).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

import torch


class GrammarKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # spec: a JSON list of strings, one of which is the output
    LARK = "lark"  # llguidance's Lark dialect (vLLM's guided_grammar with the guidance backend)


@dataclass(frozen=True, slots=True)
class Grammar:
    kind: GrammarKind
    spec: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GrammarKind(self.kind))


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in text)


def to_llguidance(grammar: Grammar) -> str:
    """The grammar in llguidance's serialized form; ValueError when the spec is malformed."""
    from llguidance import LLMatcher

    kind = grammar.kind
    if kind is GrammarKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind is GrammarKind.JSON_SCHEMA:
        try:
            schema = json.loads(grammar.spec)
        except ValueError as e:
            raise ValueError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema is an object")
        return LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    if kind is GrammarKind.REGEX:
        return LLMatcher.grammar_from_regex(grammar.spec)
    if kind is GrammarKind.CHOICE:
        try:
            choices = json.loads(grammar.spec)
        except ValueError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(
                isinstance(c, str) for c in choices):
            raise ValueError("a choice is a non-empty list of strings")
        return LLMatcher.grammar_from_regex("|".join(f"({_regex_escape(c)})" for c in choices))
    return LLMatcher.grammar_from_lark(grammar.spec)


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def accept(self, token_id: int) -> bool:
        """Consume a sampled token; False if the grammar did not allow it."""
        return bool(self._inner.consume_token(int(token_id))) and not self._inner.is_error()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32, 32 tokens a word)."""
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(self._inner, bitmask, row)

    @property
    def is_finished(self) -> bool:
        return bool(self._inner.is_stopped())

    @property
    def error(self) -> str:
        return str(self._inner.get_error()) if self._inner.is_error() else ""

    def copy(self) -> Matcher:
        return Matcher(self._inner.deep_copy())


class GrammarCompiler:
    """Matchers over one tokenizer (``n_vocab``: the model's logits width)."""

    def __init__(self, tokenizer: Any, n_vocab: int, eos_token_ids: frozenset[int]) -> None:
        import llguidance.hf

        eos = sorted(eos_token_ids) or None
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab,
                                                       eos_token=eos)
        self.n_vocab = n_vocab

    def matcher(self, grammar: Grammar) -> Matcher:
        from llguidance import LLMatcher

        serialized = to_llguidance(grammar)
        inner = LLMatcher(self._tokenizer, serialized, log_level=0)
        if inner.is_error():
            raise ValueError(f"invalid {grammar.kind.value} grammar: "
                             f"{inner.get_error()[:300]}")
        return Matcher(inner)


def allocate_bitmask(rows: int, n_vocab: int) -> torch.Tensor:
    return torch.full((rows, (n_vocab + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of every token whose bit is clear to -inf (rows of ``logits`` and
    ``bitmask`` correspond). Bits are unpacked with numpy in one pass."""
    import numpy as np

    width = logits.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    allowed = torch.from_numpy(bits[:, :width]).to(logits.device, dtype=torch.bool)
    logits.masked_fill_(~allowed, float("-inf"))
