"""Policy specs: a scheduling policy by name, with its settings (``NAME[:key=value,...]``).

``vllm-priority:max_num_batched_tokens=2048,long_prefill_token_threshold=512`` is the vLLM
peer with two of its scheduler flags set; ``tierserve:admission=off`` is tierserve with
one of its mechanisms turned off (an ablation); ``tierserve:wfq`` is the short form of
``tierserve:ordering=wfq``. Each policy declares what it takes as a frozen dataclass of
settings whose fields are the documented flags of the system it reproduces (or
tierserve's mechanisms), with their defaults. :func:`parse_spec` reads the text,
:func:`build_settings` checks it against a policy's dataclass and converts the values;
an unknown key or a bad value raises :class:`PolicySpecError` naming both. A list of
specs (``--policies``) is split by :func:`split_specs`: a comma-separated part of the
form ``key=value`` belongs to the spec before it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
_TRUE = frozenset({"on", "true", "yes", "1"})
_FALSE = frozenset({"off", "false", "no", "0"})


class PolicySpecError(ValueError):
    """A spec that names an unknown setting or gives it a bad value."""


@dataclass(frozen=True, slots=True)
class PolicySpec:
    """A policy name and its settings in the order given (values as text)."""

    name: str
    settings: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        """The spec as text (what results are keyed by)."""
        if not self.settings:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.settings)

    def with_settings(self, **values: object) -> PolicySpec:
        """This spec with ``values`` set (replacing given ones, appended otherwise)."""
        out = dict(self.settings)
        out.update({k: _text(v) for k, v in values.items()})
        return PolicySpec(self.name, tuple(out.items()))


def _text(v: object) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def parse_spec(text: str, short_key: str | None = None) -> PolicySpec:
    """``NAME[:key=value,...]``; a bare ``value`` after the colon sets ``short_key``."""
    name, sep, rest = text.strip().partition(":")
    name = name.strip()
    if not name:
        raise PolicySpecError(f"policy spec {text!r}: no policy name")
    settings: list[tuple[str, str]] = []
    if sep:
        for part in rest.split(","):
            part = part.strip()
            if not part:
                continue
            key, eq, value = part.partition("=")
            if not eq:
                if short_key is None or settings:
                    raise PolicySpecError(f"policy spec {text!r}: {part!r} is not key=value")
                key, value = short_key, part
            key, value = key.strip(), value.strip()
            if not key or not value:
                raise PolicySpecError(f"policy spec {text!r}: {part!r} is not key=value")
            if any(k == key for k, _ in settings):
                raise PolicySpecError(f"policy spec {text!r}: {key} given twice")
            settings.append((key, value))
    return PolicySpec(name, tuple(settings))


def split_specs(text: str) -> list[str]:
    """``a:k=v,k2=v2,b`` -> ``["a:k=v,k2=v2", "b"]``."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" in part and ":" not in part and out and ":" in out[-1]:
            out[-1] += "," + part
        else:
            out.append(part)
    return out


def build_settings(cls: type[T], spec: PolicySpec) -> T:
    """An instance of the settings dataclass ``cls`` with ``spec``'s values; every field
    has a default, and a value converts to its default's type."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, raw in spec.settings:
        f = fields.get(key)
        if f is None:
            valid = ", ".join(fields) or "none"
            raise PolicySpecError(f"{spec.name}: unknown setting {key!r}; valid: {valid}")
        values[key] = _convert(spec.name, key, raw, f.default)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise PolicySpecError(f"{spec.name}: {e}") from None


def _convert(name: str, key: str, raw: str, default: object) -> object:
    where = f"{name}: {key}={raw!r}"
    if isinstance(default, bool):
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise PolicySpecError(f"{where} is not on or off")
    if isinstance(default, int):
        try:
            return int(raw)
        except ValueError:
            raise PolicySpecError(f"{where} is not an integer") from None
    if isinstance(default, float):
        try:
            return float(raw)
        except ValueError:
            raise PolicySpecError(f"{where} is not a number") from None
    return raw


__all__ = ["PolicySpec", "PolicySpecError", "build_settings", "parse_spec", "split_specs"]
