"""The router's backend on a Ray cluster: submit to the global scheduler, stream from decode.

Data flow of ``generate(spec)``::

    scheduler.submit(spec) ──▶ {"kind": "placed", decode_worker_id} | rejected | unavailable
    decode.stream(req_id)  (Ray streaming generator) ──▶ {"t": ids, "f": finish, "e": error}
    end: scheduler.finish(req_id, timings)   (metrics, fair share)

A decode worker that dies mid-stream (``RayActorError``) or a stream that ends with an
error (its prefill worker died, the transfer failed) is retried on the live workers:
the new attempt's prompt is the original prompt plus the tokens already streamed
(recompute), so the client sees one uninterrupted answer. Each remote call is awaited
with a timeout; nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from cluster.messages import pack, unpack
from router.backend import (
    BackendError,
    BackendErrorKind,
    FinishReason,
    GenerationSpec,
    SamplingSpec,
    TokenDelta,
)

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 3


class HFTokenizer:
    """The model's own tokenizer and chat template (transformers), for the router."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    @classmethod
    def from_path(cls, path: str) -> HFTokenizer:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def encode_prompt(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            text = self._tok.apply_chat_template(list(messages), tokenize=False,
                                                 add_generation_prompt=True)
            return list(self._tok.encode(text, add_special_tokens=False))
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
        return self.encode_prompt(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=True))


class ClusterBackend:
    def __init__(self, scheduler: Any, decode_handles: dict[str, Any], tokenizer: HFTokenizer,
                 model_name: str, max_model_len: int, rpc_timeout_s: float,
                 request_timeout_s: float) -> None:
        self._sched = scheduler
        self._decode = decode_handles
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._rpc_timeout_s = rpc_timeout_s
        self._request_timeout_s = request_timeout_s
        # The router's request id -> the id of its current attempt in the cluster.
        self._attempt: dict[str, str] = {}

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    async def _rpc(self, ref: Any, timeout: float | None = None) -> Any:
        import ray

        try:
            return await asyncio.wait_for(ref, timeout or self._rpc_timeout_s)
        except asyncio.TimeoutError:
            raise BackendError(BackendErrorKind.TIMEOUT, "the scheduler did not answer") from None
        except ray.exceptions.RayActorError:
            raise BackendError(BackendErrorKind.UNAVAILABLE, "the scheduler is down") from None

    async def generate(self, spec: GenerationSpec) -> AsyncIterator[TokenDelta]:
        import ray

        produced: list[int] = []
        attempt = 0
        first_token_time: float | None = None
        current = spec
        try:
            while True:
                self._attempt[spec.req_id] = current.req_id
                ticket = unpack(await self._rpc(self._sched.submit.remote(pack(current.to_dict())),
                                                self._request_timeout_s))
                kind = ticket["kind"]
                if kind == "rejected":
                    raise BackendError(BackendErrorKind.REJECTED,
                                       f"admission rejected the request: {ticket.get('reason')}",
                                       retry_after_s=ticket.get("retry_after_s"))
                if kind != "placed":
                    raise BackendError(BackendErrorKind.UNAVAILABLE,
                                       f"no worker can take the request: {ticket.get('reason')}")
                decode_id = str(ticket["decode_worker_id"])
                failure: str | None = None
                try:
                    gen = self._decode[decode_id].stream.options(
                        num_returns="streaming").remote(current.req_id)
                    async for ref in gen:
                        item = unpack(await ref)
                        if item.get("e"):
                            failure = str(item["e"])
                            break
                        ids = tuple(int(t) for t in item["t"])
                        if ids and first_token_time is None:
                            first_token_time = time.time()
                        produced.extend(ids)
                        finish = FinishReason(item["f"]) if item.get("f") else None
                        if finish is not None:
                            # Close the books before the last yield: the client may hang
                            # up right after it, which cancels what this task awaits.
                            await self._finish(current, first_token_time, len(produced),
                                               finish.value, spec)
                        if ids or finish:
                            yield TokenDelta(ids, finish)
                        if finish is not None:
                            return
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    failure = f"decode worker {decode_id} died ({type(e).__name__})"
                    await self._report_dead(decode_id)
                if failure is None:
                    failure = "stream ended early"
                attempt += 1
                await self._finish(current, first_token_time, len(produced), "worker_failed")
                log.warning("request %s attempt %d failed: %s", spec.req_id, attempt, failure)
                left = spec.sampling.max_tokens - len(produced)
                if attempt >= MAX_ATTEMPTS or left <= 0:
                    raise BackendError(BackendErrorKind.FAILED,
                                       f"the request failed after {attempt} attempts: {failure}")
                current = replace(
                    spec, req_id=f"{spec.req_id}-r{attempt}",
                    prompt_token_ids=spec.prompt_token_ids + tuple(produced),
                    sampling=SamplingSpec(left, spec.sampling.temperature, spec.sampling.top_p,
                                          spec.sampling.seed))
        finally:
            self._attempt.pop(spec.req_id, None)

    async def _report_dead(self, worker_id: str) -> None:
        try:
            await self._rpc(self._sched.worker_failed.remote(worker_id))
        except BackendError:
            log.warning("could not report dead worker %s", worker_id)

    async def _finish(self, current: GenerationSpec, first: float | None, n: int, outcome: str,
                      original: GenerationSpec | None = None) -> None:
        timing = {"first_token_time": first, "finish_time": time.time(), "num_output_tokens": n,
                  "outcome": outcome,
                  "arrival_time": (original or current).arrival_time}
        try:
            await self._rpc(self._sched.finish.remote(current.req_id, pack(timing)))
        except Exception as e:  # metrics only: never fail the request for them
            log.warning("could not close the books of %s: %s", current.req_id, e)

    async def abort(self, req_id: str) -> None:
        rid = self._attempt.get(req_id, req_id)
        try:
            await self._rpc(self._sched.abort.remote(rid))
        except BackendError:
            log.warning("abort of %s did not reach the scheduler", rid)

    async def health(self) -> dict[str, Any]:
        stats = unpack(await self._rpc(self._sched.stats.remote()))
        workers = stats["workers"]
        live = {r: sum(1 for w in workers.values() if w["alive"] and w["role"] == r)
                for r in ("prefill", "decode")}
        return {"ok": live["prefill"] > 0 and live["decode"] > 0, "live_workers": live,
                "policy": stats["policy"]}

    async def why(self, req_id: str) -> dict[str, Any] | None:
        return unpack(await self._rpc(self._sched.why.remote(req_id)))

    async def metrics(self) -> tuple[bytes, str]:
        from router.metrics import CONTENT_TYPE

        return await self._rpc(self._sched.metrics.remote()), CONTENT_TYPE
