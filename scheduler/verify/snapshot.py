"""Structural snapshots of kernel objects, for state hashing and branching copies.

The exhaustive checker keeps one copy of the world per branch and one key per
visited state. Both work on any policy object without knowing its class:
:func:`fingerprint` flattens an object graph into a hashable tuple (leaves
with type and length markers), :func:`state_copy` deep-copies its mutable
parts. Immutable configuration passed in ``skip``/``keep`` (tier config,
service estimate, link costs) is shared, not walked.
"""

from __future__ import annotations

import enum
import functools
import math
import types
from collections import OrderedDict, deque

_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial,
              type)


# Attributes that are statistics only: no decision reads them, so two states that
# differ only there have the same future (left out of the state key).
STAT_ATTRS = frozenset({"num_lookup_blocks", "num_hit_blocks", "total_demand", "total_served"})
_ATOMIC = (type(None), bool, int, float, str, bytes, enum.Enum, range)
_attr_cache: dict[type, tuple[str, ...]] = {}


def _slot_names(cls: type) -> tuple[str, ...]:
    names = _attr_cache.get(cls)
    if names is None:
        seen: list[str] = []
        for c in cls.__mro__:
            for n in getattr(c, "__slots__", ()):
                if n not in ("__dict__", "__weakref__") and n not in seen:
                    seen.append(n)
        names = _attr_cache[cls] = tuple(seen)
    return names


def _is_frozen(obj: object) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    return params is not None and params.frozen


_KIND: dict[type, int] = {}
_K_ATOM, _K_FLOAT, _K_SEQ, _K_MAP, _K_SET, _K_FN, _K_OBJ = range(7)


def _kind(t: type) -> int:
    k = _KIND.get(t)
    if k is None:
        if t is float:
            k = _K_FLOAT
        elif issubclass(t, _ATOMIC):
            k = _K_ATOM
        elif t in (list, tuple, deque):
            k = _K_SEQ
        elif t in (dict, OrderedDict):
            k = _K_MAP
        elif t in (set, frozenset):
            k = _K_SET
        elif issubclass(t, _CALLABLES):
            k = _K_FN
        else:
            k = _K_OBJ
        _KIND[t] = k
    return k


def fingerprint(obj: object, skip: frozenset[int]) -> tuple:
    """A hashable structural snapshot of ``obj``: a flat tuple of its leaves with
    type and length markers (floats to 1e-9). Objects whose id is in ``skip``
    (immutable configuration), callables and :data:`STAT_ATTRS` are left out;
    dict order is kept (it may decide iteration order), sets are sorted.
    """
    out: list[object] = []
    _walk(obj, skip, out)
    return tuple(out)


def _walk(obj: object, skip: frozenset[int], out: list[object]) -> None:
    t = type(obj)
    k = _KIND.get(t)
    if k is None:
        k = _kind(t)
    if k == _K_ATOM:
        out.append(obj)
    elif k == _K_FLOAT:
        out.append(round(obj, 9) if math.isfinite(obj) else obj)  # type: ignore[arg-type]
    elif k == _K_SEQ:
        out.append(len(obj))  # type: ignore[arg-type]
        for x in obj:  # type: ignore[attr-defined]
            _walk(x, skip, out)
    elif k == _K_MAP:
        out.append(len(obj))  # type: ignore[arg-type]
        for key, v in obj.items():  # type: ignore[attr-defined]
            _walk(key, skip, out)
            _walk(v, skip, out)
    elif k == _K_SET:
        out.append(len(obj))  # type: ignore[arg-type]
        out.extend(sorted(obj, key=repr))  # type: ignore[call-overload]
    elif k == _K_OBJ:
        if id(obj) in skip:
            out.append("<cfg>")
            return
        out.append(t)
        d = getattr(obj, "__dict__", None)
        if d is not None:
            for name, v in d.items():
                if name not in STAT_ATTRS:
                    _walk(v, skip, out)
        for name in _slot_names(t):
            if name not in STAT_ATTRS and hasattr(obj, name):
                _walk(getattr(obj, name), skip, out)


def state_copy(obj: object, keep: dict[int, object]) -> object:
    """Deep copy of mutable state; objects in ``keep`` (by id) are shared, as are
    atomic values, callables and frozen dataclasses. Sharing within ``obj`` is kept."""
    if isinstance(obj, _ATOMIC):
        return obj
    i = id(obj)
    got = keep.get(i)
    if got is not None:
        return got
    t = type(obj)
    new: object
    if t is list:
        new = [state_copy(x, keep) for x in obj]  # type: ignore[attr-defined]
    elif t is dict:
        new = {k: state_copy(v, keep) for k, v in obj.items()}  # type: ignore[attr-defined]
    elif t is OrderedDict:
        new = OrderedDict((k, state_copy(v, keep)) for k, v in obj.items())  # type: ignore[attr-defined]
    elif t is set:
        new = set(obj)  # type: ignore[call-overload]
    elif t is tuple:
        new = tuple(state_copy(x, keep) for x in obj)  # type: ignore[attr-defined]
    elif t is deque:
        new = deque((state_copy(x, keep) for x in obj), maxlen=obj.maxlen)  # type: ignore[attr-defined]
    elif t is frozenset or isinstance(obj, _CALLABLES) or _is_frozen(obj):
        return obj
    else:
        new = object.__new__(t)
        keep[i] = new
        d = getattr(obj, "__dict__", None)
        if d is not None:
            nd = new.__dict__
            for k, v in d.items():
                nd[k] = state_copy(v, keep)
        for name in _slot_names(t):
            if hasattr(obj, name):
                object.__setattr__(new, name, state_copy(getattr(obj, name), keep))
        return new
    keep[i] = new
    return new
