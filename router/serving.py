"""Completions and chat completions: from a parsed request to the backend and back.

Data flow of one request::

    body ──check_params (router/params.py)──▶ request model ──tier, model, limits──▶
    prompts (a completion may carry several) ──tokenize off the event loop (chat: the
    checkpoint's template, with tools)──▶ one GenerationSpec per prompt (n or best_of
    sequences, sampling, the output grammar from response_format / guided_* / a forced
    tool call) ──Generation (router/generation.py)──▶ pieces per sequence
    ──▶ JSON body (best_of keeps the n most likely) or SSE chunks (merged across prompts)

Tool calls are parsed from the finished text (``router/tools.py``); a streamed request
with tools sends its message as one delta at its end, content or tool calls.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.backend import (
    Backend,
    BackendError,
    BackendErrorKind,
    GenerationSpec,
    SamplingSpec,
    served_names,
)
from router.generation import Generation, OutputOptions, Piece
from router.params import check_params
from router.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_body
from router.responses import (
    TokenNamer,
    chat_choice,
    chat_delta,
    chat_logprobs,
    chunk_body,
    completion_body,
    completion_choice,
    completion_delta,
    completion_logprobs,
    echo_logprobs,
    join_logprobs,
    prompt_logprobs_body,
    usage,
)
from router.structured import JSON_SCHEMA, Constraint, request_grammar
from router.tenants import TIER_HEADER, TenantDirectory, TenantEntry
from router.tools import call_bodies, forced_schema, parse_calls, parse_forced

log = logging.getLogger(__name__)

# Serve sets its own x-request-id; ours names the request for /v1/requests/{id}/why.
REQUEST_ID_HEADER = "x-tierserve-request-id"
# chat_template_kwargs may not set what the request's own fields set.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "return_dict", "chat_template", "tokenizer"})


@dataclass(frozen=True, slots=True)
class RouterSettings:
    max_tokens_limit: int = 4096
    default_max_tokens: int = 256
    max_sequences_per_request: int = 64  # prompts x n (or best_of): more is a 400
    request_timeout_s: float = 600.0
    health_timeout_s: float = 5.0
    # Bodies over this are refused (413) before they are read in full or parsed.
    max_body_bytes: int = 4 << 20
    # /metrics without a key even when keys are required (a scraper inside the cluster).
    open_metrics: bool = False


@dataclass(slots=True)
class RequestTiming:
    """One finished HTTP request, for metrics: times are ``time.time()`` seconds."""

    req_id: str
    tenant: str
    tier: int
    arrival_time: float
    first_token_time: float | None
    finish_time: float
    prompt_tokens: int
    completion_tokens: int
    # "stop" | "length" | "client_gone" | a BackendErrorKind value
    outcome: str


class RequestObserver(Protocol):
    def on_request_done(self, timing: RequestTiming) -> None: ...


_STATUS = {
    BackendErrorKind.REJECTED: (429, "rate_limit_error"),
    BackendErrorKind.UNAVAILABLE: (503, "service_unavailable"),
    BackendErrorKind.TIMEOUT: (504, "timeout"),
    BackendErrorKind.FAILED: (500, "internal_error"),
    BackendErrorKind.INVALID: (400, "invalid_request_error"),
}


def api_error(err: BackendError, grammar: Constraint | None = None) -> ApiError:
    """The HTTP error of a backend's; a grammar the engine refused (it compiles them) names
    the request field the grammar came from."""
    status, type_ = _STATUS[err.kind]
    headers = {}
    if err.retry_after_s is not None:
        headers["retry-after"] = str(max(1, int(round(err.retry_after_s))))
    param = None
    if err.kind is BackendErrorKind.INVALID and grammar is not None and (
            "grammar" in err.message):
        param = grammar.param
    return ApiError(status, err.message, type_=type_, code=err.kind.value, headers=headers,
                    param=param)


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass(slots=True)
class ToolPlan:
    """What to do with a chat request's tools: parse calls in ``fmt`` (auto), or read the
    forced output (``forced``: a named function's arguments, or the "required" array)."""

    fmt: str | None
    forced: bool = False
    named: str | None = None
    parallel: bool = True


@dataclass(slots=True)
class Plan:
    """A request ready to run: one spec per prompt and how to answer."""

    body: ChatCompletionRequest | CompletionRequest
    chat: bool
    response_id: str
    specs: list[GenerationSpec]
    opts: OutputOptions
    n: int  # choices returned per prompt
    k: int | None  # top logprobs per token (None: none asked)
    echo_texts: list[str] = field(default_factory=list)
    tools: ToolPlan | None = None
    grammar: Constraint | None = None


class Serving:
    def __init__(self, backend: Backend, tenants: TenantDirectory, cfg: RouterSettings,
                 observer: RequestObserver | None) -> None:
        self.backend = backend
        self.tenants = tenants
        self.cfg = cfg
        self.observer = observer
        self._closing: set[asyncio.Task[None]] = set()

    # -- preparing ----------------------------------------------------------------------

    async def _tokenize_chat(self, body: ChatCompletionRequest, tools: ToolPlan | None
                             ) -> list[int]:
        tok = self.backend.tokenizer
        if body.continue_final_message and body.add_generation_prompt:
            raise ApiError(400, "continue_final_message needs add_generation_prompt: false",
                           param="continue_final_message")
        kwargs = dict(body.chat_template_kwargs or {})
        bad = sorted(RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if bad:
            raise ApiError(400, f"chat_template_kwargs: {bad[0]} is set by its own field",
                           param="chat_template_kwargs")
        template: dict[str, Any] = dict(kwargs, add_generation_prompt=body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message)
        if body.documents:
            template["documents"] = body.documents
        if tools is not None and body.tools:
            template["tools"] = [t.model_dump(exclude_none=True) for t in body.tools]
        msgs = [m.for_template() for m in body.messages]
        self._length_bound([m["content"] for m in msgs], "messages")
        try:
            ids = await asyncio.to_thread(tok.encode_chat, msgs, **template)
        except (ValueError, TypeError, UnicodeError, KeyError) as e:
            raise ApiError(400, f"the messages cannot be rendered: {str(e)[:200]}",
                           param="messages") from None
        if body.add_special_tokens:
            ids = list(tok.encode_prompt(tok.decode(ids, skip_special_tokens=False),
                                         add_special_tokens=True))
        return ids

    def _length_bound(self, texts: list[str], param: str) -> None:
        """A text whose length alone puts it over the context is refused without
        tokenizing it."""
        tok = self.backend.tokenizer
        max_len = self.backend.max_model_len
        num_bytes = sum(len(t.encode("utf-8")) for t in texts)
        at_least = -(-num_bytes // max(1, tok.max_token_bytes))
        if at_least >= max_len:
            raise ApiError(400, f"this model's maximum context length is {max_len} tokens; "
                           f"the prompt has at least {at_least}", param=param,
                           code="context_length_exceeded")

    async def _tokenize_prompt(self, prompt: str | list[int], add_special: bool) -> list[int]:
        tok = self.backend.tokenizer
        if isinstance(prompt, list):
            if prompt and max(prompt) >= tok.vocab_size:
                raise ApiError(400, f"prompt token ids must be in [0, {tok.vocab_size})",
                               param="prompt", code="invalid_token_id")
            return prompt
        self._length_bound([prompt], "prompt")
        try:
            return await asyncio.to_thread(tok.encode_prompt, prompt, add_special)
        except (ValueError, TypeError, UnicodeError) as e:
            raise ApiError(400, f"the prompt cannot be tokenized: {str(e)[:200]}",
                           param="prompt") from None

    def _tool_plan(self, body: ChatCompletionRequest) -> ToolPlan | None:
        choice = body.tool_choice
        if not body.tools:
            if choice not in (None, "none", "auto"):
                raise ApiError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        fmt = self.backend.tokenizer.tool_format
        if fmt is None:
            raise ApiError(400, "tools: this model's chat template has no tool support (it "
                           "never reads `tools`)", param="tools", code="tools_not_supported")
        if choice in (None, "auto"):
            return ToolPlan(fmt, parallel=body.parallel_tool_calls)
        named = None if choice == "required" else choice.function.name  # type: ignore[union-attr]
        return ToolPlan(fmt, forced=True, named=named, parallel=body.parallel_tool_calls)

    async def plan(self, body: ChatCompletionRequest | CompletionRequest, request: Request,
                   chat: bool) -> Plan:
        backend, cfg = self.backend, self.cfg
        tenant: TenantEntry = request.state.tenant
        tier = self.tenants.tier_for(tenant, request.headers.get(TIER_HEADER), body.priority)
        if body.model not in served_names(backend):
            raise ApiError(404, f"model {body.model[:100]!r} does not exist; this server has "
                           f"{backend.model_name!r}", param="model", code="model_not_found")
        asked = body.requested_max_tokens()
        if asked is not None and not 1 <= asked <= cfg.max_tokens_limit:
            raise ApiError(400, f"max_tokens must be in [1, {cfg.max_tokens_limit}], got "
                           f"{str(asked)[:24]}", param="max_tokens")
        if body.stream_options is not None and not body.stream:
            # as vLLM: options of a stream that is not one would be accepted and ignored
            raise ApiError(400, "stream_options: only with stream: true",
                           param="stream_options")
        num_seqs = body.num_sequences()
        num_prompts = 1 if chat else len(body.prompts())  # type: ignore[union-attr]
        if num_prompts * num_seqs > cfg.max_sequences_per_request:
            raise ApiError(400, f"the request asks for {num_prompts * num_seqs} sequences "
                           f"({num_prompts} prompts x {num_seqs}); at most "
                           f"{cfg.max_sequences_per_request} per request",
                           param="best_of" if body.num_sequences() > body.n else "n")
        k = body.logprobs_k()
        tools = self._tool_plan(body) if isinstance(body, ChatCompletionRequest) else None
        grammar = request_grammar(body)
        if tools is not None and tools.forced:
            if grammar is not None:
                raise ApiError(400, "tool_choice forces a call: no other output constraint",
                               param="tool_choice")
            try:
                schema = forced_schema([t.function.model_dump() for t in body.tools or []],
                                       tools.named)
            except ValueError as e:
                raise ApiError(400, str(e), param="tool_choice") from None
            grammar = Constraint(JSON_SCHEMA, json.dumps(schema), "tool_choice")
        if isinstance(body, ChatCompletionRequest):
            prompts = [await self._tokenize_chat(body, tools)]
            last = body.messages[-1]
            echo_texts = [last.text() if body.echo and last.role == "assistant" else ""]
        else:
            add_special = bool(body.add_special_tokens)
            prompts = [await self._tokenize_prompt(p, add_special) for p in body.prompts()]
            echo_texts = []
            if body.echo:
                tok = backend.tokenizer
                echo_texts = [p if isinstance(p, str) else tok.decode(p)
                              for p in body.prompts()]
        max_len = backend.max_model_len
        param = "messages" if chat else "prompt"
        specs = []
        prefix = "chatcmpl" if chat else "cmpl"
        response_id = f"{prefix}-{body.request_id or uuid.uuid4().hex}"
        vocab = backend.tokenizer.vocab_size
        for token_ids in prompts:
            ids = _truncate(token_ids, body.truncate_prompt_tokens, body.truncation_side,
                            max_len)
            if not ids:
                raise ApiError(400, "the prompt is empty", param=param)
            if len(ids) >= max_len:
                raise ApiError(400, f"this model's maximum context length is {max_len} "
                               f"tokens; the prompt has {len(ids)}", param=param,
                               code="context_length_exceeded")
            if asked is None:
                max_tokens = min(cfg.default_max_tokens, max_len - len(ids))
            elif len(ids) + asked > max_len:
                raise ApiError(400, f"this model's maximum context length is {max_len} "
                               f"tokens; {len(ids)} prompt tokens + {asked} max_tokens "
                               "exceed it", param="max_tokens", code="context_length_exceeded")
            else:
                max_tokens = asked
            if body.min_tokens > max_tokens:
                raise ApiError(400, f"min_tokens ({body.min_tokens}) exceeds max_tokens "
                               f"({max_tokens})", param="min_tokens")
            specs.append(self._spec(body, ids, max_tokens, num_seqs, k, grammar, tier,
                                    tenant.name, vocab))
        return Plan(body, chat, response_id, specs,
                    OutputOptions(tuple(body.stop_list()), body.include_stop_str_in_output,
                                  body.skip_special_tokens, body.min_tokens),
                    body.n, k, echo_texts, tools, grammar)

    def _spec(self, body: ChatCompletionRequest | CompletionRequest, ids: list[int],
              max_tokens: int, num_seqs: int, k: int | None, grammar: Constraint | None,
              tier: int, tenant: str, vocab: int) -> GenerationSpec:
        bias = tuple(sorted((int(t), float(b)) for t, b in (body.logit_bias or {}).items()))
        named = [t for t, _ in bias] + list(body.allowed_token_ids or ())
        named += list(body.stop_token_ids or ())
        if any(t >= vocab for t in named):
            raise ApiError(400, f"token ids must be in [0, {vocab})",
                           param="logit_bias" if bias else "allowed_token_ids",
                           code="invalid_token_id")
        # best_of ranks its sequences by their log-probability: ask for the chosen ones
        logprobs = k if k is not None or num_seqs == body.n else 0
        prompt_lps = body.prompt_logprobs
        if isinstance(body, CompletionRequest) and body.echo and k is not None:
            prompt_lps = max(prompt_lps or 0, k)
        prefix = "chatcmpl" if isinstance(body, ChatCompletionRequest) else "cmpl"
        return GenerationSpec(
            req_id=f"{prefix}-{uuid.uuid4().hex}",
            prompt_token_ids=tuple(ids),
            sampling=SamplingSpec(
                max_tokens=max_tokens,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
                top_k=0 if body.top_k in (None, -1) else body.top_k,
                min_p=body.min_p or 0.0,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=(1.0 if body.repetition_penalty is None
                                    else body.repetition_penalty),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                logit_bias=bias,
                allowed_token_ids=tuple(body.allowed_token_ids or ()),
                logprobs=logprobs,
                prompt_logprobs=prompt_lps,
                n=num_seqs,
                grammar_kind=grammar.kind if grammar else "",
                grammar=grammar.spec if grammar else "",
            ),
            tier=tier,
            tenant=tenant,
            arrival_time=time.time(),
            stop_token_ids=tuple(body.stop_token_ids or ()),
        )

    # -- running ------------------------------------------------------------------------

    def _report(self, gen: Generation) -> None:
        if self.observer is None:
            return
        self.observer.on_request_done(RequestTiming(
            req_id=gen.spec.req_id, tenant=gen.spec.tenant, tier=gen.spec.tier,
            arrival_time=gen.spec.arrival_time, first_token_time=gen.first_token_time,
            finish_time=time.time(), prompt_tokens=len(gen.spec.prompt_token_ids),
            completion_tokens=gen.num_tokens, outcome=gen.finish or gen.outcome))

    async def close(self, gen: Generation) -> None:
        # A fresh context: Ray counts every Ray call made in a request's context as that
        # request's child, and Ray Serve cancels them all when the client hangs up, this
        # abort included. From an empty context it is nobody's child and goes through.
        task = asyncio.get_running_loop().create_task(gen.close(),
                                                      context=contextvars.Context())
        self._closing.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._closing.discard)
        try:
            await asyncio.shield(task)
        finally:
            self._report(gen)

    async def complete(self, raw: bytes, request: Request, chat: bool) -> Response:
        model = ChatCompletionRequest if chat else CompletionRequest
        endpoint = "chat" if chat else "completions"
        body = parse_body(raw, model, lambda d: check_params(d, endpoint))
        plan = await self.plan(body, request, chat)
        gens: list[Generation] = []
        deadline = time.monotonic() + self.cfg.request_timeout_s
        for spec in plan.specs:
            gen = Generation(self.backend, spec, plan.opts)
            gen.deadline = deadline
            gens.append(gen)
        headers = {REQUEST_ID_HEADER: plan.specs[0].req_id}
        if body.stream:
            # Wait for each prompt's first piece before answering, so admission errors
            # get a status.
            try:
                firsts = await asyncio.gather(*(g.next() for g in gens))
            except BackendError as e:
                await self._close_all(gens, e.kind.value)
                raise api_error(e, plan.grammar) from None
            except BaseException:
                await self._close_all(gens, None)
                raise
            return StreamingResponse(self._stream(plan, gens, firsts),
                                     media_type="text/event-stream",
                                     headers={"cache-control": "no-cache", **headers})
        try:
            await asyncio.gather(*(self._drain(g) for g in gens))
        except BackendError as e:
            for g in gens:
                g.outcome = e.kind.value
            raise api_error(e, plan.grammar) from None
        finally:
            await asyncio.gather(*(self.close(g) for g in gens))
        return JSONResponse(self._final_body(plan, gens), headers=headers)

    async def _close_all(self, gens: list[Generation], outcome: str | None) -> None:
        for g in gens:
            if outcome is not None:
                g.outcome = outcome
        await asyncio.gather(*(self.close(g) for g in gens))

    @staticmethod
    async def _drain(gen: Generation) -> None:
        while await gen.next() is not None:
            pass

    # -- answers ------------------------------------------------------------------------

    def _usage(self, gens: list[Generation]) -> dict[str, Any]:
        return usage(sum(len(g.spec.prompt_token_ids) for g in gens),
                     sum(g.num_tokens for g in gens),
                     sum(g.num_cached_tokens for g in gens))

    def _final_body(self, plan: Plan, gens: list[Generation]) -> dict[str, Any]:
        body = plan.body
        namer = TokenNamer(self.backend.tokenizer, body.return_tokens_as_token_ids)
        k = plan.k or 0
        choices: list[dict[str, Any]] = []
        extra: dict[str, Any] = {}
        for p, gen in enumerate(gens):
            prompt_ids = list(gen.spec.prompt_token_ids)
            for rank, seq in enumerate(gen.best(plan.n)):
                index = p * plan.n + rank
                text = seq.text.text
                token_ids = list(seq.token_ids) if body.return_token_ids else None
                if plan.chat:
                    lps = chat_logprobs(seq.logprobs, namer, k) if plan.k is not None else None
                    content, calls, finish = self._message(plan, plan.echo_texts[0] + text,
                                                           seq.finish)
                    choices.append(chat_choice(index, content, finish, logprobs=lps,
                                               tool_calls=calls, token_ids=token_ids))
                    continue
                lps = None
                if plan.k is not None:
                    lps = completion_logprobs(seq.logprobs, namer, k)
                echo = plan.echo_texts[p] if plan.echo_texts else ""
                if echo and plan.k is not None:
                    lps = join_logprobs(echo_logprobs(prompt_ids, gen.prompt_logprobs, namer,
                                                      k), lps)  # type: ignore[arg-type]
                prompt_lps = None
                if body.prompt_logprobs is not None:
                    prompt_lps = prompt_logprobs_body(prompt_ids, gen.prompt_logprobs, namer)
                choice = completion_choice(index, echo + text, seq.finish, logprobs=lps,
                                           token_ids=token_ids, prompt_logprobs=prompt_lps)
                if body.return_token_ids:
                    choice["prompt_token_ids"] = prompt_ids
                choices.append(choice)
            if plan.chat:
                if body.return_token_ids:
                    extra["prompt_token_ids"] = prompt_ids
                if body.return_prompt_text:
                    extra["prompt_text"] = self._prompt_text(prompt_ids)
                if body.prompt_logprobs is not None:
                    extra["prompt_logprobs"] = prompt_logprobs_body(
                        prompt_ids, gen.prompt_logprobs, namer)
        return completion_body(plan.response_id, body.model, choices,
                               self._usage(gens), chat=plan.chat, extra=extra)

    def _prompt_text(self, prompt_ids: list[int]) -> str:
        """The prompt as the chat template rendered it (its special tokens included)."""
        return self.backend.tokenizer.decode(prompt_ids, skip_special_tokens=False)

    @staticmethod
    def _message(plan: Plan, text: str, finish: str | None
                 ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
        """(content, tool_calls, finish_reason) of a chat message."""
        tools = plan.tools
        if tools is None:
            return text, None, finish
        if tools.forced:
            calls = parse_forced(text, tools.named)
            content = None if calls else text
        else:
            content, calls = parse_calls(text, tools.fmt or "")
        if not calls:
            return text, None, finish
        if not tools.parallel:
            calls = calls[:1]
        return content, call_bodies(calls), "tool_calls" if finish == "stop" else finish

    async def _stream(self, plan: Plan, gens: list[Generation], firsts: list[Piece | None]
                      ) -> AsyncIterator[bytes]:
        body = plan.body
        chat = plan.chat
        rid, model = plan.response_id, body.model
        opts = body.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        namer = TokenNamer(self.backend.tokenizer, body.return_tokens_as_token_ids)
        k = plan.k or 0
        buffered = plan.tools is not None  # a message with tools goes out whole, at its end

        def chunk(choices: list[dict[str, Any]], extra: dict[str, Any] | None = None
                  ) -> bytes:
            use = self._usage(gens) if continuous else None
            return sse({**chunk_body(rid, model, choices, chat=chat, use=use,
                                     include_usage_field=include_usage), **(extra or {})})

        def piece_chunks(p: int, piece: Piece) -> list[bytes]:
            index = p * plan.n + piece.seq
            out = []
            lps = None
            if plan.k is not None and piece.logprobs:
                lps = (chat_logprobs(piece.logprobs, namer, k) if chat
                       else completion_logprobs(piece.logprobs, namer, k))
            if chat:
                if buffered:
                    if piece.finish is not None:
                        seq = gens[p].seqs[piece.seq]
                        content, calls, finish = self._message(
                            plan, plan.echo_texts[0] + seq.text.text, piece.finish)
                        out.append(chunk([chat_delta(index, content=content, tool_calls=calls,
                                                     finish=finish)]))
                    return out
                if piece.text or lps is not None:
                    out.append(chunk([chat_delta(index, content=piece.text, logprobs=lps)]))
            elif piece.text or lps is not None:
                out.append(chunk([completion_delta(index, piece.text, logprobs=lps)]))
            if piece.finish is not None:
                out.append(chunk([chat_delta(index, finish=piece.finish) if chat
                                  else completion_delta(index, "", finish=piece.finish)]))
            return out

        queue: asyncio.Queue[tuple[int, Piece | BaseException | None]] = asyncio.Queue()

        async def pump(p: int, gen: Generation) -> None:
            try:
                while True:
                    piece = await gen.next()
                    await queue.put((p, piece))
                    if piece is None:
                        return
            except BaseException as e:  # to the stream, which reports it
                await queue.put((p, e))

        tasks: list[asyncio.Task[None]] = []
        try:
            for p, gen in enumerate(gens):
                for seq in range(plan.n):
                    index = p * plan.n + seq
                    if chat:
                        first = chat_delta(index, role=True, content=(
                            None if buffered else plan.echo_texts[0]))
                        extra = None
                        if index == 0 and body.return_prompt_text:  # on the first chunk only
                            extra = {"prompt_text": self._prompt_text(
                                list(gen.spec.prompt_token_ids))}
                        yield chunk([first], extra)
                    elif plan.echo_texts:
                        lps = None
                        if plan.k is not None:
                            lps = echo_logprobs(list(gen.spec.prompt_token_ids),
                                                gen.prompt_logprobs, namer, k)
                        yield chunk([completion_delta(index, plan.echo_texts[p],
                                                      logprobs=lps)])
            for p, piece in enumerate(firsts):
                if piece is not None:
                    for b in piece_chunks(p, piece):
                        yield b
            tasks = [asyncio.get_running_loop().create_task(pump(p, g))
                     for p, g in enumerate(gens) if not g.is_done]
            left = len(tasks)
            while left:
                p, item = await queue.get()
                if item is None:
                    left -= 1
                    continue
                if isinstance(item, BaseException):
                    raise item
                for b in piece_chunks(p, item):
                    yield b
            if include_usage:
                yield sse(chunk_body(rid, model, [], chat=chat, use=self._usage(gens)))
            yield sse("[DONE]")
        except BackendError as e:
            for g in gens:
                g.outcome = e.kind.value
            yield sse(api_error(e).body())
            yield sse("[DONE]")
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*(self.close(g) for g in gens))


def _truncate(ids: list[int], keep: int | None, side: str | None, max_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``keep`` tokens (-1: the context), or
    the first ones with ``truncation_side`` "right"."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_len - 1
    if len(ids) <= keep:
        return ids
    return ids[:keep] if side == "right" else ids[len(ids) - keep :]


CompleteFn = Callable[[bytes, Request, bool], Any]
