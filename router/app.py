"""The HTTP layer: an OpenAI-compatible FastAPI app over a :class:`~router.backend.Backend`.

Data flow of one request::

    headers ──AccessGate (router/access.py)──▶ tenant (401 / 415 / 413 before any body)
    body bytes (at most router.max_body_bytes) ──parse_body──▶ request model
      ──TenantDirectory.tier_for──▶ tier
      ──length bound, then tokenize off the event loop, id and length checks──▶
      GenerationSpec ──backend.generate──▶ TokenDelta stream
      ──TextAssembler (stop strings)──▶ JSON body, or SSE chunks ("data: {...}", "[DONE]")

Every refusal is an :class:`~router.protocol.ApiError` rendered as an OpenAI error
body, and so is every other error, from any layer (an unexpected one is a 500 with an
``internal_error`` body, never a plain-text page). Backend failures map to
429/503/504/500/400. ``/openapi.json`` publishes the request bodies' JSON schemas. A client that goes away (the task is
cancelled) or a stop string ends the stream and aborts the request in the backend,
which frees its blocks. Nothing here knows about Ray: the Serve deployment in
``cluster/router_deployment.py`` wraps this app around the cluster backend.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.access import AccessGate, read_body
from router.backend import (
    Backend,
    BackendError,
    BackendErrorKind,
    FinishReason,
    GenerationSpec,
    SamplingSpec,
    TokenDelta,
)
from router.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chunk_body,
    completion_body,
    models_body,
    parse_body,
    usage,
)
from router.tenants import TIER_HEADER, TenantDirectory, TenantEntry
from router.text import TextAssembler

log = logging.getLogger(__name__)

# Serve sets its own x-request-id; ours names the request for /v1/requests/{id}/why.
REQUEST_ID_HEADER = "x-tierserve-request-id"


@dataclass(frozen=True, slots=True)
class RouterSettings:
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    request_timeout_s: float = 600.0
    health_timeout_s: float = 5.0
    # Bodies over this are refused (413) before they are read in full or parsed.
    max_body_bytes: int = 4 << 20
    # /metrics without a key even when keys are required (a scraper inside the cluster).
    open_metrics: bool = False


@dataclass(slots=True)
class RequestTiming:
    """One finished HTTP request, for metrics: times are ``time.time()`` seconds."""

    req_id: str
    tenant: str
    tier: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    prompt_tokens: int
    completion_tokens: int
    # "stop" | "length" | "client_gone" | a BackendErrorKind value
    outcome: str


class RequestObserver(Protocol):
    def on_request_done(self, timing: RequestTiming) -> None: ...


_STATUS = {
    BackendErrorKind.REJECTED: (429, "rate_limit_error"),
    BackendErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    BackendErrorKind.TIMEOUT: (504, "timeout"),
    BackendErrorKind.FAILED: (500, "internal_error"),
    BackendErrorKind.INVALID: (400, "invalid_request_error"),
}


def _api_error(err: BackendError) -> ApiError:
    status, type_ = _STATUS[err.kind]
    headers = {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, int(round(err.retry_after_s))))
    return ApiError(status, err.message, type_=type_, code=err.kind.value, headers=headers)


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


async def _backend_call(call: Any, timeout_s: float) -> Any:
    """A read-side backend call (metrics, why) with its failures as API errors."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(504, "the cluster did not answer in time", type_="timeout",
                       code="timeout") from None
    except BackendError as e:
        raise _api_error(e) from None


def _openapi_with_bodies(app: FastAPI, bodies: dict[str, type], requires_key: bool) -> Any:
    """FastAPI's schema plus the request bodies it cannot see (the handlers parse them
    themselves, after the access checks) and the bearer scheme when keys are required."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        ref = "#/components/schemas/{model}"
        for path, model in bodies.items():
            js = model.model_json_schema(ref_template=ref)
            components.update(js.pop("$defs", {}))
            components[model.__name__] = js
            op = schema["paths"][path]["post"]
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": ref.format(model=model.__name__)}}}}
        if requires_key:
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http",
                                                                   "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    return build


def _sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Call:
    """One generation in flight: the backend stream plus its text and timings."""

    def __init__(self, backend: Backend, spec: GenerationSpec, stops: list[str]) -> None:
        self.backend = backend
        self.spec = spec
        self.text = TextAssembler(backend.tokenizer, stops)
        self.stream = backend.generate(spec)
        self.finish: str | None = None
        self.first_token_time: float | None = None
        self.outcome = "client_gone"
        self.deadline = time.monotonic()

    async def next_delta(self) -> str | None:
        """The next text delta, or None once finished (sets ``finish``)."""
        if self.finish is not None:
            return None
        remaining = self.deadline - time.monotonic()
        try:
            delta: TokenDelta = await asyncio.wait_for(anext(self.stream), max(remaining, 0.001))
        except StopAsyncIteration:
            raise BackendError(BackendErrorKind.FAILED, "the stream ended without a finish") from None
        except asyncio.TimeoutError:
            raise BackendError(BackendErrorKind.TIMEOUT, "request ran past its time limit") from None
        if self.first_token_time is None and delta.token_ids:
            self.first_token_time = time.time()
        final = delta.finish is not None
        text = self.text.push(delta.token_ids, final=final)
        if self.text.is_stopped:
            self.finish = FinishReason.STOP.value
        elif final:
            self.finish = delta.finish.value  # type: ignore[union-attr]
        return text

    async def close(self) -> None:
        """Close the stream; abort the request unless it finished on its own."""
        try:
            await self.stream.aclose()
        finally:
            if self.finish is None or self.text.is_stopped:
                await self.backend.abort(self.spec.req_id)


def build_app(
    backend: Backend,
    *,
    tenants: TenantDirectory,
    settings: RouterSettings | None = None,
    observer: RequestObserver | None = None,
) -> FastAPI:
    cfg = settings or RouterSettings()
    app = FastAPI(title="tierserve", docs_url=None, redoc_url=None)
    open_paths = {"/health", *(["/metrics"] if cfg.open_metrics else [])}
    app.add_middleware(AccessGate, tenants=tenants, open_paths=open_paths,
                       max_body_bytes=cfg.max_body_bytes)

    @app.exception_handler(ApiError)
    async def _on_api_error(_: Request, err: ApiError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error_response(ApiError(404, f"no route {request.url.path[:200]}",
                                            code="not_found"))
        if exc.status_code == 405:
            return _error_response(ApiError(
                405, f"method {request.method} not allowed on {request.url.path[:200]}"))
        return _error_response(ApiError(exc.status_code, str(exc.detail)[:200]))

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        return _error_response(ApiError(400, str(first.get("msg", "invalid request"))[:200]))

    @app.exception_handler(Exception)
    async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected %s in the router", type(exc).__name__, exc_info=exc)
        return _error_response(ApiError(500, f"internal error ({type(exc).__name__})",
                                        type_="internal_error", code="internal_error"))

    def _tenant(request: Request) -> TenantEntry:
        return request.state.tenant  # set by AccessGate on every non-open path

    async def _prompt_ids(body: ChatCompletionRequest | CompletionRequest, chat: bool
                          ) -> list[int]:
        """The prompt's token ids, tokenized off the event loop; a text whose length alone
        puts it over the context is refused without tokenizing it."""
        tok = backend.tokenizer
        max_len = backend.max_model_len
        param = "messages" if chat else "prompt"
        if isinstance(body, CompletionRequest):
            prompt = body.prompt_text_or_ids()
            if isinstance(prompt, list):
                if prompt and max(prompt) >= tok.vocab_size:
                    raise ApiError(400, f"prompt token ids must be in [0, {tok.vocab_size})",
                                   param="prompt", code="invalid_token_id")
                return prompt
            texts = [prompt]
        else:
            msgs = [{"role": m.role, "content": m.text()} for m in body.messages]
            texts = [m["content"] for m in msgs]
        num_bytes = sum(len(t.encode("utf-8")) for t in texts)
        at_least = -(-num_bytes // max(1, tok.max_token_bytes))
        if at_least >= max_len:
            raise ApiError(400, f"this model's maximum context length is {max_len} tokens; the "
                           f"prompt has at least {at_least}", param=param,
                           code="context_length_exceeded")
        try:
            if isinstance(body, CompletionRequest):
                return await asyncio.to_thread(tok.encode_prompt, texts[0])
            return await asyncio.to_thread(tok.encode_chat, msgs)
        except (ValueError, TypeError, UnicodeError) as e:
            raise ApiError(400, f"the prompt cannot be tokenized: {str(e)[:200]}",
                           param=param) from None

    async def _spec(body: ChatCompletionRequest | CompletionRequest, request: Request,
                    chat: bool) -> GenerationSpec:
        tenant = _tenant(request)
        tier = tenants.tier_for(tenant, request.headers.get(TIER_HEADER), body.priority)
        if body.model != backend.model_name:
            raise ApiError(404, f"model {body.model[:100]!r} does not exist; this server has "
                           f"{backend.model_name!r}", param="model", code="model_not_found")
        asked = body.requested_max_tokens()
        if asked is not None and not 1 <= asked <= cfg.max_tokens_limit:
            raise ApiError(400, f"max_tokens must be in [1, {cfg.max_tokens_limit}], got "
                           f"{str(asked)[:24]}", param="max_tokens")
        ids = await _prompt_ids(body, chat)
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        max_len = backend.max_model_len
        if len(ids) >= max_len:
            raise ApiError(400, f"this model's maximum context length is {max_len} tokens; the "
                           f"prompt has {len(ids)}", param="messages" if chat else "prompt",
                           code="context_length_exceeded")
        if asked is None:
            max_tokens = min(cfg.default_max_tokens, max_len - len(ids))
        elif len(ids) + asked > max_len:
            raise ApiError(400, f"this model's maximum context length is {max_len} tokens; "
                           f"{len(ids)} prompt tokens + {asked} max_tokens exceed it",
                           param="max_tokens", code="context_length_exceeded")
        else:
            max_tokens = asked
        prefix = "chatcmpl" if chat else "cmpl"
        return GenerationSpec(
            req_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(ids),
            sampling=SamplingSpec(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
            ),
            tier=tier,
            tenant=tenant.name,
            arrival_time=time.time(),
        )

    def _report(call: _Call) -> None:
        if observer is None:
            return
        observer.on_request_done(
            RequestTiming(
                req_id=call.spec.req_id,
                tenant=call.spec.tenant,
                tier=call.spec.tier,
                arrival_time=call.spec.arrival_time,
                first_token_time=call.first_token_time,
                finish_time=time.time(),
                prompt_tokens=len(call.spec.prompt_token_ids),
                completion_tokens=call.text.num_tokens,
                outcome=call.finish or call.outcome,
            )
        )

    async def _complete(raw: bytes, request: Request, chat: bool) -> Response:
        body = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
        spec = await _spec(body, request, chat)
        call = _Call(backend, spec, body.stop_list())
        call.deadline = time.monotonic() + cfg.request_timeout_s
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # Wait for the first delta before answering, so admission errors get a status.
            try:
                first = await call.next_delta()
            except BackendError as e:
                call.outcome = e.kind.value
                await _close(call)
                raise _api_error(e) from None
            except BaseException:
                await _close(call)
                raise
            return StreamingResponse(
                _stream(call, first, chat, include_usage),
                media_type="text/event-stream",
                headers={"cache-control": "no-cache", REQUEST_ID_HEADER: spec.req_id},
            )
        try:
            while call.finish is None:
                await call.next_delta()
        except BackendError as e:
            call.outcome = e.kind.value
            raise _api_error(e) from None
        finally:
            await _close(call)
        use = usage(len(spec.prompt_token_ids), call.text.num_tokens)
        return JSONResponse(
            completion_body(spec.req_id, backend.model_name, call.text.text, call.finish, use,
                            chat=chat),
            headers={REQUEST_ID_HEADER: spec.req_id},
        )

    closing: set[asyncio.Task[None]] = set()

    async def _close(call: _Call) -> None:
        # A fresh context: Ray counts every Ray call made in a request's context as that
        # request's child, and Ray Serve cancels them all when the client hangs up, this
        # abort included. From an empty context it is nobody's child and goes through.
        task = asyncio.get_running_loop().create_task(call.close(),
                                                      context=contextvars.Context())
        closing.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(closing.discard)
        try:
            await asyncio.shield(task)
        finally:
            _report(call)

    async def _stream(
        call: _Call, first: str | None, chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        rid, model = call.spec.req_id, backend.model_name
        try:
            yield _sse(chunk_body(rid, model, first, None, chat=chat, first=True,
                                  include_usage_field=include_usage))
            while call.finish is None:
                text = await call.next_delta()
                if text:
                    yield _sse(chunk_body(rid, model, text, None, chat=chat,
                                          include_usage_field=include_usage))
            yield _sse(chunk_body(rid, model, None, call.finish, chat=chat,
                                  include_usage_field=include_usage))
            if include_usage:
                use = usage(len(call.spec.prompt_token_ids), call.text.num_tokens)
                yield _sse(chunk_body(rid, model, None, None, chat=chat, use=use))
            yield _sse("[DONE]")
        except BackendError as e:
            call.outcome = e.kind.value
            yield _sse(_api_error(e).body())
            yield _sse("[DONE]")
        finally:
            await _close(call)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _complete(await read_body(request, cfg.max_body_bytes), request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(await read_body(request, cfg.max_body_bytes), request, chat=False)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(models_body([backend.model_name], backend.max_model_len))

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            detail = await asyncio.wait_for(backend.health(), cfg.health_timeout_s)
        except (asyncio.TimeoutError, BackendError) as e:
            return JSONResponse({"status": "unavailable", "detail": str(e)}, status_code=503)
        ok = bool(detail.get("ok"))
        return JSONResponse({"status": "ok" if ok else "unavailable", **detail},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        payload, content_type = await _backend_call(backend.metrics(), cfg.health_timeout_s)
        return Response(payload, media_type=content_type)

    @app.get("/v1/requests/{req_id}/why")
    async def why(req_id: str, request: Request) -> JSONResponse:
        # With keys, a tenant sees only its own requests (an unknown id and another
        # tenant's answer alike: 404), and the chain names no other tenant's request.
        viewer = _tenant(request).name if tenants.requires_key else None
        report = await _backend_call(backend.why(req_id, viewer), cfg.health_timeout_s)
        if report is None:
            raise ApiError(404, f"no request {req_id[:100]!r} is known", param="req_id",
                           code="not_found")
        return JSONResponse(report)

    app.openapi = _openapi_with_bodies(  # type: ignore[method-assign]
        app, {"/v1/chat/completions": ChatCompletionRequest,
              "/v1/completions": CompletionRequest}, tenants.requires_key)
    return app

