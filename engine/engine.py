"""LLMEngine: continuous batching over the paged KV pool of one device.

One ``step()`` = schedule, run, postprocess:

1. schedule: running requests first, in admission order: one token for a decode, a chunk of
   at most ``prefill_chunk_size`` for a prefill, within ``max_num_batched_tokens``. A decode
   that needs a new block and finds none preempts the most recently admitted running request
   (recompute). Then waiting requests are admitted, first come first served, while the token
   budget and ``max_num_seqs`` allow: prefix-cache hits are taken and every remaining block of
   the prompt is allocated at once (all or nothing), so an admitted prefill never stalls.
2. run: one packed forward of all scheduled tokens (engine.runner, engine.attention).
3. postprocess: publish newly full blocks to the prefix cache, sample where a request's
   known tokens are all computed, check stop conditions, free finished requests' blocks.

Disaggregation and preemption entry points (reserve, add_prefilled_request, swap_out,
swap_in, preempt_recompute, release, abort) are documented in the package docstring.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from engine.block_pool import BlockEvent, BlockPool, compute_block_hashes
from engine.config import AttentionChoice, EngineConfig, check_device, resolve_attention
from engine.errors import EngineSettingError, PromptTooLong
from engine.model_loader import load_model
from engine.outputs import FinishReason, StepOutput
from engine.requests import EngineRequest, ReqState
from engine.runner import ModelRunner, SeqWork
from engine.sampling import SamplingParams, make_generator, sample

Scheduled = tuple[EngineRequest, SeqWork]


class LLMEngine:
    """Batched, chunked, prefix-sharing generation for one model on one device."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        model: torch.nn.Module | None = None,
        tokenizer: object | None = None,
        runner: Any | None = None,
    ) -> None:
        self.config = config
        check_device(config.torch_device)
        if model is None:
            model, loaded_tokenizer = load_model(config.model, config.dtype, config.device)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        self.model = model
        self.tokenizer = tokenizer
        mc = model.config
        self.dtype: torch.dtype = next(model.parameters()).dtype
        device = torch.device(config.device)
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        shape = dict(
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=head_dim,
            block_size=config.block_size,
            dtype=self.dtype,
            device=device,
        )
        num_blocks = BlockPool.blocks_for_budget(
            **shape,
            num_blocks=config.num_kv_blocks,
            budget_bytes=config.kv_cache_bytes,
            fraction=config.kv_cache_fraction,
        )
        self.attention = resolve_attention(config.attention, device)
        if (self.attention is AttentionChoice.FLEX and device.type == "cuda"
                and config.block_size % 16):
            raise EngineSettingError(
                "block_size", f"flex attention on CUDA needs a multiple of 16 tokens, got "
                f"{config.block_size}")
        self.pool = BlockPool(
            **shape, num_blocks=num_blocks, enable_caching=config.enable_prefix_caching,
            layer_major=self.attention is AttentionChoice.FLEX,
        )
        # ``runner``: what executes a step (default: the model's forward over the pool; the
        # stub engine of bench-control passes one that runs no model).
        self.runner = runner if runner is not None else ModelRunner(
            model, self.pool, use_kernel=config.native_kernels)
        self.max_model_len = config.max_model_len or int(mc.max_position_embeddings)
        if (runner is None and device.type == "cuda" and config.cuda_graph_max_batch > 0
                and self.runner.uses_flex):
            self.runner.enable_decode_graphs(
                min(config.cuda_graph_max_batch, config.max_num_seqs), self.max_model_len)
        self._eos_token_ids = _eos_ids(model)
        self._requests: dict[str, EngineRequest] = {}
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._pending: list[StepOutput] = []
        # Cumulative counters (observability; tests and benchmarks read them).
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0

    # ---- accounting ----

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        """Work left for step(): waiting or running requests, or outputs not yet returned."""
        return bool(self._waiting or self._running or self._pending)

    def drain_events(self) -> list[BlockEvent]:
        return self.pool.drain_events()

    def block_ids(self, req_id: str) -> list[int]:
        return list(self._get(req_id).block_ids)

    def num_reserved_cached_blocks(self, req_id: str) -> int:
        return self._get(req_id).num_reserved_cached

    def request_state(self, req_id: str) -> ReqState | None:
        req = self._requests.get(req_id)
        return None if req is None else req.state

    # ---- adding requests ----

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
    ) -> None:
        """Queue a request; PromptTooLong / ValueError before anything is allocated."""
        req = self._new_request(req_id, prompt_token_ids, params, prefill_only)
        self._requests[req_id] = req
        self._waiting.append(req)

    def _new_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill_only: bool,
    ) -> EngineRequest:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in the engine")
        tokens = [int(t) for t in prompt_token_ids]
        if not tokens:
            raise ValueError("prompt_token_ids is empty")
        vocab = int(self.model.config.vocab_size)
        if min(tokens) < 0 or max(tokens) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        self._check_length(len(tokens))
        return EngineRequest(
            req_id=req_id,
            token_ids=tokens,
            num_prompt_tokens=len(tokens),
            params=params,
            generator=make_generator(params, self.pool.kv_layout().device),
            prefill_only=prefill_only,
        )

    def _check_length(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise PromptTooLong(num_tokens, self.max_model_len - 1, "the model's context")
        pool_tokens = self.pool.num_blocks * self.pool.block_size
        if num_tokens + 1 > pool_tokens:
            raise PromptTooLong(num_tokens, pool_tokens - 1, "the whole KV pool")

    # ---- step ----

    def step(self) -> list[StepOutput]:
        """One step composed by the engine itself (running first, then FCFS admission)."""
        decodes, chunks = self._schedule()
        return self._run(decodes, chunks)

    def run_plan(self, decode_ids: Sequence[str], chunks: Sequence[tuple[str, int]]
                 ) -> tuple[list[StepOutput], list[str]]:
        """One step composed by the caller's scheduler (``scheduler.step_planner``): one
        token for each of ``decode_ids``, ``n`` prompt tokens for each ``(req_id, n)`` of
        ``chunks`` (a waiting request is admitted first: prefix hits, then all of its
        blocks). Nothing else runs and nothing is preempted here: a decode that finds no
        block for its next token, or a chunk whose request cannot be admitted, is left out
        and returned as refused (the caller's scheduler decides what gives way).
        Unknown ids and requests in no runnable state are refused too."""
        decodes: list[Scheduled] = []
        work_chunks: list[Scheduled] = []
        refused: list[str] = []
        for rid in decode_ids:
            req = self._requests.get(rid)
            if (req is None or req.state is not ReqState.RUNNING
                    or len(req.token_ids) - req.num_computed != 1
                    or not self._grow_no_preempt(req, req.num_computed + 1)):
                refused.append(rid)
                continue
            decodes.append((req, self._work(req, 1)))
        for rid, n in chunks:
            req = self._requests.get(rid)
            if req is None or n <= 0:
                refused.append(rid)
                continue
            if req.state is ReqState.WAITING and not self.admit(rid):
                refused.append(rid)
                continue
            if req.state is not ReqState.RUNNING:
                refused.append(rid)
                continue
            n = min(n, len(req.token_ids) - req.num_computed)
            if n <= 0 or not self._grow_no_preempt(req, req.num_computed + n):
                refused.append(rid)
                continue
            work_chunks.append((req, self._work(req, n)))
        return self._run(decodes, work_chunks), refused

    def admit(self, req_id: str) -> bool:
        """Give a waiting request its prefix hits and all of its blocks now (False: no
        room; nothing changes). It then runs in the chunks the caller plans for it."""
        req = self._requests.get(req_id)
        if req is None or req.state is not ReqState.WAITING:
            return False
        if not self._admit(req):
            return False
        if req in self._waiting:
            self._waiting.remove(req)
        req.state = ReqState.RUNNING
        self._running.append(req)
        return True

    def _grow_no_preempt(self, req: EngineRequest, num_tokens: int) -> bool:
        bs = self.pool.block_size
        needed = (num_tokens + bs - 1) // bs - len(req.block_ids)
        if needed <= 0:
            return True
        new = self.pool.allocate(needed)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def num_computed_tokens(self, req_id: str) -> int:
        return self._get(req_id).num_computed

    def _run(self, decodes: list[Scheduled], chunks: list[Scheduled]) -> list[StepOutput]:
        """Forward and sample the batch, then commit. A batch that raises is run again one
        request at a time, so a request that breaks a step fails alone (its output says why)
        and the others still get their tokens from this step."""
        outputs, self._pending = self._pending, []
        if not decodes and not chunks:
            return outputs
        try:
            token_ids, logprobs = self._forward_and_sample(decodes, chunks)
        except Exception as exc:  # one request's fault must not stop the rest
            if len(decodes) + len(chunks) == 1:
                (req, _), = decodes + chunks
                return outputs + [self._fail(req, exc)]
            return outputs + self._run_one_by_one(decodes, chunks)
        return outputs + self._commit(decodes + chunks, token_ids, logprobs)

    def _forward_and_sample(self, decodes: list[Scheduled], chunks: list[Scheduled]
                            ) -> tuple[list[int], list[float]]:
        """The fallible half of a step: nothing in the engine's books changes here (a
        forward only writes the KV of positions not yet counted as computed)."""
        logits = self.runner.execute([w for _, w in decodes], [w for _, w in chunks])
        sampled = [req for req, w in decodes + chunks if w.sample]
        if not sampled:
            return [], []
        kernels = self.runner.kernels
        return sample(logits, [r.params for r in sampled], [r.generator for r in sampled],
                      argmax=None if kernels is None else kernels.argmax)

    def _run_one_by_one(self, decodes: list[Scheduled], chunks: list[Scheduled]
                        ) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for item, is_decode in [(d, True) for d in decodes] + [(c, False) for c in chunks]:
            one = [item]
            try:
                token_ids, logprobs = self._forward_and_sample(one if is_decode else [],
                                                               [] if is_decode else one)
            except Exception as exc:  # this request is the one that fails
                outputs.append(self._fail(item[0], exc))
                continue
            outputs += self._commit(one, token_ids, logprobs)
        return outputs

    def _fail(self, req: EngineRequest, exc: BaseException) -> StepOutput:
        """End ``req`` because its step failed: out of the engine, blocks freed."""
        if req in self._running:
            self._running.remove(req)
        self._forget(req)
        detail = str(exc).splitlines()[0][:200] if str(exc) else ""
        return StepOutput(req_id=req.req_id, finished=True,
                          error=f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)

    def _commit(self, scheduled: list[Scheduled], token_ids: list[int],
                logprobs: list[float]) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        sample_index = 0
        for req, work in scheduled:
            req.num_computed += len(work.token_ids)
            out = StepOutput(req_id=req.req_id)
            if work.sample:
                token = token_ids[sample_index]
                logprob = logprobs[sample_index] if logprobs else None
                sample_index += 1
                self._append_token(req, token, logprob, out)
            self._publish_blocks(req)
            out.num_computed_tokens = req.num_computed
            out.ready_block_ids = self._ready_blocks(req, out.prefill_done)
            if out.finished or (req.prefill_only and out.prefill_done):
                self._running.remove(req)
                if req.prefill_only:
                    req.state = ReqState.PREFILLED  # blocks kept until release()
                else:
                    self._forget(req)
            outputs.append(out)
        return outputs

    def _append_token(
        self, req: EngineRequest, token: int, logprob: float | None, out: StepOutput
    ) -> None:
        if req.num_output_tokens == 0:
            out.prefill_done = True
        req.token_ids.append(token)
        out.new_token_ids.append(token)
        if req.params.logprobs and logprob is not None:
            out.logprobs.append(logprob)
        reason, stop_reason = self._finish_reason(req, token)
        if reason is not None:
            out.finished = True
            out.finish_reason = reason
            out.stop_reason = stop_reason

    def _finish_reason(
        self, req: EngineRequest, token: int
    ) -> tuple[FinishReason | None, int | str | None]:
        params = req.params
        if not params.ignore_eos and token in self._eos_token_ids:
            return FinishReason.STOP, token
        if token in params.stop_token_ids:
            return FinishReason.STOP, token
        if params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            for s in params.stop:
                if s in text:
                    return FinishReason.STOP, s
        if req.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH, None
        if len(req.token_ids) >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _publish_blocks(self, req: EngineRequest) -> None:
        """Offer the request's newly full blocks to the prefix cache."""
        bs = self.pool.block_size
        hashes = req.full_block_hashes(bs, req.num_computed)
        first = req.num_published_blocks
        if len(hashes) > first:
            parent = hashes[first - 1] if first > 0 else None
            self.pool.cache_blocks(req.block_ids[first : len(hashes)], hashes[first:], parent)
            req.num_published_blocks = len(hashes)

    def _ready_blocks(self, req: EngineRequest, prefill_done: bool) -> list[int]:
        bs = self.pool.block_size
        upto = req.num_computed // bs
        if prefill_done and req.num_computed % bs:
            upto += 1  # the prompt's last partial block is final for the transfer
        ready = req.block_ids[req.num_ready_reported : upto]
        req.num_ready_reported = max(req.num_ready_reported, upto)
        return list(ready)

    # ---- scheduling ----

    def _schedule(self) -> tuple[list[Scheduled], list[Scheduled]]:
        """(decodes, prefill chunks) to run now; admits waiting requests as room allows."""
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        decodes: list[Scheduled] = []
        chunks: list[Scheduled] = []
        index = 0
        while index < len(self._running) and budget > 0:
            req = self._running[index]
            remaining = len(req.token_ids) - req.num_computed
            n = min(remaining, cfg.prefill_chunk_size, budget)
            if not self._grow_blocks(req, req.num_computed + n, index):
                break  # req itself was preempted; everyone after it too
            work = self._work(req, n)
            (decodes if n == 1 else chunks).append((req, work))
            budget -= n
            index += 1
        while self._waiting and budget > 0 and len(self._running) < cfg.max_num_seqs:
            req = self._waiting[0]
            if not self._admit(req):
                break
            self._waiting.popleft()
            req.state = ReqState.RUNNING
            self._running.append(req)
            n = min(len(req.token_ids) - req.num_computed, cfg.prefill_chunk_size, budget)
            work = self._work(req, n)
            (decodes if n == 1 else chunks).append((req, work))
            budget -= n
        return decodes, chunks

    def _work(self, req: EngineRequest, n: int) -> SeqWork:
        start = req.num_computed
        return SeqWork(
            token_ids=req.token_ids[start : start + n],
            start_pos=start,
            block_ids=req.block_ids,
            sample=start + n == len(req.token_ids),
        )

    def _grow_blocks(self, req: EngineRequest, num_tokens: int, index: int) -> bool:
        """Give ``req`` blocks for ``num_tokens``; preempt later running requests if needed.

        Returns False when ``req`` itself had to be preempted.
        """
        bs = self.pool.block_size
        needed = (num_tokens + bs - 1) // bs - len(req.block_ids)
        while needed > 0:
            new = self.pool.allocate(needed)
            if new is not None:
                req.block_ids.extend(new)
                return True
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req:
                return False
            if len(self._running) <= index:
                return False
        return True

    def _admit(self, req: EngineRequest) -> bool:
        """Take prefix hits and allocate the rest of ``req``'s blocks, all or nothing."""
        bs = self.pool.block_size
        num_tokens = len(req.token_ids)
        hashes = req.full_block_hashes(bs, num_tokens)
        hits = self.pool.lookup_prefix(hashes)
        if len(hits) * bs >= num_tokens:
            hits = hits[:-1]  # compute at least the last token (its logits are sampled)
        needed = (num_tokens + bs - 1) // bs - len(hits)
        hits_in_free_queue = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        if needed > self.pool.num_free_blocks - hits_in_free_queue:
            return False
        self.pool.acquire(hits)
        new = self.pool.allocate(needed)
        assert new is not None
        req.block_ids = hits + new
        req.num_computed = len(hits) * bs
        req.num_published_blocks = len(hits)
        self.num_prefix_hit_tokens += req.num_computed
        return True

    def _preempt(self, req: EngineRequest) -> None:
        """Recompute-preempt a running request: free its blocks, requeue it at the front."""
        self._running.remove(req)
        self.pool.free(req.block_ids)
        req.reset_for_recompute()
        self._waiting.appendleft(req)
        self.num_preemptions += 1

    # ---- removal ----

    def _get(self, req_id: str) -> EngineRequest:
        req = self._requests.get(req_id)
        if req is None:
            raise KeyError(f"unknown request id {req_id!r}")
        return req

    def _forget(self, req: EngineRequest) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
        req.block_ids = []
        req.host_kv = None
        self._requests.pop(req.req_id, None)

    def abort(self, req_id: str) -> None:
        """Drop a request in any state and free what it holds (unknown ids are ignored)."""
        req = self._requests.get(req_id)
        if req is None:
            return
        if req.state is ReqState.RUNNING:
            self._running.remove(req)
        elif req.state is ReqState.WAITING:
            self._waiting.remove(req)
        self._pending = [o for o in self._pending if o.req_id != req_id]
        self._forget(req)

    def release(self, req_id: str) -> None:
        """Free a prefilled (prefill_only) or reserved request's blocks and forget it."""
        self.abort(req_id)

    # ---- disaggregation: decode side ----

    def reserve(
        self, req_id: str, num_tokens: int, *, prompt_token_ids: Sequence[int] | None = None
    ) -> list[int] | None:
        """Blocks for ``num_tokens`` of incoming KV, all or nothing (None: no room).

        With ``prompt_token_ids``, the prompt's cached prefix blocks are reused; they come first
        and ``num_reserved_cached_blocks(req_id)`` says how many (they need no transfer).
        """
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in the engine")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self._check_length(num_tokens)
        bs = self.pool.block_size
        hits: list[int] = []
        if prompt_token_ids is not None:
            tokens = [int(t) for t in prompt_token_ids][:num_tokens]
            hits = self.pool.lookup_prefix(compute_block_hashes(tokens, bs))
        needed = (num_tokens + bs - 1) // bs - len(hits)
        hits_in_free_queue = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        if needed > self.pool.num_free_blocks - hits_in_free_queue:
            return None
        self.pool.acquire(hits)
        new = self.pool.allocate(needed)
        assert new is not None
        req = EngineRequest(
            req_id=req_id,
            token_ids=[],
            num_prompt_tokens=0,
            params=SamplingParams(),
            generator=None,
            state=ReqState.RESERVED,
            block_ids=hits + new,
            num_reserved_cached=len(hits),
        )
        self._requests[req_id] = req
        return list(req.block_ids)

    def add_prefilled_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int],
        first_token_id: int,
        params: SamplingParams,
        block_ids: Sequence[int],
    ) -> None:
        """Continue decoding a request whose prompt KV was written into its reserved blocks."""
        reservation = self._requests.get(req_id)
        if reservation is None or reservation.state is not ReqState.RESERVED:
            raise ValueError(f"request {req_id!r} has no reservation (call reserve first)")
        if list(block_ids) != reservation.block_ids:
            raise ValueError(f"block_ids of {req_id!r} differ from its reservation")
        del self._requests[req_id]
        try:
            req = self._new_request(req_id, prompt_token_ids, params, prefill_only=False)
        except ValueError:
            self._requests[req_id] = reservation
            raise
        bs = self.pool.block_size
        if len(block_ids) * bs < req.num_prompt_tokens:
            self._requests[req_id] = reservation
            raise ValueError(
                f"{len(block_ids)} blocks cannot hold a {req.num_prompt_tokens}-token prompt"
            )
        req.block_ids = list(block_ids)
        req.num_computed = req.num_prompt_tokens
        req.num_ready_reported = (req.num_computed + bs - 1) // bs
        req.state = ReqState.RUNNING
        self._requests[req_id] = req
        self._publish_blocks(req)
        out = StepOutput(req_id=req_id, num_computed_tokens=req.num_computed)
        req.token_ids.append(int(first_token_id))
        reason, stop_reason = self._finish_reason(req, int(first_token_id))
        if reason is not None:
            out.finished, out.finish_reason, out.stop_reason = True, reason, stop_reason
            self._pending.append(out)
            self._forget(req)
            return
        self._running.append(req)

    # ---- swap and recompute ----

    def swap_out(self, req_id: str) -> bool:
        """Move a running request's KV to host memory and free its blocks (False: not running)."""
        req = self._requests.get(req_id)
        if req is None or req.state is not ReqState.RUNNING:
            return False
        bs = self.pool.block_size
        num_used = (req.num_computed + bs - 1) // bs
        data = self.pool.read_blocks(req.block_ids[:num_used])
        pin = data.device.type == "cuda"
        host = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=pin)
        host.copy_(data)
        self._running.remove(req)
        self.pool.free(req.block_ids)
        req.block_ids = []
        req.host_kv = host
        req.state = ReqState.SWAPPED
        return True

    def swap_in(self, req_id: str) -> bool:
        """Bring a swapped request's KV back into fresh blocks (False: not swapped or no room)."""
        req = self._requests.get(req_id)
        if req is None or req.state is not ReqState.SWAPPED or req.host_kv is None:
            return False
        new = self.pool.allocate(req.host_kv.shape[0])
        if new is None:
            return False
        self.pool.write_blocks(new, req.host_kv)
        req.block_ids = new
        req.host_kv = None
        req.num_published_blocks = 0
        req.num_ready_reported = 0  # the content moved: report it under the new ids
        self._publish_blocks(req)
        req.state = ReqState.RUNNING
        self._running.append(req)
        return True

    def preempt_recompute(self, req_id: str) -> bool:
        """Drop a running or swapped request's KV; it is recomputed (prompt + output) later."""
        req = self._requests.get(req_id)
        if req is None:
            return False
        if req.state is ReqState.RUNNING:
            self._preempt(req)
            return True
        if req.state is ReqState.SWAPPED:
            req.reset_for_recompute()
            self._waiting.appendleft(req)
            return True
        return False

    # ---- convenience ----

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; the output token ids per prompt, in order."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        results: dict[str, list[int]] = {}
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        for req_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(req_id, prompt, p)
            results[req_id] = []
        remaining = set(ids)
        while remaining:
            for out in self.step():
                if out.req_id in results:
                    results[out.req_id].extend(out.new_token_ids)
                    if out.finished:
                        remaining.discard(out.req_id)
        return [results[i] for i in ids]


def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
