"""Tool calling: which format a checkpoint's chat template uses, the grammar that forces a
call (``tool_choice`` "required" or a named function), and the parsers that find calls in
the text a model wrote (``tool_choice`` "auto").

Formats (vLLM's ``--tool-call-parser`` names):

* ``hermes`` (NousResearch Hermes 2/3, and Qwen2.5, whose template writes the same
  markup): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text
  before the first call is the message's content.
* ``llama3_json`` (Llama 3.1/3.2/3.3 templates): the whole message is a JSON object
  ``{"name": ..., "parameters": {...}}`` (several separated by ``;``), optionally after the
  ``<|python_tag|>`` token.

A template is taken to support tools when it reads the ``tools`` variable (jinja2's own
analysis of the template); the format from the markup it writes. The forced forms follow
vLLM: a named function's output is its arguments' JSON (schema: its ``parameters``);
"required" outputs a JSON array of ``{"name", "parameters"}`` objects.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from router import json_limits

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


def template_tool_format(template: str | None) -> str | None:
    """The tool format of a chat template, or None when it does not read ``tools``."""
    if not template:
        return None
    try:
        import jinja2
        from jinja2 import meta

        variables = meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except Exception:  # a template jinja2 cannot parse offers nothing to rely on
        return None
    if "tools" not in variables:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or "ipython" in template or '"parameters"' in template:
        return LLAMA3_JSON
    return HERMES


def forced_schema(tools: list[dict[str, Any]], named: str | None) -> dict[str, Any]:
    """The JSON schema a forced call's output follows."""
    if named is not None:
        for t in tools:
            if t["name"] == named:
                return t.get("parameters") or {"type": "object"}
        raise ValueError(f"tool_choice names {named!r}, which is not in tools")
    return {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {
            "name": {"enum": [t["name"]]},
            "parameters": t.get("parameters") or {"type": "object"}},
         "required": ["name", "parameters"]} for t in tools]}}


def parse_forced(text: str, named: str | None) -> list[ParsedCall]:
    """The calls of a forced output (its grammar guarantees the shape unless cut short)."""
    try:
        value = json_limits.loads(text)
    except ValueError:
        return []
    if named is not None:
        return [ParsedCall(named, json.dumps(value))]
    if not isinstance(value, list):
        return []
    return [ParsedCall(str(v["name"]), json.dumps(v.get("parameters", {})))
            for v in value if isinstance(v, dict) and "name" in v]


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_calls(text: str, fmt: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a model's message in ``fmt``; no calls: (text, [])."""
    if fmt == HERMES:
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        calls = [c for c in (_call(m) for m in _HERMES_CALL.findall(text[start:])) if c]
        if not calls:
            return text, []
        content = text[:start].strip()
        return content or None, calls
    if fmt == LLAMA3_JSON:
        body = text.replace("<|python_tag|>", "").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_objects(body):
            call = _call(part, arguments_key="parameters")
            if call is None:
                return text, []
            calls.append(call)
        return (None, calls) if calls else (text, [])
    raise ValueError(f"unknown tool call format {fmt!r}")


def _call(raw: str, arguments_key: str = "arguments") -> ParsedCall | None:
    try:
        value = json_limits.loads(raw)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    return ParsedCall(value["name"], args if isinstance(args, str) else json.dumps(args))


def _split_objects(text: str) -> list[str]:
    """Top-level JSON objects separated by ``;`` (or nothing)."""
    parts, depth, start, in_string, escaped = [], 0, 0, False, False
    for i, c in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            continue
        if c == '"':
            in_string = True
        elif c == "{":
            if depth == 0:
                start = i
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                parts.append(text[start : i + 1])
    return parts


def call_bodies(calls: list[ParsedCall]) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` entries."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
