"""A prompt's KV block identities: the one hash that every layer agrees on.

A full block of ``block_size`` tokens is named by blake2b-64 over its parent's hash (8 bytes
little-endian, 0 for the first block) and its token ids (uint32 little-endian); the digest
is read little-endian. The chain makes a block's hash name its whole prefix, so equal
hashes mean equal KV. The global scheduler's prefix index, the engine's block pool and the
workers all hash with these two functions (pure Python: importing them pulls in no torch).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """A full block's identity: blake2b-64 over the parent's hash and the block's tokens."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash or 0).to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little")


def compute_block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
