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
swap_in, preempt_recompute, release, abort) and migration's (detach_for_migration,
reattach, add_migrated_request) are documented in the package docstring. Swap-outs draw
on a bounded host swap space (engine.swap_space); the pool keeps cached blocks that
prefix waiting requests (``protect_prefixes``) ahead of plain LRU.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.block_pool import BlockEvent, BlockPool
from engine.books import BooksLock
from engine.config import AttentionChoice, EngineConfig, check_device, resolve_attention
from engine.errors import EngineSettingError, PromptTooLong
from engine.grammar import GrammarCompiler, Matcher
from engine.migration import MigrationSnapshot
from engine.model_loader import load_model
from engine.outputs import FinishReason, StepOutput
from engine.requests import EngineRequest, ReqState
from engine.runner import ModelRunner, SeqWork
from engine.sampler import SampleRow, TokenLogprobs, prompt_logprobs, sample
from engine.sampling import SamplingParams, random_seed
from engine.swap_space import SwapSpace
from scheduler.block_hashes import compute_block_hashes

log = logging.getLogger(__name__)
Scheduled = tuple[EngineRequest, SeqWork]


@dataclass(slots=True)
class _Draw:
    """One sequence's sampled token: ``seq`` of the scheduled request (a fork to be made
    when ``seq`` is past its sequences), with the matcher it will carry."""

    seq: int
    token_id: int
    logprobs: TokenLogprobs | None
    matcher: Matcher | None


@dataclass(slots=True)
class _Sampled:
    """What the fallible half of a step produced, by index into the scheduled list."""

    draws: dict[int, list[_Draw]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


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
        # The longest sequence served: the model's context, and no longer than the whole
        # pool holds (a request that grew past it could never be placed again; it ends
        # with "length" there, as at the model's context).
        self.model_max_len = config.max_model_len or int(mc.max_position_embeddings)
        self.max_model_len = min(self.model_max_len, num_blocks * config.block_size)
        if self.max_model_len < self.model_max_len:
            log.info("max_model_len %d: the KV pool holds %d blocks of %d tokens (the model's "
                     "context is %d)", self.max_model_len, num_blocks, config.block_size,
                     self.model_max_len)
        if (runner is None and device.type == "cuda" and config.cuda_graph_max_batch > 0
                and self.runner.uses_flex):
            self.runner.enable_decode_graphs(
                min(config.cuda_graph_max_batch, config.max_num_seqs), self.max_model_len)
        self._eos_token_ids = _eos_ids(model)
        self._requests: dict[str, EngineRequest] = {}
        # The pool and the request table change under this lock (engine.books): the engine
        # thread holds it for each call and a step lets it go while the model runs, so a
        # reservation from another thread (``reserve``) need not wait for the step.
        self.books = BooksLock()
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []
        self._pending: list[StepOutput] = []
        # Groups the engine's own scheduler swapped out (a forked group is never recomputed).
        self._self_swapped: deque[EngineRequest] = deque()
        self._grammars: GrammarCompiler | None = None  # built on the first grammar request
        self.swap = SwapSpace(num_blocks=config.num_swap_blocks, num_bytes=config.swap_bytes,
                              bytes_per_block=self.pool.kv_layout().bytes_per_block)
        # Cumulative counters (observability; tests and benchmarks read them).
        self.num_prefix_hit_tokens = 0
        self.num_preemptions = 0
        # Full prompt blocks looked up in the prefix cache on admission or reservation,
        # and how many were hits (the worker's prefix hit rate).
        self.num_prefix_query_blocks = 0
        self.num_prefix_hit_blocks = 0

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
        return bool(self._waiting or self._running or self._pending or self._self_swapped)

    def drain_events(self) -> list[BlockEvent]:
        return self.pool.drain_events()

    def block_ids(self, req_id: str) -> list[int]:
        """The request's blocks; for a group of sequences, each shared block once."""
        req = self._get(req_id)
        if not req.forks:
            return list(req.block_ids)
        return list(dict.fromkeys(b for seq in req.sequences for b in seq.block_ids))

    def num_live_sequences(self, req_id: str) -> int:
        req = self._requests.get(req_id)
        return 0 if req is None else len(req.live_sequences)

    def can_recompute(self, req_id: str) -> bool:
        """False for a request whose sequences forked: it is preempted by swapping (its
        sequences share blocks that a recompute could not share again), as vLLM v0 did."""
        req = self._requests.get(req_id)
        return req is not None and not req.forks

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
        outside = params.token_ids_out_of(vocab)
        if outside:
            raise ValueError(f"token ids {outside[:5]} are outside the vocabulary [0, {vocab})")
        self._check_length(len(tokens))
        return EngineRequest(
            req_id=req_id,
            token_ids=tokens,
            num_prompt_tokens=len(tokens),
            params=params,
            generator=None,
            prefill_only=prefill_only,
            seed=params.seed if params.seed is not None else random_seed(),
            matcher=None if params.grammar is None else self.grammar_matcher(params),
        )

    def grammar_matcher(self, params: SamplingParams) -> Matcher:
        """A fresh matcher of ``params.grammar`` (ValueError: the grammar is invalid, or
        this engine has no tokenizer to build one)."""
        if params.grammar is None:
            raise ValueError("no grammar")
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("structured output needs the model's tokenizer")
            self._grammars = GrammarCompiler(self.tokenizer, int(self.model.config.vocab_size),
                                             self._eos_token_ids)
        return self._grammars.matcher(params.grammar)

    def _check_length(self, num_tokens: int) -> None:
        if num_tokens >= self.model_max_len:
            raise PromptTooLong(num_tokens, self.model_max_len - 1, "the model's context")
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
            seqs = [] if req is None else req.live_sequences
            if (req is None or req.state is not ReqState.RUNNING or not seqs
                    or any(len(q.token_ids) - q.num_computed != 1 for q in seqs)
                    or not all(self._grow_no_preempt(q, q.num_computed + 1) for q in seqs)):
                refused.append(rid)
                continue
            decodes.extend((q, self._work(q, 1)) for q in seqs)
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
        """Blocks for ``num_tokens`` of ``req`` (one sequence), the block it writes next
        copied first if other sequences share it; False when the pool has no room."""
        if not self._copy_on_write(req):
            return False
        bs = self.pool.block_size
        needed = (num_tokens + bs - 1) // bs - len(req.block_ids)
        if needed <= 0:
            return True
        new = self.pool.allocate(needed)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def _copy_on_write(self, seq: EngineRequest) -> bool:
        """Give ``seq`` its own copy of the block its next token lands in when that block is
        shared (the prompt's last partial block after a fork); False: no block for it."""
        if seq.params.n == 1:
            return True  # one sequence: nothing it writes is shared
        bs = self.pool.block_size
        index = seq.num_computed // bs
        if index >= len(seq.block_ids):
            return True
        shared = seq.block_ids[index]
        if self.pool.ref_count(shared) <= 1:
            return True
        new = self.pool.allocate(1)
        if new is None:
            return False
        self.pool.copy_blocks([shared], new)
        self.pool.free([shared])
        seq.block_ids[index] = new[0]
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
            with self.books.released():
                sampled = self._forward_and_sample(decodes, chunks)
        except Exception as exc:  # one request's fault must not stop the rest
            if len({id(self._group(req)) for req, _ in decodes + chunks}) == 1:
                return outputs + [self._fail(decodes[0][0] if decodes else chunks[0][0], exc)]
            return outputs + self._run_one_by_one(decodes, chunks)
        return outputs + self._commit(decodes + chunks, sampled)

    def _group(self, seq: EngineRequest) -> EngineRequest:
        """The request a sequence belongs to (itself unless it is a fork)."""
        return self._requests.get(seq.req_id, seq) if seq.seq_index else seq

    def _forward_and_sample(self, decodes: list[Scheduled], chunks: list[Scheduled]
                            ) -> _Sampled:
        """The fallible half of a step: nothing in the engine's books changes here (a
        forward only writes the KV of positions not yet counted as computed)."""
        logits = self.runner.execute([w for _, w in decodes], [w for _, w in chunks])
        out = _Sampled()
        rows: list[SampleRow] = []
        where: list[tuple[int, int, Matcher | None]] = []
        logit_rows: list[int] = []
        offset = 0
        for k, (req, work) in enumerate(decodes + chunks):
            num_rows = len(work.token_ids) if work.all_logits else int(work.sample)
            if work.all_logits:
                start = work.start_pos
                valid = min(len(work.token_ids), req.num_prompt_tokens - 1 - start)
                if valid > 0:
                    out.prompt_logprobs[k] = prompt_logprobs(
                        logits[offset : offset + valid],
                        req.token_ids[start + 1 : start + 1 + valid],
                        req.params.prompt_logprobs or 0)
            if work.sample:
                p = req.params
                step = len(req.token_ids) - req.num_prompt_tokens
                prompt: Sequence[int] = ()
                output: Sequence[int] = ()
                if p.has_penalties:
                    prompt = req.token_ids[: req.num_prompt_tokens]
                    output = req.token_ids[req.num_prompt_tokens :]
                drawers = ([(req.seq_index, req.matcher)] if p.n == 1 or req.forks or step
                           else self._drawers(req))
                for seq, matcher in drawers:
                    rows.append(SampleRow(p, req.seed, seq, step, prompt, output, matcher))
                    where.append((k, seq, matcher))
                    logit_rows.append(offset + num_rows - 1)
            offset += num_rows
        if not rows:
            return out
        if logit_rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, torch.tensor(logit_rows, device=logits.device))
        kernels = self.runner.kernels
        tokens, lps = sample(logits, rows, stop_ids=self._eos_token_ids,
                             argmax=None if kernels is None else kernels.argmax)
        for (k, seq, matcher), token, lp in zip(where, tokens, lps, strict=True):
            out.draws.setdefault(k, []).append(_Draw(seq, token, lp, matcher))
        return out

    @staticmethod
    def _drawers(req: EngineRequest) -> list[tuple[int, Matcher | None]]:
        """(sequence index, matcher) of each sequence that draws from ``req``'s logits row:
        all ``n`` when its prompt's first tokens are sampled (the sequences fork then),
        else ``req`` alone."""
        if req.params.n > 1 and not req.forks and req.num_output_tokens == 0:
            m = req.matcher
            return [(0, m)] + [(i, None if m is None else m.copy())
                               for i in range(1, req.params.n)]
        return [(req.seq_index, req.matcher)]

    def _run_one_by_one(self, decodes: list[Scheduled], chunks: list[Scheduled]
                        ) -> list[StepOutput]:
        """Rerun a failed step a request at a time (the sequences of one request together)."""
        outputs: list[StepOutput] = []
        groups: dict[int, tuple[list[Scheduled], list[Scheduled]]] = {}
        for item in decodes:
            groups.setdefault(id(self._group(item[0])), ([], []))[0].append(item)
        for item in chunks:
            groups.setdefault(id(self._group(item[0])), ([], []))[1].append(item)
        for ds, cs in groups.values():
            try:
                with self.books.released():
                    sampled = self._forward_and_sample(ds, cs)
            except Exception as exc:  # this request is the one that fails
                outputs.append(self._fail((ds or cs)[0][0], exc))
                continue
            outputs += self._commit(ds + cs, sampled)
        return outputs

    def _fail(self, seq: EngineRequest, exc: BaseException) -> StepOutput:
        """End ``seq``'s request because its step failed: out of the engine, blocks freed."""
        req = self._group(seq)
        if req in self._running:
            self._running.remove(req)
        self._forget(req)
        detail = str(exc).splitlines()[0][:200] if str(exc) else ""
        return StepOutput(req_id=req.req_id, finished=True, request_finished=True,
                          error=f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__)

    def _commit(self, scheduled: list[Scheduled], sampled: _Sampled) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        for k, (seq, work) in enumerate(scheduled):
            seq.num_computed += len(work.token_ids)
            if k in sampled.prompt_logprobs:
                self._group(seq).prompt_logprobs.extend(sampled.prompt_logprobs[k])
            draws = sampled.draws.get(k, [])
            if seq.params.n == 1:
                outputs.append(self._commit_one(seq, draws[0] if draws else None))
                continue
            req = self._group(seq)
            if len(draws) > 1:
                for d in draws[1:]:  # the prompt's first tokens: the sequences fork here
                    child = seq.fork(d.seq, d.matcher)
                    self.pool.acquire(child.block_ids)
                    req.forks.append(child)
            outs = []
            for d in draws or [None]:
                target = seq if d is None or d.seq == seq.seq_index else req.forks[d.seq - 1]
                out = StepOutput(req_id=seq.req_id, seq=target.seq_index)
                if d is not None:
                    self._append_token(target, d.token_id, d.logprobs, out)
                self._publish_blocks(target)
                out.num_computed_tokens = target.num_computed
                outs.append(out)
            head = outs[0]
            if head.seq == 0:
                head.ready_block_ids = self._ready_blocks(req, head.prefill_done)
                if head.prefill_done:
                    head.num_cached_tokens = req.num_cached_tokens
                    if req.params.prompt_logprobs is not None:
                        head.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
            for out in outs:
                target = req if out.seq == 0 else req.forks[out.seq - 1]
                if out.finished and not req.prefill_only:
                    target.finished = True
                    if target.block_ids:
                        self.pool.free(target.block_ids)
                        target.block_ids = []
            if req.prefill_only and head.prefill_done:
                self._running.remove(req)
                req.state = ReqState.PREFILLED  # blocks kept until release()
                for out in outs:
                    out.request_finished = all(o.finished for o in outs)
            elif all(s.finished for s in req.sequences):
                self._running.remove(req)
                self._forget(req)
                outs[-1].request_finished = True
            outputs += outs
        return outputs

    def _commit_one(self, req: EngineRequest, draw: _Draw | None) -> StepOutput:
        """The commit of a request of one sequence (the common case, kept short)."""
        out = StepOutput(req_id=req.req_id)
        if draw is not None:
            self._append_token(req, draw.token_id, draw.logprobs, out)
        self._publish_blocks(req)
        out.num_computed_tokens = req.num_computed
        out.ready_block_ids = self._ready_blocks(req, out.prefill_done)
        if out.prefill_done:
            out.num_cached_tokens = req.num_cached_tokens
            if req.params.prompt_logprobs is not None:
                out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
        if out.finished or (req.prefill_only and out.prefill_done):
            self._running.remove(req)
            out.request_finished = out.finished
            if req.prefill_only:
                req.state = ReqState.PREFILLED  # blocks kept until release()
            else:
                self._forget(req)
        return out

    def _append_token(
        self, req: EngineRequest, token: int, logprobs: TokenLogprobs | None, out: StepOutput
    ) -> None:
        if len(req.token_ids) == req.num_prompt_tokens:
            out.prefill_done = True
        req.token_ids.append(token)
        out.new_token_ids.append(token)
        if logprobs is not None:
            out.logprobs.append(logprobs)
        reason, stop_reason = self._finish_reason(req, token)
        if reason is not None:
            out.finished = True
            out.finish_reason = reason
            out.stop_reason = stop_reason

    def _finish_reason(
        self, req: EngineRequest, token: int
    ) -> tuple[FinishReason | None, int | str | None]:
        """Why ``req`` (one sequence) ends with ``token`` appended (None: it goes on). Its
        grammar, if any, consumes the token here."""
        params = req.params
        grammar_done = False
        if req.matcher is not None:
            grammar_done = not req.matcher.accept(token) or req.matcher.is_finished
        num_output = len(req.token_ids) - req.num_prompt_tokens
        if num_output > params.min_tokens:
            if not params.ignore_eos and token in self._eos_token_ids:
                return FinishReason.STOP, token
            if token in params.stop_token_ids:
                return FinishReason.STOP, token
            if params.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
                for s in params.stop:
                    if s in text:
                        return FinishReason.STOP, s
        if grammar_done:
            return FinishReason.STOP, None
        if num_output >= params.max_tokens:
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
        while self._self_swapped and self.swap_in(self._self_swapped[0].req_id):
            self._self_swapped.popleft()
        index = 0
        while index < len(self._running) and budget > 0:
            req = self._running[index]
            if req.forks:  # a group of sequences: one decode each
                seqs = req.live_sequences
                if len(seqs) > budget or not self._grow_blocks(
                        req, [(q, q.num_computed + 1) for q in seqs], index):
                    break
                decodes.extend((q, self._work(q, 1)) for q in seqs)
                budget -= len(seqs)
                index += 1
                continue
            remaining = len(req.token_ids) - req.num_computed
            n = min(remaining, cfg.prefill_chunk_size, budget)
            if not self._grow_blocks(req, [(req, req.num_computed + n)], index):
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
            all_logits=(req.params.prompt_logprobs is not None and req.num_output_tokens == 0
                        and start + 1 < req.num_prompt_tokens),
        )

    def _grow_blocks(self, req: EngineRequest, wants: list[tuple[EngineRequest, int]],
                     index: int) -> bool:
        """Give each sequence of ``wants`` blocks for its token count (copy-on-write
        included); preempt later running requests if needed.

        Returns False when ``req`` itself had to be preempted.
        """
        while not (self._grow_no_preempt(*wants[0]) if len(wants) == 1
                   else all(self._grow_no_preempt(q, n) for q, n in wants)):
            victim = self._running[-1]
            self._preempt(victim)
            if victim is req or len(self._running) <= index:
                return False
        return True

    def _admit(self, req: EngineRequest) -> bool:
        """Take prefix hits and allocate the rest of ``req``'s blocks, all or nothing."""
        bs = self.pool.block_size
        num_tokens = len(req.token_ids)
        hashes = req.full_block_hashes(bs, num_tokens)
        hits = self.pool.lookup_prefix(hashes)
        if req.params.prompt_logprobs is not None and req.num_output_tokens == 0:
            hits = []  # every prompt position's logits are wanted: compute them all
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
        if req.num_output_tokens == 0:
            req.num_cached_tokens = req.num_computed
        self.num_prefix_query_blocks += len(hashes)
        self.num_prefix_hit_blocks += len(hits)
        return True

    def _preempt(self, req: EngineRequest) -> None:
        """Recompute-preempt a running request: free its blocks, requeue it at the front.
        A request whose sequences forked is swapped out instead (back when room frees)."""
        if req.forks:
            if self.swap_out(req.req_id):
                self._self_swapped.append(req)
                self.num_preemptions += 1
                return
            # The swap space is full and a forked group cannot be recomputed: it ends.
            self._pending.append(self._fail(req, RuntimeError(
                "the swap space is full and a request with forked sequences cannot be "
                "recomputed")))
            return
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
        for seq in req.sequences:
            if seq.block_ids:
                self.pool.free(seq.block_ids)
            seq.block_ids = []
        self._drop_host_kv(req)
        self._requests.pop(req.req_id, None)

    def _drop_host_kv(self, req: EngineRequest) -> None:
        """Give a swapped request's host copy back to the swap space."""
        if req.host_kv is not None:
            self.swap.give(req.host_kv.shape[0])
            req.host_kv = None
        req.host_tables = None

    def abort(self, req_id: str) -> None:
        """Drop a request in any state and free what it holds (unknown ids are ignored)."""
        req = self._requests.get(req_id)
        if req is None:
            return
        if req.state is ReqState.RUNNING:
            self._running.remove(req)
        elif req.state is ReqState.WAITING:
            self._waiting.remove(req)
        if req in self._self_swapped:
            self._self_swapped.remove(req)
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
        Safe from any thread (under ``books``): it waits at most for the books to be free,
        never for a running model forward.
        """
        with self.books:
            return self._reserve(req_id, num_tokens, prompt_token_ids)

    def _reserve(self, req_id: str, num_tokens: int, prompt_token_ids: Sequence[int] | None
                 ) -> list[int] | None:
        if req_id in self._requests:
            raise ValueError(f"request id {req_id!r} is already in the engine")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        self._check_length(num_tokens)
        bs = self.pool.block_size
        hits: list[int] = []
        hashes: list[int] = []
        if prompt_token_ids is not None:
            tokens = [int(t) for t in prompt_token_ids][:num_tokens]
            hashes = compute_block_hashes(tokens, bs)
            hits = self.pool.lookup_prefix(hashes)
        needed = (num_tokens + bs - 1) // bs - len(hits)
        hits_in_free_queue = sum(1 for b in hits if self.pool.ref_count(b) == 0)
        if needed > self.pool.num_free_blocks - hits_in_free_queue:
            return None
        self.num_prefix_query_blocks += len(hashes)
        self.num_prefix_hit_blocks += len(hits)
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
        first_token_id: int | Sequence[int],
        params: SamplingParams,
        block_ids: Sequence[int],
    ) -> None:
        """Continue decoding a request whose prompt KV was written into its reserved blocks.

        ``first_token_id``: the first token, or the first token of each of its ``n``
        sequences (they fork here, sharing the blocks). A sequence its first token ends
        gives a finished output at the next step; so does the request when all do."""
        firsts = ([int(first_token_id)] if isinstance(first_token_id, int)
                  else [int(t) for t in first_token_id])
        if not 1 <= len(firsts) <= params.n:
            raise ValueError(f"{len(firsts)} first tokens for a request of n={params.n}")
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
        for i in range(1, len(firsts)):
            child = req.fork(i, None if req.matcher is None else req.matcher.copy())
            self.pool.acquire(child.block_ids)
            req.forks.append(child)
        ended: list[StepOutput] = []
        for seq, token in zip(req.sequences, firsts, strict=True):
            seq.token_ids.append(token)
            reason, stop_reason = self._finish_reason(seq, token)
            if reason is None:
                continue
            ended.append(StepOutput(req_id=req_id, seq=seq.seq_index, finished=True,
                                    finish_reason=reason, stop_reason=stop_reason,
                                    num_computed_tokens=req.num_computed))
            seq.finished = True
            if seq.forks or seq.seq_index or len(firsts) > 1:
                self.pool.free(seq.block_ids)
                seq.block_ids = []
        self._pending += ended
        if all(seq.finished for seq in req.sequences):
            ended[-1].request_finished = True
            self._forget(req)
            return
        self._running.append(req)

    # ---- swap and recompute ----

    def can_swap_out(self, req_id: str) -> bool:
        """Whether ``req_id`` is running and its KV fits the swap space now."""
        req = self._requests.get(req_id)
        if req is None or req.state is not ReqState.RUNNING:
            return False
        return self.swap.can_hold(len(self._swap_tables(req)[1]))

    def _swap_tables(self, req: EngineRequest) -> tuple[list[list[int]], list[int]]:
        """Each live sequence's used blocks, and the distinct ones (shared blocks once)."""
        bs = self.pool.block_size
        used = [q.block_ids[: (q.num_computed + bs - 1) // bs] for q in req.live_sequences]
        return used, list(dict.fromkeys(b for table in used for b in table))

    def swap_out(self, req_id: str) -> bool:
        """Move a running request's KV to host memory and free its blocks (False: not
        running, or its blocks do not fit the swap space: nothing is copied then)."""
        if not self.can_swap_out(req_id):
            return False
        req = self._requests[req_id]
        used, distinct = self._swap_tables(req)
        self.swap.take(len(distinct))
        data = self.pool.read_blocks(distinct)
        pin = data.device.type == "cuda"
        host = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=pin)
        host.copy_(data)
        self._running.remove(req)
        for seq in req.sequences:
            if seq.block_ids:
                self.pool.free(seq.block_ids)
            seq.block_ids = []
        req.host_kv = host
        if req.forks:  # shared blocks travel once; each sequence keeps its table
            row = {b: i for i, b in enumerate(distinct)}
            req.host_tables = [[row[b] for b in table] for table in used]
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
        tables = req.host_tables or [list(range(len(new)))]
        for seq, table in zip(req.live_sequences, tables, strict=True):
            seq.block_ids = [new[i] for i in table]
        # allocate gave each block one reference; a block in k tables needs k
        for i, count in Counter(i for table in tables for i in table).items():
            if count > 1:
                self.pool.acquire([new[i]] * (count - 1))
        self._drop_host_kv(req)
        for seq in req.live_sequences:
            seq.num_published_blocks = 0
            seq.num_ready_reported = 0  # the content moved: report it under the new ids
            self._publish_blocks(seq)
        req.state = ReqState.RUNNING
        self._running.append(req)
        return True

    def preempt_recompute(self, req_id: str) -> bool:
        """Drop a running, swapped or migrating request's KV; it is recomputed (prompt +
        output) later."""
        req = self._requests.get(req_id)
        if req is None or req.forks:  # a forked group is swapped, never recomputed
            return False
        if req.state is ReqState.RUNNING:
            self._preempt(req)
            return True
        if req.state is ReqState.SWAPPED:
            self._drop_host_kv(req)
            req.reset_for_recompute()
            self._waiting.appendleft(req)
            return True
        if req.state is ReqState.MIGRATING:
            self.pool.free(req.block_ids)
            req.reset_for_recompute()
            self._waiting.appendleft(req)
            self.num_preemptions += 1
            return True
        return False

    # ---- migration ----

    def detach_for_migration(self, req_id: str) -> MigrationSnapshot | None:
        """Take a decoding request out of the running set for a move to another engine;
        its blocks stay its own (and unchanged) until ``abort`` (moved), ``reattach``
        (the move was refused) or ``preempt_recompute`` (the move failed). None: not a
        running request between two decode steps."""
        req = self._requests.get(req_id)
        if (req is None or req.state is not ReqState.RUNNING or req.num_output_tokens < 1
                or req.forks or len(req.token_ids) - req.num_computed != 1):
            return None  # (a forked group moves by swap only: its sequences share blocks)
        self._running.remove(req)
        req.state = ReqState.MIGRATING
        bs = self.pool.block_size
        used = (req.num_computed + bs - 1) // bs
        return MigrationSnapshot(req_id, tuple(req.token_ids), req.num_prompt_tokens,
                                 req.num_computed, tuple(req.block_ids[:used]))

    def reattach(self, req_id: str) -> bool:
        """A detached request decodes here again (its move did not start)."""
        req = self._requests.get(req_id)
        if req is None or req.state is not ReqState.MIGRATING:
            return False
        req.state = ReqState.RUNNING
        self._running.append(req)
        return True

    def add_migrated_request(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                             params: SamplingParams, block_ids: Sequence[int]) -> None:
        """Continue decoding a request another engine detached: ``token_ids`` are its prompt
        and outputs so far; the KV of all but the last token was written into the blocks
        reserved for it (``reserve(req_id, len(token_ids) - 1, ...)``)."""
        reservation = self._requests.get(req_id)
        if reservation is None or reservation.state is not ReqState.RESERVED:
            raise ValueError(f"request {req_id!r} has no reservation (call reserve first)")
        if list(block_ids) != reservation.block_ids:
            raise ValueError(f"block_ids of {req_id!r} differ from its reservation")
        tokens = [int(t) for t in token_ids]
        if not 0 < num_prompt_tokens < len(tokens):
            raise ValueError(f"{num_prompt_tokens} prompt tokens of {len(tokens)}: a migrated "
                             "request has a prompt and at least one output token")
        bs = self.pool.block_size
        num_computed = len(tokens) - 1
        if len(block_ids) * bs < num_computed:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_computed} tokens")
        del self._requests[req_id]
        try:
            req = self._new_request(req_id, tokens[:num_prompt_tokens], params,
                                    prefill_only=False)
        except ValueError:
            self._requests[req_id] = reservation
            raise
        req.token_ids = tokens
        if req.matcher is not None:  # the grammar walks the outputs the source sampled
            for t in tokens[num_prompt_tokens:]:
                req.matcher.accept(t)
        req.block_ids = list(block_ids)
        req.num_computed = num_computed
        req.num_ready_reported = (num_computed + bs - 1) // bs
        req.state = ReqState.RUNNING
        self._requests[req_id] = req
        self._publish_blocks(req)
        self._running.append(req)

    # ---- prefix cache ----

    def protect_prefixes(self, block_hashes: Collection[int]) -> None:
        """Cached blocks with these hashes (prefixes of requests waiting here) are evicted
        only after every other reusable block (BlockPool.protect)."""
        self.pool.protect(block_hashes)

    # ---- convenience ----

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Run prompts to completion; the output token ids per prompt, in order."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        return [seqs[0] for seqs in self.generate_n(prompts, per_prompt)]

    def generate_n(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
                   ) -> list[list[list[int]]]:
        """Run prompts to completion; per prompt, the output token ids of each of its
        ``n`` sequences."""
        results: dict[str, list[list[int]]] = {}
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        for req_id, prompt, p in zip(ids, prompts, params, strict=True):
            self.add_request(req_id, prompt, p)
            results[req_id] = [[] for _ in range(p.n)]
        remaining = set(ids)
        while remaining:
            for out in self.step():
                if out.req_id in results:
                    results[out.req_id][out.seq].extend(out.new_token_ids)
                    if out.request_finished:
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
