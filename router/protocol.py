"""The OpenAI-compatible wire format: request bodies, response bodies, error bodies.

Data flow: raw JSON -> :func:`parse_body` -> a validated request model (or an
:class:`ApiError` carrying an HTTP status and an OpenAI-style error body) -> the HTTP
layer in ``router/app.py``; response bodies are built in ``router/responses.py``.
Parameters of vLLM's and OpenAI's APIs that are not honoured are refused by name
(``router/params.py``); other unknown fields are ignored (clients send newer
parameters); known fields must
have the right type and lie in their range (a seed fits 64 signed bits, floats are finite,
token ids are non-negative 32-bit values, stop strings are short), and no string may
hold a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but no tokenizer's input):
what passes here can be packed as msgpack and tokenized. The models' JSON schemas are
what ``/openapi.json`` publishes for the request bodies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from router import json_limits


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
MAX_N = 16  # sequences per request (n, best_of): engine.sampling.MAX_N
MAX_LOGPROBS = 20  # top logprobs per token: engine.sampling.MAX_LOGPROBS
MAX_PROMPTS = 64  # prompts in one /v1/completions request


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False, populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str = ""


class ToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (tool calls with parsed arguments, as
        transformers' templates expect)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args: Any = json_limits.loads(c.function.arguments or "{}")
                except ValueError:
                    args = c.function.arguments
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            out["tool_calls"] = calls
        return out


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Body):
    """vLLM's ``structured_outputs`` (one of its constraints)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


LogitBias = dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]]


class _SamplingFields(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    # tierserve extension: the tier asked for (allowed only where the tenant may override).
    priority: int | None = Field(None, ge=0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    logit_bias: LogitBias | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_special_tokens: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    request_id: str | None = Field(None, max_length=128)
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    echo: bool = False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        for one in [v] if isinstance(v, str) else v or []:
            if len(one) > MAX_STOP_CHARS:
                raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > 300:
            raise ValueError("at most 300 logit_bias entries")
        for key in v:
            if not key.isdigit() or int(key) > MAX_TOKEN_ID:
                raise ValueError(f"logit_bias keys are token ids, got {key[:20]!r}")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_sequences(self) -> int:
        """Sequences the engine generates (best_of for completions)."""
        return self.n

    def logprobs_k(self) -> int | None:
        """Top logprobs per output token (None: none asked)."""
        return None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True
    metadata: dict[str, str] | None = None
    # vLLM: the response carries the prompt as the chat template rendered it
    return_prompt_text: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text or token ids (a list is several prompts)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ApiError(400, "prompt is empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [[int(x) for x in p]]  # type: ignore[union-attr]
        if len(p) > MAX_PROMPTS:
            raise ApiError(400, f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        return [x if isinstance(x, str) else [int(t) for t in x] for x in p]  # type: ignore[misc]

    def num_sequences(self) -> int:
        best = self.best_of if self.best_of is not None else self.n
        if best < self.n:
            raise ApiError(400, f"best_of ({best}) must be at least n ({self.n})",
                           param="best_of")
        if best > self.n and self.stream:
            raise ApiError(400, "best_of greater than n cannot be streamed", param="best_of")
        return best

    def logprobs_k(self) -> int | None:
        return self.logprobs


def parse_body(raw: bytes, model: type[_Body],
               before: Callable[[dict[str, Any]], None] | None = None) -> Any:
    """The validated request model of a JSON body; ``before`` sees the raw object first
    (router.params refuses the parameters it does not honour there)."""
    try:
        data = json_limits.loads(raw, "request body", parse_constant=_no_constant)
    except json_limits.TooDeep as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an over-long integer
        raise ApiError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    where = _lone_surrogate(data)
    if where is not None:
        raise ApiError(400, f"{where or 'body'}: a string holds a lone UTF-16 surrogate "
                       "(\\ud800-\\udfff escapes must come in valid pairs)", param=where or None)
    if before is not None:
        before(data)
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
