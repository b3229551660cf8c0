"""The router's backend on a Ray cluster: submit to the global scheduler, read the tokens
from the decode workers' per-step batches.

Data flow of ``generate(spec)``::

    shed gate (per tier, from the scheduler's last answers)   -> 429 before any RPC
    scheduler.submit(SubmitBatch)  (concurrent requests share one RPC)
        -> SubmitAnswers: accepted | rejected (retry-after) | invalid | unavailable
    decode.subscribe(router_id)    one stream per decode worker: a TokenBatch per step
    scheduler.notices(router_id)   requests the cluster ended (errors), the shed state
        -> the request's queue -> TokenDelta ... finish
    scheduler.finish(FinishBatch)  client-side timings, batched, after the last token

A request that migrates to another decode worker keeps its stream: the target repeats its
output from index 0 (``TokenDelta.start``) and the router hands on only what it has not
seen, so neither stream's timing can cause a gap or a repeated token.

A request whose decode worker dies (its subscription breaks) or that the cluster ends
with a retryable error (``worker_failed``, ``transfer_failed``, ``scheduler_restarted``)
is retried on the live workers: the new attempt's prompt is the original prompt plus the
tokens already streamed (recompute), so the client sees one uninterrupted answer. A retry
that finds no live worker tries again for up to ``RETRY_PATIENCE_S`` (a replacement may
register meanwhile), then ends with a clear error. Each remote call is awaited with a
timeout; nothing here blocks the event loop.

While the global scheduler is unreachable (its process restarting: a call failed, or the
notice stream broke) new requests get 503 with a Retry-After at once, without an RPC,
and ``/health`` says so; tokens of requests already decoding keep flowing, since they come
from the decode workers directly. When the notice stream opens again the router tells the
scheduler which requests it still waits on (``Claim``): the ones the scheduler came back
without (they were queued there) are retried.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.messages import unpack
from router.backend import (
    BackendError,
    BackendErrorKind,
    FinishReason,
    GenerationSpec,
    TokenDelta,
)
from scheduler.messages import (
    RETRYABLE_ERRORS,
    AbortBatch,
    Claim,
    ClaimAnswer,
    FinishBatch,
    FinishTiming,
    MessageError,
    NoticeBatch,
    SubmitAnswer,
    SubmitAnswers,
    SubmitBatch,
    SubmitOutcome,
    TokenBatch,
    decode,
    encode,
)
from scheduler.messages import TokenDelta as WireDelta

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
FINISH_FLUSH_S = 0.05
RESUBSCRIBE_S = 0.5
# Retry-After for a 503 (no scheduler, no live worker): about a restart of a process.
RETRY_AFTER_S = 2.0
# A retry after a failure waits this long at most for a live worker to take it.
RETRY_PATIENCE_S = 5.0
RETRY_POLL_S = 0.5
# A Claim waits while a restarted scheduler settles (scheduler_actor.SETTLE_GRACE_S).
CLAIM_TIMEOUT_S = 30.0
# A claim that fails is tried again after each of these pauses; when every try failed, the
# requests it named are retried (a request the scheduler does not know would else wait out
# request_timeout_s): about 10 s from the first failure to the retries.
CLAIM_BACKOFF_S = (0.25, 0.5, 1.0, 2.0, 4.0)
# /health answers from the scheduler's liveness of at most this long ago: a flood of
# probes (unauthenticated) costs the scheduler one small call a second, whoever sends them.
HEALTH_CACHE_S = 1.0


class HFTokenizer:
    """The model's own tokenizer and chat template (transformers), for the router."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._vocab_size = len(tokenizer)
        # A token's text is at least as long in UTF-8 as the bytes it stands for (byte-level
        # BPE marks and sentencepiece's byte pieces only make it longer): a safe bound.
        self._max_token_bytes = max(
            (len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab()), default=1)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def max_token_bytes(self) -> int:
        return self._max_token_bytes

    @classmethod
    def from_path(cls, path: str) -> HFTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    @property
    def tool_format(self) -> str | None:
        from router.tools import template_tool_format

        template = getattr(self._tok, "chat_template", None)
        return template_tool_format(template if isinstance(template, str) else None)

    def encode_prompt(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def encode_chat(self, messages: Sequence[dict[str, Any]], **template: Any) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            text = self._tok.apply_chat_template(list(messages), tokenize=False, **template)
            return list(self._tok.encode(text, add_special_tokens=False))
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if template.get("add_generation_prompt", True):
            text += "assistant: "
        return self.encode_prompt(text)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        return str(self._tok.decode([int(token_id)], skip_special_tokens=False))


@dataclass(slots=True)
class _Live:
    queue: asyncio.Queue[WireDelta]
    worker_id: str | None = None
    is_accepted: bool = False  # the scheduler took it: it is in a Claim
    # Output tokens of this attempt handed on so far. A request that migrated to another
    # decode worker gets deltas that say where they sit (``start``): the target repeats
    # the output from 0, and from then on only its stream counts (``indexed_by``).
    num_tokens: int = 0
    indexed_by: str | None = None
    pending: list[WireDelta] = field(default_factory=list)  # after a gap, until it fills

    def accept(self, d: WireDelta, worker_id: str) -> list[WireDelta]:
        """What to hand on of ``d`` from ``worker_id``: every token once, in order,
        whichever of a migration's two streams brings it first."""
        if d.start is None:
            if self.indexed_by is not None and worker_id != self.indexed_by:
                return []  # the source's last tokens: the target repeated them already
            self.num_tokens += len(d.token_ids)
            return [d]
        skip = self.num_tokens - d.start
        if skip < 0:
            self.pending.append(d)  # tokens before it are still on their way
            return []
        self.indexed_by = worker_id
        out: list[WireDelta] = []
        tokens = d.token_ids[skip:]
        if tokens or d.finish or d.error:
            out.append(replace(d, token_ids=tokens, start=None))
            self.num_tokens += len(tokens)
        ready = [p for p in self.pending if p.start is not None and p.start <= self.num_tokens]
        for p in sorted(ready, key=lambda p: p.start or 0):
            self.pending.remove(p)
            out.extend(self.accept(p, worker_id))
        return out


class ClusterBackend:
    def __init__(self, scheduler: Any, decode_handles: dict[str, Any], tokenizer: HFTokenizer,
                 model_name: str, max_model_len: int, rpc_timeout_s: float,
                 request_timeout_s: float, retry_resume_s: float = 7.0, model_root: str = "",
                 model_aliases: tuple[str, ...] = ()) -> None:
        self._model_root = model_root
        self._model_aliases = model_aliases
        self._sched = scheduler
        self._decode = decode_handles
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._rpc_timeout_s = rpc_timeout_s
        self._request_timeout_s = request_timeout_s
        self._retry_resume_s = retry_resume_s
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"
        # The router's request id -> the id of its current attempt in the cluster.
        self._attempt: dict[str, str] = {}
        self._live: dict[str, _Live] = {}  # by attempt id
        self._shed_until: list[float] = []
        self._subs: list[asyncio.Task[None]] = []
        self._pending_submits: list[tuple[GenerationSpec, asyncio.Future[SubmitAnswer]]] = []
        self._submitting: asyncio.Task[None] | None = None
        self._finishes: list[FinishTiming] = []
        self._finisher: asyncio.Task[None] | None = None
        # Since when the global scheduler is unreachable (None: reachable, as far as known).
        self._sched_down_since: float | None = None
        self._health: tuple[float, asyncio.Future[dict[str, Any]]] | None = None
        self._gone_workers: set[str] = set()

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def model_root(self) -> str:
        return self._model_root

    @property
    def model_aliases(self) -> tuple[str, ...]:
        return self._model_aliases

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    # -- subscriptions -------------------------------------------------------------------

    def _ensure_subscriptions(self) -> None:
        if self._subs:
            return
        loop = asyncio.get_running_loop()
        ctx = contextvars.Context()  # nobody's child: Serve must not cancel these
        for wid in self._decode:
            self._subs.append(loop.create_task(self._read_tokens(wid), context=ctx))
        self._subs.append(loop.create_task(self._read_notices(), context=ctx))

    async def _read_tokens(self, worker_id: str) -> None:
        import ray

        while True:
            try:
                gen = self._decode[worker_id].subscribe.options(
                    num_returns="streaming").remote(self.router_id)
                async for ref in gen:
                    batch = decode(await ref, TokenBatch)
                    if worker_id in self._gone_workers:
                        self._gone_workers.discard(worker_id)
                        log.info("decode worker %s streams again", worker_id)
                    for d in batch.deltas:
                        lv = self._live.get(d.req_id)
                        if lv is not None:
                            for kept in lv.accept(d, worker_id):
                                lv.worker_id = worker_id
                                lv.queue.put_nowait(kept)
            except asyncio.CancelledError:
                raise
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if worker_id not in self._gone_workers:  # once per outage, not per retry
                    log.warning("decode worker %s is gone (%s)", worker_id, type(e).__name__)
                    self._gone_workers.add(worker_id)
                await self._lost(worker_id)
            except Exception:  # a broken frame or a transient failure: subscribe again
                log.exception("token stream from %s broke", worker_id)
            await asyncio.sleep(RESUBSCRIBE_S)

    async def _lost(self, worker_id: str) -> None:
        for rid, lv in list(self._live.items()):
            if lv.worker_id == worker_id:
                lv.queue.put_nowait(WireDelta(rid, (), None, "worker_failed"))
        try:  # the scheduler checks (a ping) and replaces it
            await self._rpc(self._sched.worker_failed.remote(worker_id))
        except BackendError:
            log.debug("could not report dead worker %s", worker_id)

    async def _read_notices(self) -> None:
        broke = False
        while True:
            try:
                gen = self._sched.notices.options(num_returns="streaming").remote(self.router_id)
                opened = False
                async for ref in gen:
                    batch = decode(await ref, NoticeBatch)
                    if not opened:
                        opened = True
                        self._scheduler_back()
                        if broke:
                            self._spawn_claim()
                    self._set_shed(batch.shed_s_by_tier)
                    for n in batch.notices:
                        lv = self._live.get(n.req_id)
                        if lv is not None:
                            lv.queue.put_nowait(WireDelta(n.req_id, (), None, n.error))
                broke = True  # the stream ended: the scheduler replaced it or went away
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the scheduler restarting
                broke = True
                self._scheduler_down(e)
            await asyncio.sleep(RESUBSCRIBE_S)

    def _scheduler_down(self, e: BaseException) -> None:
        if self._sched_down_since is None:
            log.warning("the global scheduler is unreachable (%s); answering 503 until it "
                        "is back", type(e).__name__)
            self._sched_down_since = time.monotonic()

    def _scheduler_back(self) -> None:
        if self._sched_down_since is not None:
            log.info("the global scheduler is back after %.1f s",
                     time.monotonic() - self._sched_down_since)
        self._sched_down_since = None

    def _spawn_claim(self) -> None:
        asyncio.get_running_loop().create_task(self._claim(), context=contextvars.Context())

    async def _claim(self) -> None:
        """Tell the (restarted) scheduler which requests this router still waits on; the
        ones it does not know are retried."""
        ids = tuple(aid for aid, lv in self._live.items() if lv.is_accepted)
        unknown: tuple[str, ...] = ids
        for pause in (*CLAIM_BACKOFF_S, None):
            try:
                raw = await self._rpc(
                    self._sched.claim.remote(encode(Claim(self.router_id, ids))), CLAIM_TIMEOUT_S)
                unknown = decode(raw, ClaimAnswer).unknown_req_ids
                break
            except (BackendError, MessageError) as e:
                if pause is None:
                    log.warning("could not claim %d requests (%s): retrying every one", len(ids), e)
                    break
                log.warning("could not claim %d requests (%s): trying again in %.2f s",
                            len(ids), e, pause)
                await asyncio.sleep(pause)
        for aid in unknown:
            lv = self._live.get(aid)
            if lv is not None:
                lv.queue.put_nowait(WireDelta(aid, (), None, "scheduler_restarted"))
        if unknown:
            log.warning("%d of %d requests were lost with the scheduler; retrying them",
                        len(unknown), len(ids))

    def _set_shed(self, shed_s: Sequence[float]) -> None:
        now = time.monotonic()
        self._shed_until = [now + s for s in shed_s]

    def _shed_left(self, tier: int) -> float:
        if tier >= len(self._shed_until):
            return 0.0
        return max(0.0, self._shed_until[tier] - time.monotonic())

    # -- requests ------------------------------------------------------------------------

    async def _rpc(self, ref: Any, timeout: float | None = None) -> Any:
        import ray

        try:
            got = await asyncio.wait_for(ref, timeout or self._rpc_timeout_s)
        except asyncio.TimeoutError:
            raise BackendError(BackendErrorKind.TIMEOUT, "the scheduler did not answer") from None
        except ray.exceptions.RayActorError as e:
            self._scheduler_down(e)
            raise BackendError(BackendErrorKind.UNAVAILABLE, "the scheduler is restarting",
                               retry_after_s=RETRY_AFTER_S) from None
        except ray.exceptions.RayTaskError as e:
            raise BackendError(BackendErrorKind.UNAVAILABLE,
                               f"the scheduler refused: {e.cause!r}",
                               retry_after_s=RETRY_AFTER_S) from None

        self._scheduler_back()  # it answered
        return got

    def _check_scheduler(self) -> None:
        if self._sched_down_since is not None:
            raise BackendError(BackendErrorKind.UNAVAILABLE,
                               "the scheduler is restarting; retry shortly",
                               retry_after_s=RETRY_AFTER_S)

    async def _submit(self, spec: GenerationSpec) -> SubmitAnswer:
        fut: asyncio.Future[SubmitAnswer] = asyncio.get_running_loop().create_future()
        self._pending_submits.append((spec, fut))
        if self._submitting is None or self._submitting.done():
            self._submitting = asyncio.get_running_loop().create_task(
                self._send_submits(), context=contextvars.Context())
        return await fut

    async def _send_submits(self) -> None:
        """One RPC at a time; what arrives meanwhile goes in the next one, together."""
        while self._pending_submits:
            batch, self._pending_submits = self._pending_submits, []
            try:
                raw = await self._rpc(self._sched.submit.remote(encode(SubmitBatch(
                    tuple(s for s, _ in batch)))), self._request_timeout_s)
                answers = decode(raw, SubmitAnswers)
                self._set_shed(answers.shed_s_by_tier)
                by_id = {a.req_id: a for a in answers.answers}
                for spec, fut in batch:
                    if not fut.done():
                        fut.set_result(by_id.get(spec.req_id) or SubmitAnswer(
                            spec.req_id, SubmitOutcome.UNAVAILABLE, "no answer"))
            except (BackendError, MessageError) as e:
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e if isinstance(e, BackendError) else BackendError(
                            BackendErrorKind.UNAVAILABLE, str(e)))

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[TokenDelta]:
        self._ensure_subscriptions()
        self._check_scheduler()
        wait = self._shed_left(spec.tier)
        if wait > 0:
            raise BackendError(BackendErrorKind.REJECTED,
                               f"tier {spec.tier} is being shed (overload)", retry_after_s=wait)
        produced: list[int] = []
        num_seqs = spec.sampling.n
        ended: set[int] = set()  # sequences that have had their finish
        attempt = 0
        failed_at: float | None = None  # monotonic time the last attempt failed
        first_token_time: float | None = None
        current = replace(spec, router_id=self.router_id)
        try:
            while True:
                lv = _Live(asyncio.Queue())
                self._attempt[spec.req_id] = current.req_id
                self._live[current.req_id] = lv
                try:
                    failure = None
                    ans = await self._submit_patiently(current, retrying=attempt > 0)
                    if ans.outcome is SubmitOutcome.REJECTED:
                        raise BackendError(BackendErrorKind.REJECTED,
                                           f"admission rejected the request: {ans.reason}",
                                           retry_after_s=ans.retry_after_s)
                    if ans.outcome is SubmitOutcome.INVALID:
                        raise BackendError(BackendErrorKind.INVALID, ans.reason)
                    if ans.outcome is not SubmitOutcome.ACCEPTED:
                        raise BackendError(BackendErrorKind.UNAVAILABLE,
                                           f"no worker can take the request: {ans.reason}",
                                           retry_after_s=ans.retry_after_s or RETRY_AFTER_S)
                    lv.is_accepted = True
                    while True:
                        d = await self._next_delta(lv, current, failed_at)
                        if d.error:
                            failure = d.error
                            break
                        if d.token_ids and first_token_time is None:
                            first_token_time = time.time()
                        if d.token_ids:
                            failed_at = None  # resumed: the bound is met
                        produced.extend(d.token_ids)
                        finish = FinishReason(d.finish) if d.finish else None
                        if finish is not None:
                            ended.add(d.seq)
                        done = len(ended) >= num_seqs
                        if d.token_ids or finish:
                            if done:
                                self._finish(current, first_token_time, len(produced),
                                             finish.value, spec)  # type: ignore[union-attr]
                            yield TokenDelta(tuple(d.token_ids), finish, d.seq, d.logprobs,
                                             d.prompt_logprobs, d.num_cached_tokens)
                        if done:
                            return
                finally:
                    self._live.pop(current.req_id, None)
                attempt += 1
                if failed_at is None:
                    failed_at = time.monotonic()
                self._finish(current, first_token_time, len(produced), "worker_failed", spec)
                log.warning("request %s attempt %d failed: %s", spec.req_id, attempt, failure)
                left = spec.sampling.max_tokens - len(produced)
                if produced and (num_seqs > 1 or spec.sampling.grammar_kind):
                    # sequences are not resumed one by one, and a grammar would restart
                    raise BackendError(BackendErrorKind.FAILED,
                                       f"the request failed midway: {failure}")
                if failure not in RETRYABLE_ERRORS:
                    raise BackendError(BackendErrorKind.INVALID
                                       if failure.startswith("invalid") else BackendErrorKind.FAILED,
                                       f"the request failed: {failure}")
                if attempt >= MAX_ATTEMPTS or left <= 0:
                    raise BackendError(BackendErrorKind.FAILED,
                                       f"the request failed after {attempt} attempts: {failure}")
                current = replace(
                    current, req_id=f"{spec.req_id}-r{attempt}",
                    prompt_token_ids=spec.prompt_token_ids + tuple(produced),
                    sampling=replace(spec.sampling, max_tokens=left,
                                     min_tokens=max(0, spec.sampling.min_tokens - len(produced)),
                                     prompt_logprobs=None if produced
                                     else spec.sampling.prompt_logprobs))
        finally:
            self._attempt.pop(spec.req_id, None)

    async def _next_delta(self, lv: _Live, current: GenerationSpec,
                          failed_at: float | None) -> WireDelta:
        """The attempt's next delta. A retry that has not produced a token within
        ``retry_resume_s`` of the failure ends with a clear error (its attempt is aborted in
        the cluster): a request in flight when a worker failed resumes or fails within a
        bound, never waits out a replacement's start and a long recompute in silence."""
        if failed_at is None or self._retry_resume_s <= 0:
            return await lv.queue.get()
        left = failed_at + self._retry_resume_s - time.monotonic()
        try:
            return await asyncio.wait_for(lv.queue.get(), max(left, 0.0))
        except TimeoutError:
            await self.abort(current.req_id)
            raise BackendError(
                BackendErrorKind.UNAVAILABLE,
                f"the request's worker failed and its retry did not resume within "
                f"{self._retry_resume_s:g} s (router.retry_resume_timeout_s)",
                retry_after_s=RETRY_AFTER_S) from None

    async def _submit_patiently(self, spec: GenerationSpec, *, retrying: bool) -> SubmitAnswer:
        """Submit; a retry that finds no live worker (or no scheduler), or that admission
        turns away for now, tries again for up to RETRY_PATIENCE_S, so a replacement that
        registers meanwhile, or room that the streams in flight free, takes it: the request
        was admitted once, and a fault is no reason to refuse it at the first look."""
        deadline = time.monotonic() + (RETRY_PATIENCE_S if retrying else 0.0)
        again = (SubmitOutcome.UNAVAILABLE, SubmitOutcome.REJECTED)
        while True:
            try:
                ans = await self._submit(spec)
            except BackendError as e:
                if e.kind is not BackendErrorKind.UNAVAILABLE or time.monotonic() >= deadline:
                    raise
            else:
                if ans.outcome not in again or time.monotonic() >= deadline:
                    return ans
            await asyncio.sleep(RETRY_POLL_S)

    def _finish(self, current: GenerationSpec, first: float | None, n: int, outcome: str,
                original: GenerationSpec) -> None:
        """Queue the request's client-side timings; sent in batches, never awaited by the
        stream (the last token is not held behind a scheduler RPC)."""
        self._finishes.append(FinishTiming(current.req_id, original.arrival_time, first,
                                           time.time(), n, outcome))
        if self._finisher is None or self._finisher.done():
            self._finisher = asyncio.get_running_loop().create_task(
                self._send_finishes(), context=contextvars.Context())

    async def _send_finishes(self) -> None:
        while self._finishes:
            await asyncio.sleep(FINISH_FLUSH_S)
            batch, self._finishes = self._finishes, []
            try:
                await self._rpc(self._sched.finish.remote(encode(FinishBatch(tuple(batch)))))
            except Exception as e:  # metrics only: never fail a request for them
                log.warning("could not send %d finish timings: %s", len(batch), e)

    async def abort(self, req_id: str) -> None:
        rid = self._attempt.get(req_id, req_id)
        try:
            await self._rpc(self._sched.abort.remote(encode(AbortBatch((rid,)))))
        except BackendError:
            log.warning("abort of %s did not reach the scheduler", rid)

    async def health(self) -> dict[str, Any]:
        self._ensure_subscriptions()
        if self._sched_down_since is not None:
            return {"ok": False, "live_workers": {"prefill": 0, "decode": 0},
                    "detail": "the global scheduler is restarting",
                    "down_s": round(time.monotonic() - self._sched_down_since, 1)}
        now = time.monotonic()
        if self._health is None or now - self._health[0] > HEALTH_CACHE_S or (
                self._health[1].done() and self._health[1].exception() is not None):
            # One call in flight, shared by every probe until it is HEALTH_CACHE_S old.
            fut = asyncio.ensure_future(self._scheduler_health())
            self._health = (now, fut)
        return dict(await asyncio.shield(self._health[1]))

    async def _scheduler_health(self) -> dict[str, Any]:
        got = unpack(await self._rpc(self._sched.health.remote()))
        live = got["live_workers"]
        mode = got.get("mode", "disaggregated")
        ok = bool(got.get("ready", True)) and live["decode"] > 0 and (
            live["prefill"] > 0 or mode == "aggregated")
        return {"ok": ok, "live_workers": live, "policy": got["policy"], "mode": mode}

    async def why(self, req_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        return unpack(await self._rpc(self._sched.why.remote(req_id, tenant)))

    async def metrics(self) -> tuple[bytes, str]:
        from router.metrics import CONTENT_TYPE

        return await self._rpc(self._sched.metrics.remote()), CONTENT_TYPE
