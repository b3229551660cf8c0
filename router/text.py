"""Output token ids -> text deltas, with stop strings cut out (OpenAI ``stop``).

Each :meth:`TextAssembler.push` decodes the whole output so far (byte-level tokenizers
only produce valid UTF-8 across token boundaries) and returns the new text that is
safe to send: not the tail of an incomplete character, not the start of a stop string
that the next token may complete.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.backend import Tokenizer

_INCOMPLETE = "\ufffd"


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = [s for s in stops if s]
        self._ids: list[int] = []
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
        text = self._tokenizer.decode(self._ids)
        cut = self._first_stop(text)
        if cut is not None:
            text = text[:cut]
            self.is_stopped = True
            safe_end = len(text)
        elif final:
            safe_end = len(text)
        else:
            safe_end = len(text) - self._holdback(text)
            while safe_end > self._num_emitted and text[safe_end - 1] == _INCOMPLETE:
                safe_end -= 1
        self.text = text[:safe_end] if not (final or self.is_stopped) else text
        delta = text[self._num_emitted : max(safe_end, self._num_emitted)]
        self._num_emitted = max(safe_end, self._num_emitted)
        return delta

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stops) if i >= 0]
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
