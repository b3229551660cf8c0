"""What the HTTP layer needs from the cluster behind it: a small Protocol.

Data flow: ``router/app.py`` turns an HTTP request into a :class:`GenerationSpec`,
calls ``backend.generate(spec)`` and turns the :class:`TokenDelta` stream into JSON or
server-sent events. The Ray Serve deployment plugs in the cluster backend
(``cluster/backend.py``); unit tests plug in a fake. Specs cross process boundaries as
msgpack-ready dicts (``to_dict``/``from_dict``), never pickles.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    req_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    tier: int
    tenant: str
    arrival_time: float
    # Token ids that end generation besides the model's EOS (stop strings are the router's).
    stop_token_ids: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "req_id": self.req_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "max_tokens": self.sampling.max_tokens,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "seed": self.sampling.seed,
            "tier": self.tier,
            "tenant": self.tenant,
            "arrival_time": self.arrival_time,
            "stop_token_ids": list(self.stop_token_ids),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GenerationSpec:
        return cls(
            req_id=str(d["req_id"]),
            prompt_token_ids=tuple(int(t) for t in d["prompt_token_ids"]),
            sampling=SamplingSpec(
                max_tokens=int(d["max_tokens"]),
                temperature=float(d["temperature"]),
                top_p=float(d["top_p"]),
                seed=None if d.get("seed") is None else int(d["seed"]),
            ),
            tier=int(d["tier"]),
            tenant=str(d["tenant"]),
            arrival_time=float(d["arrival_time"]),
            stop_token_ids=tuple(int(t) for t in d.get("stop_token_ids", ())),
        )


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

    async def why(self, req_id: str) -> dict[str, Any] | None:
        """Why the request went as it did (``cluster.why.WhyReport.to_dict()``), or None."""
        ...

    async def metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""
        ...
