"""The HTTP layer: an OpenAI-compatible FastAPI app over a :class:`~router.backend.Backend`.

Data flow of one request::

    headers ──AccessGate (router/access.py)──▶ tenant (401 / 415 / 413 before any body)
    body bytes (at most router.max_body_bytes) ──parse_body──▶ request model
      ──router/serving.py: parameters checked, tier, prompts tokenized off the event
      loop──▶ GenerationSpec per prompt ──backend.generate──▶ TokenDelta stream
      ──router/generation.py (per sequence: stop strings, logprobs)──▶ JSON body, or SSE
      chunks ("data: {...}", "[DONE]")

Side endpoints: ``/v1/models`` (with ``root`` and ``max_model_len``), ``/tokenize``,
``/detokenize``, ``/version`` (router/tokenize_api.py).

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
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.access import AccessGate, read_body
from router.backend import Backend, BackendError, served_names
from router.protocol import ApiError, ChatCompletionRequest, CompletionRequest
from router.responses import models_body
from router.serving import (
    REQUEST_ID_HEADER,
    RequestObserver,
    RequestTiming,
    RouterSettings,
    Serving,
    api_error,
)
from router.tenants import TenantDirectory, TenantEntry
from router.tokenize_api import TokenizerApi, TokenizeRequest, server_version

log = logging.getLogger(__name__)

__all__ = ["REQUEST_ID_HEADER", "RequestObserver", "RequestTiming", "RouterSettings",
           "build_app"]


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
        raise api_error(e) from None


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

    serving = Serving(backend, tenants, cfg, observer)
    tokenizer_api = TokenizerApi(backend)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.complete(await read_body(request, cfg.max_body_bytes), request,
                                      chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.complete(await read_body(request, cfg.max_body_bytes), request,
                                      chat=False)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(models_body(served_names(backend), backend.max_model_len,
                                        backend.model_root))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        return JSONResponse(await tokenizer_api.tokenize(
            await read_body(request, cfg.max_body_bytes)))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        return JSONResponse(await tokenizer_api.detokenize(
            await read_body(request, cfg.max_body_bytes)))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": server_version()})

    @app.post("/v1/embeddings")
    @app.post("/v1/responses")
    async def not_served(request: Request) -> JSONResponse:
        raise ApiError(404, f"{request.url.path} is not served: this server generates text "
                       "(/v1/completions, /v1/chat/completions)", code="unsupported_endpoint")

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
              "/v1/completions": CompletionRequest, "/tokenize": TokenizeRequest},
        tenants.requires_key)
    return app

