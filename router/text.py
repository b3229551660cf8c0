"""Output token ids -> text deltas, with stop strings cut out (OpenAI ``stop``).

Detokenization is incremental, as vLLM's: each :meth:`TextAssembler.push` decodes only a
short window of the newest tokens (from ``prefix`` to the end, against ``prefix`` to
``read``), so a token costs the same whatever the output's length. Text is committed
only once the window decodes to complete characters (byte-level tokenizers may split a
character across tokens). A stop string is searched only where it could have appeared,
and text that might begin a stop string the next token completes is held back.
As in vLLM: ``include_stop`` keeps the stop string in the output, no stop string counts
before ``min_tokens`` tokens, and ``skip_special_tokens`` False decodes special tokens too.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.backend import Tokenizer

_INCOMPLETE = "\ufffd"


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], *,
                 include_stop: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0) -> None:
        self._tokenizer = tokenizer
        self._include_stop = include_stop
        self._skip_special = skip_special_tokens
        self._min_tokens = min_tokens
        self._stops = [s for s in stops if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._ids: list[int] = []
        self._prefix = 0  # window start: tokens before it are never decoded again
        self._read = 0  # tokens whose text is committed
        self._committed = ""  # text of the tokens before ``_read``
        self._searched = 0  # committed characters already scanned for stop strings
        self._num_emitted = 0  # characters already sent
        self.text = ""
        self.is_stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def push(self, token_ids: Sequence[int], *, final: bool = False) -> str:
        """New text to send; sets ``is_stopped`` when a stop string appeared."""
        if self.is_stopped:
            return ""
        self._ids.extend(token_ids)
        self._advance(final)
        text = self._committed
        active = len(self._ids) > self._min_tokens
        hit = self._first_stop(text) if active else None
        if hit is not None:
            cut, stop = hit
            text = text[: cut + len(stop)] if self._include_stop else text[:cut]
            self.is_stopped = True
            safe_end = len(text)
        elif final:
            safe_end = len(text)
        else:
            safe_end = len(text) - self._holdback(text)
        self._searched = max(self._searched, len(self._committed) - self._max_stop + 1, 0)
        self.text = text[:safe_end] if not (final or self.is_stopped) else text
        delta = text[self._num_emitted: max(safe_end, self._num_emitted)]
        self._num_emitted = max(safe_end, self._num_emitted)
        return delta

    def _advance(self, final: bool) -> None:
        if self._read >= len(self._ids):
            return
        tok = self._tokenizer

        def decode(ids: Sequence[int]) -> str:
            if self._skip_special:
                return tok.decode(ids)
            return tok.decode(ids, skip_special_tokens=False)

        before = decode(self._ids[self._prefix:self._read]) if self._read > self._prefix else ""
        window = decode(self._ids[self._prefix:])
        if not final and window.endswith(_INCOMPLETE):
            return  # a character split across tokens: wait for its last byte
        if len(window) > len(before) and window.startswith(before):
            self._committed += window[len(before):]
        elif window != before:
            # The window re-tokenized differently (rare): take the full decode once.
            self._committed = decode(self._ids)
        self._prefix = self._read
        self._read = len(self._ids)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(where, which) of the first stop string in ``text``."""
        start = self._searched
        hits = [(i, s) for i, s in ((text.find(s, start), s) for s in self._stops) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins some stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
