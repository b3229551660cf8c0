"""A request's output constraint, from whichever of OpenAI's ``response_format``, vLLM's
``structured_outputs`` or its older ``guided_*`` fields it used, as the (kind, text) pair
the engine's grammar takes (``engine.grammar.GrammarKind`` values; the router does not
import the engine: the engine checks the grammar and a bad one comes back as a 400).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from router import json_limits
from router.protocol import ApiError, _SamplingFields

JSON_SCHEMA, JSON_OBJECT, REGEX, CHOICE, LARK = (
    "json_schema", "json_object", "regex", "choice", "lark")
MAX_GRAMMAR_CHARS = 64 << 10


class Constraint(NamedTuple):
    kind: str
    spec: str
    param: str  # the request field it came from: named by the 400 of a grammar the engine refuses


def _schema_text(schema: dict[str, Any] | str, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json_limits.loads(schema, param)
        except json_limits.TooDeep as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None
        except ValueError:
            raise ApiError(400, f"{param}: not a JSON schema (not JSON)", param=param) from None
    else:
        try:
            json_limits.check_depth(schema, param)
        except json_limits.TooDeep as e:
            raise ApiError(400, f"{param}: {e}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"{param}: a JSON schema is an object", param=param)
    return json.dumps(schema)


def request_grammar(body: _SamplingFields) -> Constraint | None:
    """(kind, spec) of the request's constraint, or None; 400 for two at once."""
    found: list[tuple[str, tuple[str, str]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", (JSON_OBJECT, "")))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise ApiError(400, "response_format: json_schema.schema is required",
                           param="response_format")
        found.append(("response_format",
                      (JSON_SCHEMA, _schema_text(rf.json_schema.schema_, "response_format"))))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            found.append(("structured_outputs", (JSON_SCHEMA, _schema_text(
                so.json_, "structured_outputs.json"))))
        if so.regex is not None:
            found.append(("structured_outputs", (REGEX, so.regex)))
        if so.choice is not None:
            found.append(("structured_outputs", (CHOICE, json.dumps(so.choice))))
        if so.grammar is not None:
            found.append(("structured_outputs", (LARK, so.grammar)))
        if so.json_object:
            found.append(("structured_outputs", (JSON_OBJECT, "")))
    if body.guided_json is not None:
        found.append(("guided_json", (JSON_SCHEMA, _schema_text(body.guided_json,
                                                                "guided_json"))))
    if body.guided_regex is not None:
        found.append(("guided_regex", (REGEX, body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", (CHOICE, json.dumps(body.guided_choice))))
    if body.guided_grammar is not None:
        found.append(("guided_grammar", (LARK, body.guided_grammar)))
    if len(found) > 1:
        names = sorted({name for name, _ in found})
        raise ApiError(400, f"{', '.join(names)}: one output constraint per request",
                       param=names[-1])
    if not found:
        return None
    name, (kind, spec) = found[0]
    if len(spec) > MAX_GRAMMAR_CHARS:
        raise ApiError(400, f"{name}: longer than {MAX_GRAMMAR_CHARS} characters", param=name)
    return Constraint(kind, spec, name)
