"""JSON from a client (or from the model) with its nesting bounded.

``json.loads`` recurses once per level and raises ``RecursionError`` (not a ``ValueError``)
past about a thousand levels, and what parses just below that limit can still overflow
whatever walks it next (validation, ``json.dumps``, a grammar compiler). Every JSON text
the router parses goes through :func:`loads`: a document nested deeper than
``MAX_DEPTH`` is a ``ValueError`` like any other bad JSON, so it ends as a 400.
"""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 128  # arrays and objects inside each other; real schemas stay below 30


class TooDeep(ValueError):
    pass


def depth(value: Any) -> int:
    """How deeply arrays and objects nest in ``value`` (a scalar: 0); iterative."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list | tuple):
            continue
        d += 1
        if d > MAX_DEPTH:
            return d
        deepest = max(deepest, d)
        stack.extend((x, d) for x in v)
    return deepest


def check_depth(value: Any, what: str = "JSON") -> Any:
    if depth(value) > MAX_DEPTH:
        raise TooDeep(f"{what} is nested deeper than {MAX_DEPTH} levels")
    return value


def loads(text: str | bytes, what: str = "JSON", **kwargs: Any) -> Any:
    """``json.loads`` whose nesting is bounded: ValueError (``TooDeep``) past MAX_DEPTH."""
    try:
        value = json.loads(text, **kwargs)
    except RecursionError:
        raise TooDeep(f"{what} is nested too deeply") from None
    return check_depth(value, what)
