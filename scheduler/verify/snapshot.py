"""Structural snapshots of kernel objects, for state hashing and branching copies.

The exhaustive checker keeps one copy of the world per branch and one key per
visited state. Both work on the drivers' object graphs (the cluster scheduler,
the worker schedulers, the policy, whatever its class) without knowing them:
:func:`fingerprint` flattens an object graph into a hashable tuple (leaves
with type and length markers), :func:`state_copy` deep-copies its mutable
parts. Both keep sharing: an object reached twice is copied once, and walked
once (later visits leave a back-reference), so cycles (the cluster scheduler's
estimate points back at it) and shared requests cost nothing extra.

What is left out or shared: configuration passed in ``skip``/``keep`` by id
and the :data:`CONFIG_TYPES` (the service estimate and the step-cost models,
which the checker never trains); callables; :data:`STAT_ATTRS` and
:data:`DERIVED_ATTRS`. Requests are
keyed by the world itself, so inside these graphs a request stands for its id.

Wait queues and the prefix mirror have canonical forms (:data:`CANONICAL`):
what decides their future, not their layout. A heap's entries are sorted, its
insertion counter is replaced by the entries' ranks (only their order is ever
compared), and entries of finished requests are dropped (a finished request
is never queued again). Two states whose queues would hand out the same
requests in the same order, now and after any future push, get one key.
"""

from __future__ import annotations

import ast
import enum
import functools
import itertools
import math
import types
from collections import OrderedDict, deque
from collections.abc import Callable

from scheduler.deadlines import LinearEstimate
from scheduler.prefix_index import PrefixMirror
from scheduler.queues import HeapQueue, SlackQueue, SortedQueue
from scheduler.request import Request
from scheduler.step_costs import StepCosts

_CALLABLES = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial,
              type)


# Attributes that are statistics only: no decision reads them, so two states that
# differ only there have the same future (left out of the state key).
STAT_ATTRS = frozenset({"num_lookup_blocks", "num_hit_blocks", "total_demand", "total_served",
                        "num_preemptions", "num_steps"})
# Attributes that only keep what is computed from the rest of the state (the cluster
# scheduler's decode books and worker lists, a prefill book's seconds): two states that
# differ only there decide alike (left out of the state key, copied as they are).
DERIVED_ATTRS = frozenset({"_books", "_same_domain", "_prefill_list", "_decode_list",
                           "_site_ids", "_tier_coefs", "_tier_s", "_tier_changed",
                           "_total_costs", "_total_coefs", "_total_s"})
_UNKEYED = STAT_ATTRS | DERIVED_ATTRS
# Immutable here: shared by copies, left out of keys.
CONFIG_TYPES: tuple[type, ...] = (LinearEstimate, StepCosts)
_ATOMIC = (type(None), bool, int, float, str, bytes, enum.Enum, range)
_attr_cache: dict[type, tuple[str, ...]] = {}
_REF = object()  # marks a back-reference to an object already walked
# Exact types whose values stand for themselves in a key (floats are rounded instead).
_PLAIN = frozenset({type(None), bool, int, str, bytes})
# Exact types a copy shares as they are (immutable); grows with the types met.
_SHARED: set[type] = set(_PLAIN | {float})
_walked_cache: dict[type, tuple[str, ...]] = {}


def _walked_slots(cls: type) -> tuple[str, ...]:
    names = _walked_cache.get(cls)
    if names is None:
        names = _walked_cache[cls] = tuple(n for n in _slot_names(cls) if n not in _UNKEYED)
    return names


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


def _live(entries, req_at: int) -> list:  # type: ignore[no-untyped-def]
    return [e for e in entries if not e[req_at].state.is_finished]


def _ranks(*seq_lists: list[int]) -> dict[int, int]:
    return {s: i for i, s in enumerate(sorted(set(itertools.chain(*seq_lists))))}


def _kept(d: dict[str, object], ids: set[str]) -> tuple:
    return tuple(sorted((k, v) for k, v in d.items() if k in ids))


_EMPTY_SLACK = ((), (), (), (), (), (), ())


def _canon_slack(q: SlackQueue) -> tuple[tuple, tuple]:
    if not (q.live or q._key or q._starving_seq or q._starving or any(q._feasible)
            or any(q._hopeless)):
        return _EMPTY_SLACK, (q.policy,)
    feasible = [_live(h, 4) for h in q._feasible]
    hopeless = [_live(h, 2) for h in q._hopeless]
    starving = _live(q._starving, 2)
    ids = set(q.live)
    ids.update(e[4].req_id for h in feasible for e in h)
    ids.update(e[2].req_id for h in hopeless for e in h)
    ids.update(e[2].req_id for e in starving)
    starving_seq = {k: v for k, v in q._starving_seq.items() if k in ids}
    rank = _ranks([e[3] for h in feasible for e in h], [e[1] for h in hopeless for e in h],
                  [e[1] for e in starving], list(starving_seq.values()))
    return ((tuple(q.live),
             tuple(tuple(sorted((k, w, a, rank[s], r.req_id) for k, w, a, s, r in h))
                   for h in feasible),
             tuple(tuple(sorted((k, rank[s], r.req_id) for k, s, r in h)) for h in hopeless),
             tuple(sorted((a, rank[s], r.req_id) for a, s, r in starving)),
             tuple(sorted((k, rank[s]) for k, s in starving_seq.items())),
             _kept(q._key, ids), _kept(q._lst, ids)), (q.policy,))


def _canon_heap(q: HeapQueue) -> tuple[tuple, tuple]:
    heaps = [_live(h, 2) for h in q._heaps]
    rank = _ranks(*([e[1] for e in h] for h in heaps))
    return ((tuple(q.live), q.long_threshold,
             tuple(tuple(sorted((k, rank[s], r.req_id) for k, s, r in h)) for h in heaps)), ())


def _canon_sorted(q: SortedQueue) -> tuple[tuple, tuple]:
    return (tuple(q.live),), (q.policy,)


def _canon_mirror(m: PrefixMirror) -> tuple[tuple, tuple]:
    return tuple(sorted((h, tuple(sorted(ws))) for h, ws in m._holders.items())), ()


# Per class: (a hashable leaf of atoms, the objects it refers to, walked as usual).
CANONICAL: dict[type, Callable[[object], tuple[tuple, tuple]]] = {
    SlackQueue: _canon_slack,  # type: ignore[dict-item]
    HeapQueue: _canon_heap,  # type: ignore[dict-item]
    SortedQueue: _canon_sorted,  # type: ignore[dict-item]
    PrefixMirror: _canon_mirror,  # type: ignore[dict-item]
}

_KIND: dict[type, int] = {}
(_K_ATOM, _K_FLOAT, _K_SEQ, _K_MAP, _K_SET, _K_FN, _K_OBJ, _K_CFG, _K_REQ,
 _K_CANON) = range(10)


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
        elif issubclass(t, CONFIG_TYPES):
            k = _K_CFG
        elif issubclass(t, Request):
            k = _K_REQ
        elif any(c in CANONICAL for c in t.__mro__):
            k = _K_CANON
        else:
            k = _K_OBJ
        _KIND[t] = k
    return k


def _canonical(t: type) -> Callable[[object], tuple[tuple, tuple]]:
    return next(CANONICAL[c] for c in t.__mro__ if c in CANONICAL)


def fingerprint(obj: object, skip: frozenset[int]) -> tuple:
    """A hashable structural snapshot of ``obj``: a flat tuple of its leaves with
    type and length markers (floats to 1e-9). Objects whose id is in ``skip``
    (immutable configuration), :data:`CONFIG_TYPES`, callables, :data:`STAT_ATTRS` and
    :data:`DERIVED_ATTRS`
    are left out; a request is its id; queues and the prefix mirror are walked in
    their canonical forms; an object met again is a back-reference. Dict order is
    kept (it may decide iteration order), sets are sorted.
    """
    out: list[object] = []
    append = out.append
    seen: dict[int, int] = {}
    kinds = _KIND
    plain = _PLAIN
    isfinite = math.isfinite

    def walk(x: object) -> None:  # noqa: C901 - one dispatch, kept flat for speed
        t = type(x)
        if t in plain:
            append(x)
            return
        k = kinds.get(t)
        if k is None:
            k = _kind(t)
        if k == _K_FLOAT:
            append(round(x, 9) if math.isfinite(x) else x)  # type: ignore[arg-type]
        elif k == _K_ATOM:
            append(x)
        elif k == _K_SEQ:
            for y in x:  # type: ignore[attr-defined]
                if type(y) not in plain:
                    break
            else:
                append(tuple(x))  # type: ignore[arg-type]
                return
            append(len(x))  # type: ignore[arg-type]
            for v in x:  # type: ignore[attr-defined]
                tv = type(v)
                if tv in plain:
                    append(v)
                else:
                    kv = kinds.get(tv)
                    if kv == _K_FLOAT:
                        append(round(v, 9) if isfinite(v) else v)  # type: ignore[arg-type]
                    elif kv == _K_ATOM:
                        append(v)
                    elif kv == _K_REQ:
                        append(v.req_id)  # type: ignore[attr-defined]
                    elif kv == _K_CFG:
                        pass
                    elif id(v) in skip:
                        append("<cfg>")
                    else:
                        walk(v)
        elif k == _K_MAP:
            append(len(x))  # type: ignore[arg-type]
            for key, v in x.items():  # type: ignore[attr-defined]
                if type(key) in plain:
                    append(key)
                else:
                    walk(key)
                tv = type(v)
                if tv in plain:
                    append(v)
                else:
                    kv = kinds.get(tv)
                    if kv == _K_FLOAT:
                        append(round(v, 9) if isfinite(v) else v)  # type: ignore[arg-type]
                    elif kv == _K_ATOM:
                        append(v)
                    elif kv == _K_REQ:
                        append(v.req_id)  # type: ignore[attr-defined]
                    elif kv == _K_CFG:
                        pass
                    elif id(v) in skip:
                        append("<cfg>")
                    else:
                        walk(v)
        elif k == _K_REQ:
            append(x.req_id)  # type: ignore[attr-defined]
        elif k == _K_OBJ or k == _K_CANON:
            i = id(x)
            if i in skip:
                append("<cfg>")
                return
            n = seen.get(i)
            if n is not None:
                append(_REF)
                append(n)
                return
            seen[i] = len(seen)
            append(t)
            if k == _K_CANON:
                leaf, refs = _canonical(t)(x)
                append(leaf)
                for y in refs:
                    walk(y)
                return
            d = getattr(x, "__dict__", None)
            if d is not None:
                for name, v in d.items():
                    if name in _UNKEYED:
                        continue
                    tv = type(v)
                    if tv in plain:
                        append(v)
                    else:
                        kv = kinds.get(tv)
                        if kv == _K_FLOAT:
                            append(round(v, 9) if isfinite(v) else v)  # type: ignore[arg-type]
                        elif kv == _K_ATOM:
                            append(v)
                        elif kv == _K_REQ:
                            append(v.req_id)  # type: ignore[attr-defined]
                        elif kv == _K_CFG:
                            pass
                        elif id(v) in skip:
                            append("<cfg>")
                        else:
                            walk(v)
            names = _walked_cache.get(t)
            if names is None:
                names = _walked_slots(t)
            for name in names:
                v = getattr(x, name, _REF)
                if v is _REF:
                    continue
                tv = type(v)
                if tv in plain:
                    append(v)
                else:
                    kv = kinds.get(tv)
                    if kv == _K_FLOAT:
                        append(round(v, 9) if isfinite(v) else v)  # type: ignore[arg-type]
                    elif kv == _K_ATOM:
                        append(v)
                    elif kv == _K_REQ:
                        append(v.req_id)  # type: ignore[attr-defined]
                    elif kv == _K_CFG:
                        pass
                    elif id(v) in skip:
                        append("<cfg>")
                    else:
                        walk(v)
        elif k == _K_SET:
            append(len(x))  # type: ignore[arg-type]
            out.extend(sorted(x, key=repr))  # type: ignore[call-overload]

    walk(obj)
    return tuple(out)


def _copy_count(c: itertools.count) -> itertools.count:
    """A copy of a counter at the same position (its repr is the only public view)."""
    inner = repr(c)[len("count("):-1]
    if inner.isdigit():
        return itertools.count(int(inner))
    args = ast.literal_eval(f"({inner},)")
    return itertools.count(*args)


# How state_copy treats a type: shared as is, or copied as a list, dict, ... object.
_C_SHARE, _C_LIST, _C_DICT, _C_ODICT, _C_SET, _C_TUPLE, _C_DEQUE, _C_COUNT, _C_OBJ = range(9)
_COPY_KIND: dict[type, int] = {}


def _copy_kind(t: type) -> int:
    k = _COPY_KIND.get(t)
    if k is None:
        params = getattr(t, "__dataclass_params__", None)
        if t in (list, dict, OrderedDict, set, tuple, deque, itertools.count):
            k = (_C_LIST, _C_DICT, _C_ODICT, _C_SET, _C_TUPLE, _C_DEQUE, _C_COUNT)[
                (list, dict, OrderedDict, set, tuple, deque, itertools.count).index(t)]
        elif (issubclass(t, _ATOMIC) or t is frozenset or issubclass(t, _CALLABLES)
              or issubclass(t, CONFIG_TYPES) or (params is not None and params.frozen)):
            k = _C_SHARE
        else:
            k = _C_OBJ
        _COPY_KIND[t] = k
        if k == _C_SHARE:
            _SHARED.add(t)
    return k


def state_copy(obj: object, keep: dict[int, object]) -> object:
    """Deep copy of mutable state; objects in ``keep`` (by id) are shared, as are
    atomic values, callables, :data:`CONFIG_TYPES` and frozen dataclasses. Sharing
    within ``obj`` is kept (``keep`` is also the memo: pass one dict to copy several
    objects that share parts)."""
    shared = _SHARED
    kinds = _COPY_KIND

    def cp(x: object) -> object:  # noqa: C901 - one dispatch, kept flat for speed
        t = type(x)
        if t in shared:
            return x
        k = kinds.get(t)
        if k is None:
            k = _copy_kind(t)
        if k == _C_SHARE:
            return x
        i = id(x)
        got = keep.get(i)
        if got is not None:
            return got
        new: object
        if k == _C_LIST:
            for y in x:  # type: ignore[attr-defined]
                if type(y) not in shared:
                    new = [cp(y) for y in x]  # type: ignore[attr-defined]
                    break
            else:
                new = list(x)  # type: ignore[call-overload]
        elif k == _C_TUPLE:
            for y in x:  # type: ignore[attr-defined]
                if type(y) not in shared:
                    break
            else:
                return x
            items = [cp(y) for y in x]  # type: ignore[attr-defined]
            new = x if all(a is b for a, b in zip(items, x, strict=True)) else tuple(items)  # type: ignore[call-overload]
        elif k == _C_DICT:
            for v in x.values():  # type: ignore[attr-defined]
                if type(v) not in shared:
                    new = {key: cp(v) for key, v in x.items()}  # type: ignore[attr-defined]
                    break
            else:
                new = dict(x)  # type: ignore[call-overload]
        elif k == _C_OBJ:
            new = object.__new__(t)
            keep[i] = new
            d = getattr(x, "__dict__", None)
            if d is not None:
                nd = new.__dict__
                for key, v in d.items():
                    nd[key] = v if type(v) in shared else cp(v)
            for name in _slot_names(t):
                v = getattr(x, name, _REF)
                if v is not _REF:
                    object.__setattr__(new, name, v if type(v) in shared else cp(v))
            return new
        elif k == _C_SET:
            new = set(x)  # type: ignore[call-overload]
        elif k == _C_ODICT:
            new = OrderedDict((key, cp(v)) for key, v in x.items())  # type: ignore[attr-defined]
        elif k == _C_DEQUE:
            new = deque((cp(y) for y in x), maxlen=x.maxlen)  # type: ignore[attr-defined]
        else:
            new = _copy_count(x)  # type: ignore[arg-type]
        keep[i] = new
        return new

    return cp(obj)
