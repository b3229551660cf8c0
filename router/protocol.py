"""The OpenAI-compatible wire format: request bodies, response bodies, error bodies.

Data flow: raw JSON -> :func:`parse_body` -> a validated request model (or an
:class:`ApiError` carrying an HTTP status and an OpenAI-style error body) -> the HTTP
layer in ``router/app.py``. Response builders return plain dicts ready for JSON or SSE.
Unknown extra fields are ignored (clients send newer parameters); known fields must
have the right type and lie in their range (a seed fits 64 signed bits, floats are finite,
token ids are non-negative 32-bit values, stop strings are short), and no string may
hold a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but no tokenizer's input):
what passes here can be packed as msgpack and tokenized. The models' JSON schemas are
what ``/openapi.json`` publishes for the request bodies.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ApiError(Exception):
    """A request the router refuses; rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# torch's generator seeds and msgpack's integers: a seed is one signed 64-bit value (vLLM's range).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_STOP_CHARS = 256  # a stop string is searched for after every token: keep it short
MAX_TOKEN_ID = 2**31 - 1

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(_Body):
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=1)
    # tierserve extension: the tier asked for (allowed only where the tenant may override).
    priority: int | None = Field(None, ge=0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        for one in [v] if isinstance(v, str) else v or []:
            if len(one) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId]

    def prompt_text_or_ids(self) -> str | list[int]:
        if isinstance(self.prompt, str):
            return self.prompt
        if all(isinstance(p, int) for p in self.prompt):
            return [int(p) for p in self.prompt]  # type: ignore[arg-type]
        if len(self.prompt) != 1:
            raise ApiError(400, "only one prompt per request is supported", param="prompt")
        return str(self.prompt[0])


def parse_body(raw: bytes, model: type[_Body]) -> Any:
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "request body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        raise ApiError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    where = _lone_surrogate(data)
    if where is not None:
        raise ApiError(400, f"{where or 'body'}: a string holds a lone UTF-16 surrogate "
                       "(\\ud800-\\udfff escapes must come in valid pairs)", param=where or None)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = "; ".join(
            f"{'.'.join(str(p) for p in it['loc'])}: {it['msg']}" for it in e.errors()[:5]
        )
        raise ApiError(400, msg, param=param) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _lone_surrogate(data: Any) -> str | None:
    """The path of the first string holding an unpaired surrogate ("" for a key), or None."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else str(k)
                if not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return path
                stack.append((v, sub))
        elif isinstance(value, list):
            stack.extend((v, f"{path}.{i}") for i, v in enumerate(value))
    return None


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    req_id: str, model: str, text: str, finish: str | None, use: dict[str, int], *, chat: bool
) -> dict[str, Any]:
    created = int(time.time())
    if chat:
        return {
            "id": req_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            ],
            "usage": use,
        }
    return {
        "id": req_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
        "usage": use,
    }


def chunk_body(
    req_id: str,
    model: str,
    text: str | None,
    finish: str | None,
    *,
    chat: bool,
    first: bool = False,
    use: dict[str, int] | None = None,
    include_usage_field: bool = False,
) -> dict[str, Any]:
    created = int(time.time())
    if use is not None:
        choices: list[dict[str, Any]] = []
    elif chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text:
            delta["content"] = text
        elif first:
            delta["content"] = ""
        choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    else:
        choices = [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]
    body: dict[str, Any] = {
        "id": req_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if use is not None or include_usage_field:
        body["usage"] = use
    return body


def models_body(names: list[str], max_model_len: int) -> dict[str, Any]:
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "tierserve",
                "max_model_len": max_model_len,
            }
            for n in names
        ],
    }
