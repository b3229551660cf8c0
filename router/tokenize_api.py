"""vLLM's side endpoints for the tokenizer: ``/tokenize`` (a prompt or chat messages to
token ids, with the context length) and ``/detokenize`` (ids to text), and ``/version``.
Both run the tokenizer off the event loop; the server's own model name is not required
(vLLM accepts it, and checks it when given)."""

from __future__ import annotations

import asyncio
from importlib import metadata
from typing import Any

from pydantic import Field

from router.backend import Backend, served_names
from router.protocol import ApiError, ChatMessage, TokenId, _Body, parse_body


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=1 << 20)


def server_version() -> str:
    try:
        return metadata.version("tierserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


class TokenizerApi:
    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in served_names(self.backend):
            raise ApiError(404, f"model {model[:100]!r} does not exist; this server has "
                           f"{self.backend.model_name!r}", param="model",
                           code="model_not_found")

    async def tokenize(self, raw: bytes) -> dict[str, Any]:
        body = parse_body(raw, TokenizeRequest)
        self._check_model(body.model)
        tok = self.backend.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt or messages", param="prompt")
        try:
            if body.messages is not None:
                ids = await asyncio.to_thread(
                    tok.encode_chat, [m.for_template() for m in body.messages],
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message)
            else:
                ids = await asyncio.to_thread(tok.encode_prompt, body.prompt or "",
                                              body.add_special_tokens)
        except (ValueError, TypeError, UnicodeError, KeyError) as e:
            raise ApiError(400, f"cannot tokenize: {str(e)[:200]}") from None
        out: dict[str, Any] = {"count": len(ids), "max_model_len": self.backend.max_model_len,
                               "tokens": list(ids)}
        if body.return_token_strs:
            out["token_strs"] = [tok.token_text(t) for t in ids]
        return out

    async def detokenize(self, raw: bytes) -> dict[str, Any]:
        body = parse_body(raw, DetokenizeRequest)
        self._check_model(body.model)
        tok = self.backend.tokenizer
        if body.tokens and max(body.tokens) >= tok.vocab_size:
            raise ApiError(400, f"token ids must be in [0, {tok.vocab_size})", param="tokens",
                           code="invalid_token_id")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}
