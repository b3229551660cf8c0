"""The engine as the worker pools drive it: :class:`EnginePort`, the one typed seam between
an applier (``decode_pool/``, ``prefill_pool/``) and :class:`~engine.engine.LLMEngine`.

A Protocol, so a unit test of a pool can stand a small fake in for the engine and the
type checker still holds the pool to the calls the real engine answers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Protocol

from engine.books import BooksLock


class EnginePort(Protocol):
    books: BooksLock  # the engine's bookkeeping lock (reserve from the event loop)
    swap: Any  # the host swap space (capacity, num_used, num_peak, num_free)
    pool: Any  # the block pool (ref counts, KV layout)
    num_prefix_query_blocks: int
    num_prefix_hit_blocks: int
    max_model_len: int

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...

    # -- requests ----------------------------------------------------------------------
    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], params: Any, *,
                    prefill_only: bool = False) -> None: ...

    def admit(self, req_id: str) -> bool: ...

    def reserve(self, req_id: str, num_tokens: int, *,
                prompt_token_ids: Sequence[int] | None = None) -> list[int] | None: ...

    def num_reserved_cached_blocks(self, req_id: str) -> int: ...

    def add_prefilled_request(self, req_id: str, prompt_token_ids: Sequence[int],
                              first_token: int | Sequence[int], params: Any,
                              block_ids: Sequence[int]) -> None: ...

    def add_migrated_request(self, req_id: str, token_ids: Sequence[int],
                             num_prompt_tokens: int, params: Any,
                             block_ids: Sequence[int]) -> None: ...

    def abort(self, req_id: str) -> None: ...

    def release(self, req_id: str) -> None: ...

    def request_state(self, req_id: str) -> Any | None: ...

    def block_ids(self, req_id: str) -> list[int]: ...

    def num_computed_tokens(self, req_id: str) -> int: ...

    # -- steps and memory --------------------------------------------------------------
    def run_plan(self, decode_ids: Sequence[str], chunks: Sequence[tuple[str, int]]
                 ) -> tuple[list[Any], list[str]]: ...

    def protect_prefixes(self, block_hashes: Collection[int]) -> None: ...

    def drain_events(self) -> list[Any]: ...

    def can_recompute(self, req_id: str) -> bool: ...

    def swap_out(self, req_id: str) -> bool: ...

    def swap_in(self, req_id: str) -> bool: ...

    def preempt_recompute(self, req_id: str) -> bool: ...

    def detach_for_migration(self, req_id: str) -> Any | None: ...

    def reattach(self, req_id: str) -> bool: ...
