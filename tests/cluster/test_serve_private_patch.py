"""The one private Ray Serve function tierserve wraps, pinned (issue 24 item 8).

``cluster/router_deployment.py`` makes a direct-ingress replica bind its port with
SO_REUSEADDR by calling Serve's own ``start_asgi_http_server`` with
``enable_so_reuseport=True`` (a replacement replica then serves at once instead of 60 s
later). That function is private: these tests fail on a Ray whose replica module no
longer has it with that keyword, so an upgrade cannot drop the fix silently (the README
says so next to ``router.direct_ingress``)."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest

replica = pytest.importorskip("ray.serve._private.replica")


def test_serve_still_has_the_function_and_its_keyword() -> None:
    start = getattr(replica, "start_asgi_http_server", None)
    assert start is not None, "Ray Serve's replica lost start_asgi_http_server: see the docstring"
    params = inspect.signature(start).parameters
    assert "enable_so_reuseport" in params, "start_asgi_http_server lost enable_so_reuseport"
    assert params["enable_so_reuseport"].kind is inspect.Parameter.KEYWORD_ONLY
    assert inspect.iscoroutinefunction(start)


def test_the_wrapper_asks_for_the_reuse_and_is_installed_once(monkeypatch) -> None:
    from cluster.router_deployment import _reuse_port_for_direct_ingress

    seen: list[dict[str, Any]] = []

    async def fake_start(*args: Any, **kwargs: Any) -> str:
        seen.append(kwargs)
        return "started"

    monkeypatch.setattr(replica, "start_asgi_http_server", fake_start)
    _reuse_port_for_direct_ingress()
    wrapped = replica.start_asgi_http_server
    _reuse_port_for_direct_ingress()  # a second replica in the process: not wrapped twice
    assert replica.start_asgi_http_server is wrapped and wrapped is not fake_start
    assert asyncio.run(wrapped("app", "opts", event_loop=None)) == "started"
    assert seen == [{"event_loop": None, "enable_so_reuseport": True}]
