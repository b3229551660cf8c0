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
from scheduler.messages import GenerationSpec, SamplingSpec, TokenLogprobs

__all__ = ["Backend", "BackendError", "BackendErrorKind", "FinishReason", "GenerationSpec",
           "SamplingSpec", "TokenDelta", "TokenLogprobs", "Tokenizer"]


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New output tokens of sequence ``seq``; ``finish`` set on that sequence's last delta
    (a request of n sequences streams until each has had its own). ``logprobs``: one per
    token when asked; ``prompt_logprobs`` and ``num_cached_tokens`` on sequence 0's first
    delta."""

    token_ids: tuple[int, ...]
    finish: FinishReason | None = None
    seq: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    num_cached_tokens: int = 0


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

    def encode_prompt(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def encode_chat(self, messages: Sequence[dict[str, Any]], **template: Any) -> list[int]:
        """The chat template's token ids; ``template``: its keyword arguments
        (``add_generation_prompt``, ``continue_final_message``, ``tools``, ``documents``
        and the request's ``chat_template_kwargs``)."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens included (logprobs' ``token``)."""
        ...

    @property
    def tool_format(self) -> str | None:
        """How the checkpoint's chat template renders tools and how its model calls them
        (``router.tools``: "hermes", "llama3_json"), or None: the template has no tools."""
        ...


def served_names(backend: Backend) -> list[str]:
    """Every name the backend's model answers to, the primary one first."""
    return [backend.model_name, *getattr(backend, "model_aliases", ())]


class Backend(Protocol):
    """The cluster as the HTTP layer sees it."""

    @property
    def model_name(self) -> str: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_aliases(self) -> tuple[str, ...]:
        """Other names the model answers to (listed in /v1/models after model_name)."""
        ...

    @property
    def model_root(self) -> str:
        """Where the model came from (a checkpoint folder or hub id): /v1/models' root."""
        ...

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
