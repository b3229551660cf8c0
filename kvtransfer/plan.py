"""The segment plan of a transfer: which reserved slots travel together in one message.

Both sides compute it from the ticket alone (the consumer's slots in prompt order, the
positions already present there, and the consumer's ``segment_blocks``), so it needs no
message of its own. A segment is a run of positions still to send whose slots are consecutive
in the consumer's pool (at most ``segment_blocks`` blocks; one contiguous region of a
block-major pool, one strided copy into a layer-major one): the consumer receives it with one
receive (straight into the slots of a block-major pool, else into a staging buffer it then
scatters), the producer sends it with one message (from a block-major pool when its source
blocks are consecutive too, else from a staging buffer it gathers them into). Positions
ascend through the plan, so a segment can be sent as soon as its last position has been
pushed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgpack


@dataclass(frozen=True, slots=True)
class Segment:
    index: int
    positions: tuple[int, ...]  # indices into the ticket's block_ids, ascending
    first_slot: int  # the consumer's block id at positions[0]; the others follow it

    @property
    def num_blocks(self) -> int:
        return len(self.positions)

    @property
    def last_position(self) -> int:
        return self.positions[-1]


def plan_segments(block_ids: Sequence[int], present: Iterable[int],
                  segment_blocks: int) -> list[Segment]:
    """Cut the positions not in ``present`` into segments of consecutive slots."""
    if segment_blocks < 1:
        raise ValueError(f"segment_blocks must be >= 1, got {segment_blocks}")
    skip = frozenset(present)
    segments: list[Segment] = []
    run: list[int] = []
    for pos, slot in enumerate(block_ids):
        if pos in skip:
            continue
        if run and (slot != block_ids[run[-1]] + 1 or len(run) == segment_blocks):
            segments.append(Segment(len(segments), tuple(run), block_ids[run[0]]))
            run = []
        run.append(pos)
    if run:
        segments.append(Segment(len(segments), tuple(run), block_ids[run[0]]))
    return segments


def segment_blocks_for(part_bytes: int, bytes_per_block: int) -> int:
    """Blocks per segment so that one message carries at most ``part_bytes`` (at least one)."""
    return max(1, part_bytes // bytes_per_block)


def ticket_digest(block_ids: Sequence[int], present: Iterable[int]) -> int:
    """64-bit digest of a reservation: the Open carries the producer's, the consumer compares
    it with its own, so a ticket altered on the way is refused before any write."""
    body = msgpack.packb([list(block_ids), sorted(present)])
    return int.from_bytes(hashlib.blake2b(body, digest_size=8).digest(), "little")
