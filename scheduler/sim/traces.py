"""Trace readers: Azure 2023 CSV, Mooncake JSONL, synthetic Poisson.

Each reader returns :class:`TraceRequest`s sorted by arrival, rebased to start
at 0. Tiers come from a ``tier`` column when the trace has one, else from a
seeded :class:`scheduler.tiers.TierMix` (default 10/40/30/20 %). Load is scaled
by compressing time (``load`` 2 = arrivals twice as dense). Mooncake's
``hash_ids`` are prefix identities of 512-token blocks: equal ids, equal
prefix KV. A malformed line raises :class:`TraceError` naming file and line.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import numpy as np

from scheduler.tiers import TierMix

MOONCAKE_BLOCK_TOKENS = 512
DEFAULT_MIX = TierMix()


class TraceError(ValueError):
    """A malformed trace: the message names the file and the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    req_id: str
    arrival: float
    prompt_len: int
    output_len: int
    tier: int
    # Prefix identity per ``hash_block_tokens`` tokens (empty: no sharing known).
    hashes: tuple[int, ...] = ()
    hash_block_tokens: int = MOONCAKE_BLOCK_TOKENS


def _tiers(n: int, given: list[int | None], mix: TierMix, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    drawn = rng.choice(len(mix.fractions), size=n, p=np.array(mix.fractions))
    return [int(d) if g is None else g for g, d in zip(given, drawn, strict=True)]


def _positive_int(raw: object, what: str, where: str) -> int:
    try:
        v = int(raw)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {what} {raw!r} is not an integer") from None
    if v < 0:
        raise TraceError(f"{where}: {what} {v} is negative")
    return v


def _tier(raw: object, where: str, num_tiers: int) -> int | None:
    if raw is None or raw == "":
        return None
    t = _positive_int(raw, "tier", where)
    if t >= num_tiers:
        raise TraceError(f"{where}: tier {t} is not below {num_tiers}")
    return t


def read_azure(path: str | Path, mix: TierMix = DEFAULT_MIX, seed: int = 0) -> list[TraceRequest]:
    path = Path(path)
    rows: list[tuple[float, int, int, int | None]] = []
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceError(f"{path}:1: empty file, expected an Azure 2023 CSV header")
        cols = {h.strip(): i for i, h in enumerate(header)}
        for need in ("TIMESTAMP", "ContextTokens", "GeneratedTokens"):
            if need not in cols:
                raise TraceError(f"{path}:1: header lacks column {need!r}")
        tier_col = cols.get("Tier", cols.get("tier"))
        for lineno, row in enumerate(reader, start=2):
            where = f"{path}:{lineno}"
            if len(row) < len(cols):
                raise TraceError(f"{where}: {len(row)} fields, expected {len(cols)}")
            ts = row[cols["TIMESTAMP"]].strip()
            head, _, frac = ts.partition(".")
            try:
                t = datetime.strptime(f"{head}.{(frac + '000000')[:6]}", "%Y-%m-%d %H:%M:%S.%f")
            except ValueError:
                raise TraceError(f"{where}: bad TIMESTAMP {ts!r}") from None
            rows.append((t.timestamp(),
                         _positive_int(row[cols["ContextTokens"]], "ContextTokens", where),
                         _positive_int(row[cols["GeneratedTokens"]], "GeneratedTokens", where),
                         _tier(row[tier_col] if tier_col is not None else None, where,
                               len(mix.fractions))))
    if not rows:
        raise TraceError(f"{path}:2: no requests")
    t0 = min(r[0] for r in rows)
    tiers = _tiers(len(rows), [r[3] for r in rows], mix, seed)
    out = [TraceRequest(f"az{i}", r[0] - t0, max(r[1], 1), max(r[2], 1), tiers[i])
           for i, r in enumerate(rows)]
    out.sort(key=lambda r: r.arrival)
    return out


def read_mooncake(path: str | Path, mix: TierMix = DEFAULT_MIX, seed: int = 0) -> list[TraceRequest]:
    path = Path(path)
    rows: list[tuple[float, int, int, tuple[int, ...], int | None]] = []
    with path.open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise TraceError(f"{where}: expected a JSON object")
            for key in ("timestamp", "input_length", "output_length", "hash_ids"):
                if key not in d:
                    raise TraceError(f"{where}: missing field {key!r}")
            ids = d["hash_ids"]
            if not isinstance(ids, list) or not all(isinstance(h, int) for h in ids):
                raise TraceError(f"{where}: hash_ids must be a list of integers")
            n_in = _positive_int(d["input_length"], "input_length", where)
            if len(ids) != math.ceil(n_in / MOONCAKE_BLOCK_TOKENS):
                raise TraceError(f"{where}: {len(ids)} hash_ids for {n_in} tokens, expected "
                                 f"{math.ceil(n_in / MOONCAKE_BLOCK_TOKENS)}")
            ts = d["timestamp"]
            if not isinstance(ts, int | float) or ts < 0:
                raise TraceError(f"{where}: bad timestamp {ts!r}")
            rows.append((float(ts) / 1000.0, n_in,
                         _positive_int(d["output_length"], "output_length", where),
                         tuple(ids), _tier(d.get("tier"), where, len(mix.fractions))))
    if not rows:
        raise TraceError(f"{path}:1: no requests")
    t0 = min(r[0] for r in rows)
    tiers = _tiers(len(rows), [r[4] for r in rows], mix, seed)
    out = [TraceRequest(f"mc{i}", r[0] - t0, max(r[1], 1), max(r[2], 1), tiers[i], r[3])
           for i, r in enumerate(rows)]
    out.sort(key=lambda r: r.arrival)
    return out


_POISSON_KEYS = {"rate": 5.0, "duration": 60.0, "prompt": 1000.0, "output": 200.0,
                 "prefix_groups": 0.0, "prefix_blocks": 4.0}


def poisson(spec: str, mix: TierMix = DEFAULT_MIX, seed: int = 0) -> list[TraceRequest]:
    """Synthetic: ``rate=R,duration=S,prompt=MEAN,output=MEAN[,prefix_groups=G,prefix_blocks=B]``.

    Lengths are exponential around their means; with ``prefix_groups`` each
    request shares a ``prefix_blocks``-block system prefix with its group.
    """
    vals = dict(_POISSON_KEYS)
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, sep, raw = part.partition("=")
        if not sep or key not in vals:
            raise TraceError(f"poisson spec: {part!r} is not KEY=VALUE with KEY in "
                             f"{', '.join(vals)}")
        try:
            vals[key] = float(raw)
        except ValueError:
            raise TraceError(f"poisson spec: {key}={raw!r} is not a number") from None
        if vals[key] < 0 or (key in ("rate", "duration", "prompt", "output") and vals[key] <= 0):
            raise TraceError(f"poisson spec: {key} must be positive, got {raw}")
    rng = np.random.default_rng(seed)
    n = max(1, int(rng.poisson(vals["rate"] * vals["duration"])))
    arrivals = np.sort(rng.uniform(0.0, vals["duration"], size=n))
    prompts = np.maximum(1, rng.exponential(vals["prompt"], size=n)).astype(int)
    outputs = np.maximum(1, rng.exponential(vals["output"], size=n)).astype(int)
    groups = int(vals["prefix_groups"])
    pb = int(vals["prefix_blocks"])
    tiers = _tiers(n, [None] * n, mix, seed + 1)
    out = []
    next_id = 1_000_000
    for i in range(n):
        hashes: tuple[int, ...] = ()
        if groups:
            g = int(rng.integers(groups))
            nblocks = math.ceil(int(prompts[i]) / MOONCAKE_BLOCK_TOKENS)
            shared = [g * 1000 + j for j in range(min(pb, nblocks))]
            own = list(range(next_id, next_id + nblocks - len(shared)))
            next_id += len(own)
            hashes = tuple(shared + own)
        out.append(TraceRequest(f"ps{i}", float(arrivals[i]), int(prompts[i]), int(outputs[i]),
                                tiers[i], hashes))
    return out


def read_trace(fmt: str, path: str, mix: TierMix = DEFAULT_MIX, seed: int = 0) -> list[TraceRequest]:
    if fmt == "azure":
        return read_azure(path, mix, seed)
    if fmt == "mooncake":
        return read_mooncake(path, mix, seed)
    if fmt == "poisson":
        return poisson(path, mix, seed)
    raise TraceError(f"format {fmt!r}: expected azure, mooncake or poisson")


def guess_format(path: str) -> str:
    if path.endswith(".jsonl"):
        return "mooncake"
    if path.endswith(".csv"):
        return "azure"
    return "poisson"


def scale_load(reqs: list[TraceRequest], load: float, duration: float | None = None) -> list[TraceRequest]:
    """Compress time by ``load``; keep arrivals before ``duration`` (scaled seconds)."""
    if not load > 0:
        raise ValueError(f"load: must be positive, got {load}")
    out = [replace(r, arrival=r.arrival / load) for r in reqs]
    if duration is not None:
        out = [r for r in out if r.arrival < duration]
    return out
