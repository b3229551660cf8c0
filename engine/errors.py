"""Errors the engine raises for bad input (ordinary outcomes are values, not exceptions)."""

from __future__ import annotations


class PromptTooLong(ValueError):
    """A prompt does not fit the model's context or the whole KV pool; nothing was allocated."""

    def __init__(self, num_tokens: int, limit: int, what: str) -> None:
        super().__init__(
            f"prompt of {num_tokens} tokens is too long: {what} allows at most {limit} tokens"
        )
        self.num_tokens = num_tokens
        self.limit = limit


class UnsupportedArchitecture(ValueError):
    """A checkpoint's architecture is not one the engine runs."""

    def __init__(self, architecture: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported)}"
        )
        self.architecture = architecture
