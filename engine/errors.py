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


class EngineSettingError(ValueError):
    """A setting this engine cannot honour on this device: the message starts with the
    EngineConfig field (``setting``) and says what the limit is; callers with their own
    configuration tree (cluster/) re-root it at their own field name."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.detail = message


class UnsupportedArchitecture(EngineSettingError):
    """A checkpoint's architecture is not one the engine runs (setting ``model``)."""

    def __init__(self, architecture: str, supported: tuple[str, ...]) -> None:
        super().__init__(
            "model",
            f"unsupported model architecture {architecture!r}; supported: {', '.join(supported)}",
        )
        self.architecture = architecture
