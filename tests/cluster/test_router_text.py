"""Incremental detokenization: the streamed text is the full decode, stop strings cut it,
and each push decodes only a short window (constant work per token)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.testing import make_byte_tokenizer
from router.text import TextAssembler

_TOK = make_byte_tokenizer()


class CountingTokenizer:
    """The byte-level HF tokenizer, counting the token ids each decode reads."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, token_ids: Sequence[int]) -> str:
        self.decoded += len(token_ids)
        return _TOK.decode(list(token_ids), skip_special_tokens=True)

    def encode_prompt(self, text: str) -> list[int]:
        return list(_TOK.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        return self.encode_prompt("".join(m["content"] for m in messages))


TEXTS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
                min_size=0, max_size=40)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, cuts=st.lists(st.integers(1, 5), min_size=1, max_size=60))
def test_streamed_text_equals_the_full_decode(text: str, cuts: list[int]) -> None:
    tok = CountingTokenizer()
    ids = tok.encode_prompt(text)
    asm = TextAssembler(tok, [])
    out, i, k = "", 0, 0
    while i < len(ids):
        n = cuts[k % len(cuts)]
        k += 1
        out += asm.push(ids[i:i + n], final=i + n >= len(ids))
        i += n
    if not ids:
        out += asm.push([], final=True)
    assert out == _TOK.decode(ids, skip_special_tokens=True)


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, stop=st.text(alphabet="ab\u00e9", min_size=1, max_size=3))
def test_stop_strings_cut_the_text_at_their_first_occurrence(text: str, stop: str) -> None:
    tok = CountingTokenizer()
    ids = tok.encode_prompt(text + "ab\u00e9a")
    full = _TOK.decode(ids, skip_special_tokens=True)
    asm = TextAssembler(tok, [stop])
    out = ""
    for j, t in enumerate(ids):
        out += asm.push([t], final=j == len(ids) - 1)
        if asm.is_stopped:
            break
    cut = full.find(stop)
    assert out == (full if cut < 0 else full[:cut])
    assert asm.is_stopped == (cut >= 0)


def test_each_token_costs_a_constant_window() -> None:
    tok = CountingTokenizer()
    ids = tok.encode_prompt("héllo wörld, " * 200)
    asm = TextAssembler(tok, ["STOP"])
    for t in ids:
        asm.push([t])
    # The whole output is ~2,800 tokens; a full decode per token would read ~4 M ids.
    assert tok.decoded < 6 * len(ids)
