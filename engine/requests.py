"""The engine's own view of a request: tokens, KV progress, blocks, and its local state.

Life of a request inside one engine (the cluster's state machine lives in scheduler/):

1. WAITING: queued, holds no blocks (new, or preempted for recompute).
2. RUNNING: holds blocks; each step computes its next chunk, or one decode token.
3. PREFILLED: a prefill_only request whose prompt is done; holds its blocks until release.
4. SWAPPED: its KV sits in host memory; swap_in brings it back to RUNNING.
5. RESERVED: decode side of disaggregation (or of a migration): blocks reserved, KV
   arriving by transfer; add_prefilled_request (add_migrated_request) makes it RUNNING.
6. MIGRATING: detached from the running set while its KV travels to another engine; its
   blocks stay its own until it is aborted (moved), reattached or recomputed.
Finished, aborted and released requests are forgotten (their blocks are freed).

A request with ``n > 1`` is a group of sequences: the request object is sequence 0 and
holds the others in ``forks``, made when its prompt's prefill samples the first tokens.
Every fork starts as a copy of sequence 0 at that point that takes one more reference to
each of its blocks (the prompt's KV is shared, never copied); the shared last partial
block is copied on the first write (``LLMEngine._copy_on_write``). A sequence that
finishes frees its references; the request ends when its last sequence does.

All tokens (prompt, then outputs) sit in ``token_ids``; ``num_computed`` of them have KV in the
pool. A step computes tokens ``[num_computed, ...)``; when it reaches ``len(token_ids)`` the
last position is sampled. Recompute is therefore just ``num_computed = 0``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.grammar import Matcher
from engine.sampler import TokenLogprobs
from engine.sampling import SamplingParams
from scheduler.block_hashes import hash_block_tokens


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"
    SWAPPED = "swapped"
    RESERVED = "reserved"
    MIGRATING = "migrating"


@dataclass(slots=True)
class EngineRequest:
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    prefill_only: bool = False
    state: ReqState = ReqState.WAITING
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of token_ids computed so far (published or not).
    block_hashes: list[int] = field(default_factory=list)
    num_published_blocks: int = 0  # blocks of block_ids offered to the prefix cache
    num_ready_reported: int = 0  # blocks already reported in StepOutput.ready_block_ids
    num_reserved_cached: int = 0  # RESERVED: leading blocks that came from the prefix cache
    host_kv: torch.Tensor | None = None  # SWAPPED: the blocks' content in host memory
    # SWAPPED groups: each sequence's block table as indices into the rows of host_kv.
    host_tables: list[list[int]] | None = None
    seed: int = 0  # the counter-based random stream's seed (engine.sampling.uniform)
    seq_index: int = 0
    forks: list[EngineRequest] = field(default_factory=list)  # sequences 1.. of the request
    finished: bool = False  # this sequence ended (its blocks are freed); a group may go on
    matcher: Matcher | None = None  # structured output: where this sequence is in its grammar
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # until reported

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def sequences(self) -> list[EngineRequest]:
        """Every sequence of the request (itself first)."""
        return [self, *self.forks] if self.forks else [self]

    @property
    def live_sequences(self) -> list[EngineRequest]:
        return [s for s in self.sequences if not s.finished]

    def fork(self, seq_index: int, matcher: Matcher | None) -> EngineRequest:
        """A new sequence at this one's point: same tokens and blocks (the caller takes the
        blocks' extra references)."""
        return EngineRequest(
            req_id=self.req_id, token_ids=list(self.token_ids),
            num_prompt_tokens=self.num_prompt_tokens, params=self.params, generator=None,
            prefill_only=self.prefill_only, state=self.state, num_computed=self.num_computed,
            block_ids=list(self.block_ids), block_hashes=list(self.block_hashes),
            num_published_blocks=self.num_published_blocks,
            num_ready_reported=self.num_ready_reported, seed=self.seed, seq_index=seq_index,
            matcher=matcher, num_cached_tokens=self.num_cached_tokens)

    def full_block_hashes(self, block_size: int, upto_tokens: int) -> list[int]:
        """Extend and return the chained hashes of the full blocks within ``upto_tokens``."""
        hashes = self.block_hashes
        num_full = upto_tokens // block_size
        while len(hashes) < num_full:
            j = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block_tokens(parent, self.token_ids[j * block_size : (j + 1) * block_size])
            )
        return hashes[:num_full]

    def reset_for_recompute(self) -> None:
        self.state = ReqState.WAITING
        self.num_computed = 0
        self.block_ids = []
        self.num_published_blocks = 0
        self.num_ready_reported = 0  # new blocks: their content is reported again
        self.host_kv = None
