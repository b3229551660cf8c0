"""The door of the HTTP layer: who may call, with what, and how much, before any parsing.

Data flow of every HTTP request (a pure ASGI middleware around the FastAPI app)::

    headers ──AccessGate──▶ 401 no/unknown key (every path but the open ones: /health,
      and /metrics where configured)
      ──▶ 415 a body that is not ``application/json`` (blocks the blind cross-site POSTs a
          web page can send to a local server without a CORS preflight)
      ──▶ 413 a ``Content-Length`` over the body limit
      ──▶ the app, with the caller's tenant in ``request.state.tenant``
    body ──read_body──▶ 413 as soon as the bytes read pass the limit (chunked bodies)

So a key is checked before the body is read, and no body over the limit is ever held in
memory or parsed. Refusals are OpenAI-style error bodies, like every other error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from router.protocol import ApiError
from router.tenants import TenantDirectory

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON_TYPE = "application/json"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _error(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def too_large(limit: int) -> ApiError:
    return ApiError(413, f"request body is larger than {limit} bytes (router.max_body_bytes)",
                    code="body_too_large")


class AccessGate:
    """Authenticates, checks the content type and the declared size; the app reads the
    tenant from ``request.state.tenant``."""

    def __init__(self, app: Any, *, tenants: TenantDirectory, open_paths: Collection[str],
                 max_body_bytes: int) -> None:
        self.app = app
        self.tenants = tenants
        self.open_paths = frozenset(open_paths)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        try:
            tenant = None
            if scope["path"] not in self.open_paths:
                tenant = self.tenants.authenticate(headers.get("authorization"))
            if scope["method"] in _BODY_METHODS:
                self._check_body_headers(headers)
        except ApiError as err:
            await _error(err)(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    def _check_body_headers(self, headers: dict[str, str]) -> None:
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if ctype != JSON_TYPE:
            shown = ctype[:64] or "none"
            raise ApiError(415, f"content type {shown!r} is not accepted: send the body as "
                           f"JSON with 'Content-Type: {JSON_TYPE}'", code="unsupported_media_type")
        declared = headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise ApiError(400, "Content-Length is not an integer") from None
            if size > self.max_body_bytes:
                raise too_large(self.max_body_bytes)


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 once more than ``limit`` bytes arrive."""
    parts: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        parts.append(chunk)
    return b"".join(parts)
