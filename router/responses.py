"""Response bodies in OpenAI's shapes (and vLLM's additions): completions, chat, their
stream chunks, logprobs in each endpoint's format, usage, models.

Logprobs: chat gives ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``,
completions ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``
(with ``echo``, the prompt's tokens come first, the first of them without a logprob).
A token's text is its own decode with special tokens kept, or ``token_id:<id>`` with
``return_tokens_as_token_ids``, as in vLLM.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from router.backend import Tokenizer, TokenLogprobs


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class TokenNamer:
    """Token ids to the strings logprobs show."""

    def __init__(self, tokenizer: Tokenizer, as_ids: bool) -> None:
        self._tok = tokenizer
        self._as_ids = as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        if self._as_ids:
            return f"token_id:{token_id}"
        name = self._cache.get(token_id)
        if name is None:
            name = self._cache[token_id] = self._tok.token_text(token_id)
        return name


def chat_logprobs(lps: Sequence[TokenLogprobs], name: TokenNamer, k: int) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = name(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for lp in lps:
        item = entry(lp.token_id, lp.logprob)
        item["top_logprobs"] = [entry(t, v) for t, v in
                                zip(lp.top_token_ids[:k], lp.top_logprobs[:k], strict=True)]
        content.append(item)
    return {"content": content}


def completion_logprobs(lps: Sequence[TokenLogprobs | None], name: TokenNamer, k: int,
                        offset: int = 0) -> dict[str, Any]:
    """``None`` entries (the prompt's first token) have no logprob and no top list."""
    tokens, values, tops, offsets = [], [], [], []
    pos = offset
    for lp in lps:
        if lp is None:
            continue
        text = name(lp.token_id)
        tokens.append(text)
        values.append(lp.logprob)
        top = {name(t): v for t, v in zip(lp.top_token_ids[:k], lp.top_logprobs[:k],
                                          strict=True)}
        top.setdefault(text, lp.logprob)
        tops.append(top)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


def echo_logprobs(prompt_ids: Sequence[int], prompt_lps: Sequence[TokenLogprobs],
                  name: TokenNamer, k: int) -> dict[str, Any]:
    """The prompt's part of a completion's logprobs under ``echo``: its first token has none."""
    first = name(prompt_ids[0]) if prompt_ids else ""
    rest = completion_logprobs(prompt_lps, name, k, offset=len(first))
    return {"tokens": [first, *rest["tokens"]],
            "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]],
            "text_offset": [0, *rest["text_offset"]]}


def join_logprobs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    shift = (a["text_offset"][-1] + len(a["tokens"][-1])) if a["tokens"] else 0
    return {"tokens": a["tokens"] + b["tokens"],
            "token_logprobs": a["token_logprobs"] + b["token_logprobs"],
            "top_logprobs": a["top_logprobs"] + b["top_logprobs"],
            "text_offset": a["text_offset"] + [o + shift for o in b["text_offset"]]}


def completion_body(req_id: str, model: str, choices: list[dict[str, Any]],
                    use: dict[str, Any], *, chat: bool,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body = {
        "id": req_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": use,
    }
    body.update(extra or {})
    return body


def chat_choice(index: int, content: str | None, finish: str | None, *,
                logprobs: dict[str, Any] | None = None,
                tool_calls: list[dict[str, Any]] | None = None,
                token_ids: list[int] | None = None, stop_reason: Any = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice = {"index": index, "message": message, "logprobs": logprobs,
              "finish_reason": finish, "stop_reason": stop_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def completion_choice(index: int, text: str, finish: str | None, *,
                      logprobs: dict[str, Any] | None = None,
                      token_ids: list[int] | None = None,
                      prompt_logprobs: Any = None) -> dict[str, Any]:
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish,
              "stop_reason": None}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def chunk_body(req_id: str, model: str, choices: list[dict[str, Any]], *, chat: bool,
               use: dict[str, Any] | None = None, include_usage_field: bool = False
               ) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": req_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if use is not None or include_usage_field:
        body["usage"] = use
    return body


def chat_delta(index: int, *, role: bool = False, content: str | None = None,
               tool_calls: list[dict[str, Any]] | None = None, finish: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if role:
        delta["role"] = "assistant"
    if content is not None:
        delta["content"] = content
    if tool_calls:
        delta["tool_calls"] = [dict(c, index=i) for i, c in enumerate(tool_calls)]
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def completion_delta(index: int, text: str, *, finish: str | None = None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def prompt_logprobs_body(prompt_ids: Sequence[int], lps: Sequence[TokenLogprobs],
                         name: TokenNamer) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else a map of
    token id to {logprob, rank, decoded_token} (the prompt token and the top ones)."""
    out: list[dict[str, Any] | None] = [None] if prompt_ids else []
    for lp in lps:
        entry = {str(lp.token_id): {"logprob": lp.logprob, "rank": lp.rank,
                                    "decoded_token": name(lp.token_id)}}
        for r, (t, v) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry.setdefault(str(t), {"logprob": v, "rank": r, "decoded_token": name(t)})
        out.append(entry)
    return out


def models_body(names: list[str], max_model_len: int, root: str) -> dict[str, Any]:
    created = int(time.time())
    return {
        "object": "list",
        "data": [
            {
                "id": n,
                "object": "model",
                "created": created,
                "owned_by": "tierserve",
                "root": root,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [],
            }
            for n in names
        ],
    }
