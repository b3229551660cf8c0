"""What the HTTP layer needs from the cluster behind it: a small Protocol.

Data flow: ``router/app.py`` turns an HTTP request into a :class:`GenerationSpec`,
calls ``backend.generate(spec)`` and turns the :class:`TokenDelta` stream into JSON or
server-sent events. The Ray Serve deployment plugs in the cluster backend
(``cluster/backend.py``); unit tests plug in a fake. Specs cross process boundaries as
typed ``scheduler.messages`` messages (msgpack), never pickles.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# The request as the cluster runs it crosses processes, so it lives with the other wire
# messages a floor below; the HTTP layer builds it.
from scheduler.messages import GenerationSpec, SamplingSpec

__all__ = ["Backend", "BackendError", "BackendErrorKind", "FinishReason", "GenerationSpec",
           "SamplingSpec", "TokenDelta", "Tokenizer"]


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output tokens; ``finish`` set on the last delta of a request."""

    token_ids: tuple[int, ...]
    finish: FinishReason | None = None


class BackendErrorKind(enum.Enum):
    REJECTED = "rejected"  # admission said no (overload): 429 with retry-after
    UNAVAILABLE = "unavailable"  # no live worker / scheduler: 503
    TIMEOUT = "timeout"  # a remote call or the request ran past its limit: 504
    FAILED = "failed"  # a worker died and the retry failed too: 500
    INVALID = "invalid"  # the engine refused the request (e.g. too long): 400


@dataclass
class BackendError(Exception):
    kind: BackendErrorKind
    message: str
    retry_after_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.message}"


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to vocab_size - 1."""
        ...

    @property
    def max_token_bytes(self) -> int:
        """The longest token's text in UTF-8 bytes: a text of n bytes has at least
        n / max_token_bytes tokens, so a prompt far over the context is refused from its
        length alone, without tokenizing it."""
        ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class Backend(Protocol):
    """The cluster as the HTTP layer sees it."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    def generate(self, spec: GenerationSpec) -> AsyncIterator[TokenDelta]:
        """Stream the request's output; raises BackendError. Closing it aborts the request."""
        ...

    async def abort(self, req_id: str) -> None:
        """Stop the request and free its blocks (idempotent)."""
        ...

    async def health(self) -> dict[str, Any]:
        """``{"ok": bool, ...}`` with whatever detail the backend has."""
        ...

    async def why(self, req_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        """Why the request went as it did (``cluster.why.WhyReport.to_dict()``), or None.
        ``tenant`` set: None unless the request is that tenant's, and other tenants'
        request ids are not named in the chain."""
        ...

    async def metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""
        ...
