"""What one engine hands another when a decoding request moves (issue 15, DESIGN §4).

``LLMEngine.detach_for_migration`` returns a :class:`MigrationSnapshot`: the request's
tokens (prompt, then every output token so far, the last one not yet computed) and the
blocks whose KV the target needs, in block-table order. The worker sends the tokens in a
``MigrateIn`` message and the blocks over kvtransfer into the target's reservation; the
target's ``add_migrated_request`` then decodes on from the last token. Greedy decoding
continues token for token as if nothing moved (tests/cluster/test_kv_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MigrationSnapshot:
    req_id: str
    token_ids: tuple[int, ...]  # prompt + outputs
    num_prompt_tokens: int
    num_computed: int  # tokens whose KV is in ``block_ids`` (all but the last)
    block_ids: tuple[int, ...]

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return self.token_ids[self.num_prompt_tokens:]
