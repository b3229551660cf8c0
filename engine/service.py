"""Running an engine inside an async worker: one engine thread, sampling from the wire.

The engine is not thread-safe and its ``run_plan()`` takes milliseconds to seconds, so a
worker (an async Ray actor) runs every engine call on one dedicated thread
(:class:`EngineThread`): the event loop stays free for control calls and token
streaming, and engine calls never overlap. :func:`sampling_params` turns a request's
wire spec (``scheduler.messages.GenerationSpec``) into the engine's ``SamplingParams``.
Shared by the prefill and decode workers (the floor below both pools).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from engine.books import BooksLock
from engine.grammar import Grammar
from engine.outputs import StepOutput
from engine.sampler import TokenLogprobs
from engine.sampling import SamplingParams
from scheduler.kv_ledger import KVCounters
from scheduler.messages import BlockEvent, GenerationSpec, PreemptMode, TokenDelta
from scheduler.messages import TokenLogprobs as WireLogprobs
from scheduler.prefill_core import PrefillOutput
from scheduler.worker_core import StepResult

T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineThread:
    """Runs callables on one thread, in submission order; with ``books`` (the engine's
    :class:`~engine.books.BooksLock`) each runs holding it, and a step lets it go while
    the model runs, so that the engine's thread-safe calls (``LLMEngine.reserve``) made
    from elsewhere wait for the books, not for the step."""

    def __init__(self, name: str, books: BooksLock | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._books = books

    def _bound(self, fn: Callable[..., T], args: Any, kwargs: Any) -> Callable[[], T]:
        books = self._books
        if books is None:
            return functools.partial(fn, *args, **kwargs)

        def run() -> T:
            with books:
                return fn(*args, **kwargs)

        return run

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._bound(fn, args, kwargs))

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Queue ``fn`` now (ahead of every call made after this returns) and give its
        result as a future: the caller may act on the queued call before it has run."""
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, self._bound(fn, args, kwargs))

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Queue ``fn`` and do not wait for it (a failure is logged): a control call that
        must not wait for the step in flight, such as freeing an aborted request's blocks
        after the forward that may still read them."""
        self.submit(fn, *args).add_done_callback(_log_failure)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("engine call failed", exc_info=fut.exception())


def sampling_params(spec: GenerationSpec, *, max_tokens: int | None = None) -> SamplingParams:
    """The engine's parameters of a request from the wire (ValueError: out of range)."""
    s = spec.sampling
    return SamplingParams(
        max_tokens=s.max_tokens if max_tokens is None else max_tokens,
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, stop_token_ids=spec.stop_token_ids,
        ignore_eos=s.ignore_eos, min_tokens=s.min_tokens, logit_bias=s.logit_bias,
        allowed_token_ids=s.allowed_token_ids, logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs, n=s.n,
        grammar=Grammar(s.grammar_kind, s.grammar) if s.grammar_kind else None)


def wire_logprobs(lps: list[TokenLogprobs] | None) -> tuple[WireLogprobs, ...]:
    return tuple(WireLogprobs(lp.token_id, lp.logprob, lp.rank, tuple(lp.top_token_ids),
                              tuple(lp.top_logprobs)) for lp in lps or ())


def token_delta(out: StepOutput, finish: str | None = None) -> TokenDelta:
    """One engine output as the router gets it (tokens, logprobs, the prompt's on the
    first delta of sequence 0)."""
    return TokenDelta(out.req_id, tuple(out.new_token_ids), finish, None, out.seq,
                      wire_logprobs(out.logprobs), wire_logprobs(out.prompt_logprobs),
                      out.num_cached_tokens if out.prefill_done else 0)


def step_result(out: StepOutput) -> StepResult:
    """One engine output as the worker core takes it (its finish as the router names it)."""
    if out.error is not None:
        return StepResult(out.req_id, error=str(out.error))
    finish = out.finish_reason.value if out.finished and out.finish_reason else None
    if out.finished and finish is None:
        finish = "stop"
    delta = token_delta(out, finish) if out.new_token_ids or finish else None
    return StepResult(out.req_id, delta, finish, bool(out.request_finished))


def prefill_output(out: StepOutput) -> PrefillOutput:
    """One engine output of a prefill step as the prefill core takes it."""
    if out.error is not None:
        return PrefillOutput(out.req_id, error=str(out.error))
    finish = None
    if out.finished:
        finish = out.finish_reason.value if out.finish_reason else "stop"
    done = bool(out.prefill_done)
    return PrefillOutput(out.req_id, tuple(out.ready_block_ids or ()), done,
                         int(out.new_token_ids[0]) if done else 0, finish,
                         token_delta(out) if done else None)


def kv_counters(engine: Any) -> KVCounters:
    """The engine's swap space and prefix-cache figures a worker report carries."""
    swap = engine.swap
    return KVCounters(swap.capacity, swap.num_used, swap.num_peak,
                      engine.num_prefix_query_blocks, engine.num_prefix_hit_blocks)


def shared_prefix_blocks(engine: Any, block_ids: list[int]) -> int:
    """Leading blocks another request holds too (shared prefix blocks come first)."""
    n = 0
    for b in block_ids:
        if engine.pool.ref_count(b) < 2:
            break
        n += 1
    return n


# -- engine operations a worker runs on its engine thread -----------------------------------


def admit_here(engine: Any, req_id: str, spec: GenerationSpec) -> tuple[str | None, int, int]:
    """A request prefilled on this engine, with all of its blocks: (why not, or None; its
    cached prompt tokens; its blocks)."""
    try:
        engine.add_request(req_id, list(spec.prompt_token_ids), sampling_params(spec))
    except ValueError as e:  # the request can never run here
        return f"invalid: {e}", 0, 0
    if not engine.admit(req_id):
        engine.abort(req_id)
        return "no room", 0, 0
    return None, engine.num_computed_tokens(req_id), len(engine.block_ids(req_id))


def reserve_kv(engine: Any, req_id: str, num_tokens: int, tokens: list[int]
               ) -> tuple[list[int] | None, int]:
    """Blocks for ``num_tokens`` of incoming KV (the cached prefix of ``tokens`` first) and
    how many were cached; safe off the engine thread (under the books, which a step lets
    go while the model runs: a dispatch never waits for a forward)."""
    with engine.books:
        blocks = engine.reserve(req_id, num_tokens, prompt_token_ids=tokens)
        return blocks, (0 if blocks is None else engine.num_reserved_cached_blocks(req_id))


def evict(engine: Any, req_id: str, order: Callable[[bool], tuple[PreemptMode, ...]]
          ) -> tuple[PreemptMode | None, int, float]:
    """Evict a decode the first way of ``order(forked)`` that works: (how, or None; its
    blocks; the swap's seconds)."""
    if engine.request_state(req_id) is None:
        return None, 0, 0.0  # it finished in the step that just ran
    n = len(engine.block_ids(req_id))
    for m in order(not engine.can_recompute(req_id)):
        t0 = time.perf_counter()
        if m is PreemptMode.SWAP and engine.swap_out(req_id):
            return m, n, time.perf_counter() - t0
        if m is PreemptMode.RECOMPUTE and engine.preempt_recompute(req_id):
            return m, n, 0.0
    return None, n, 0.0


def swap_in(engine: Any, req_id: str) -> tuple[int, float] | None:
    """Bring a swapped request back: (its blocks, seconds), or None (no room)."""
    t0 = time.perf_counter()
    if not engine.swap_in(req_id):
        return None
    return len(engine.block_ids(req_id)), time.perf_counter() - t0


def add_arrived(engine: Any, req_id: str, spec: GenerationSpec, block_ids: list[int], *,
                first_tokens: int | list[int] | None = None,
                outputs: tuple[int, ...] | None = None) -> None:
    """A request whose KV all arrived in ``block_ids`` joins the engine's decodes: from its
    prefill worker (``first_tokens``) or by migration (``outputs``: its output so far).
    ValueError: it can never decode here."""
    prompt = list(spec.prompt_token_ids)
    if outputs is not None:
        engine.add_migrated_request(req_id, prompt + list(outputs), len(prompt),
                                    sampling_params(spec), block_ids)
    else:
        engine.add_prefilled_request(req_id, prompt, first_tokens, sampling_params(spec),
                                     block_ids)


def run_step(engine: Any, decodes: list[str], chunks: list[tuple[str, int]],
             protect: frozenset[int] | None, *, shared: bool = False) -> tuple[Any, ...]:
    """On the engine thread: the step, then what the planner tracks of each request it
    ran (its blocks, its tokens with KV, with ``shared`` its leading blocks another
    request holds too) and the pool's block events."""
    if protect is not None:
        engine.protect_prefixes(protect)
    outs, refused = engine.run_plan(decodes, chunks)
    blocks, computed, num_shared = {}, {}, {}
    for rid in [*decodes, *(c for c, _ in chunks)]:
        if engine.request_state(rid) is not None:
            ids = engine.block_ids(rid)
            blocks[rid] = len(ids)
            computed[rid] = engine.num_computed_tokens(rid)
            if shared:
                num_shared[rid] = shared_prefix_blocks(engine, ids)
    return outs, refused, blocks, computed, num_shared, block_events(engine.drain_events())


def engine_status(engine: Any) -> dict[str, Any]:
    """The engine's figures a worker's ``status()`` shows."""
    return {"num_free_blocks": engine.num_free_blocks, "num_total_blocks": engine.num_total_blocks,
            "num_prefix_query_blocks": engine.num_prefix_query_blocks,
            "num_prefix_hit_blocks": engine.num_prefix_hit_blocks}


def bytes_per_block(engine: Any) -> int:
    lay = engine.pool.kv_layout()
    elem = lay.dtype.itemsize if hasattr(lay.dtype, "itemsize") else 4
    return int(lay.num_layers * 2 * lay.block_size * lay.num_kv_heads * lay.head_dim * elem)


def block_events(events: list[Any]) -> list[BlockEvent]:
    """The engine pool's block events as wire messages (what the prefix mirror reads)."""
    out = []
    for e in events:
        d = e.to_dict()
        out.append(BlockEvent(d.get("type") == "stored", tuple(d["block_hashes"]),
                              d.get("parent_hash")))
    return out
