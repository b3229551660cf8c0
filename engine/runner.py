"""Turns one scheduled batch into one model forward and returns the logits to sample.

Input: per request, the token ids to run now, their first position, the request's block table
and whether its last position is sampled. Output: logits rows of the sampled requests, in
order. Everything else (which requests, how many tokens) is the engine's business.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention import BATCH_KWARG, DecodeGroup, ForwardBatch, PrefillChunk
from engine.block_pool import BlockPool


@dataclass(slots=True)
class SeqWork:
    """One request's share of a forward: ``token_ids`` at positions start_pos.. onwards."""

    token_ids: Sequence[int]
    start_pos: int
    block_ids: Sequence[int]  # the request's block table, covering start_pos + len(token_ids)
    sample: bool  # return the logits of the last token


class ModelRunner:
    """Runs packed forwards of ``model`` over ``pool`` (the model uses paged attention)."""

    def __init__(self, model: torch.nn.Module, pool: BlockPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.kv_layout().device
        self.block_size = pool.block_size

    @torch.inference_mode()
    def execute(self, decodes: Sequence[SeqWork], chunks: Sequence[SeqWork]) -> torch.Tensor:
        """Forward ``decodes`` (one token each) then ``chunks``.

        Returns the logits [num_sampled, vocab] of the works with ``sample`` set, in the order
        given (decodes first, then chunks).
        """
        bs = self.block_size
        # a block's rows in the pool viewed as [num_blocks * L * 2 * bs, H, D] (block-major)
        block_rows = self.pool.kv_layout().num_layers * 2 * bs
        device = self.device
        # Decode rows go first, sorted by context length so that groups pad little.
        order = sorted(range(len(decodes)), key=lambda i: decodes[i].start_pos)
        row_of = [0] * len(decodes)
        input_ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # each token's row of layer 0's K (ForwardBatch.token_rows)
        for row, i in enumerate(order):
            work = decodes[i]
            pos = work.start_pos
            row_of[i] = row
            input_ids.append(work.token_ids[0])
            positions.append(pos)
            rows.append(work.block_ids[pos // bs] * block_rows + pos % bs)
        sample_rows = [row_of[i] for i, w in enumerate(decodes) if w.sample]
        batch = ForwardBatch(kv=self.pool.kv_tensor(), token_rows=torch.empty(0))
        sorted_blocks = [decodes[i].start_pos // bs + 1 for i in order]
        for first, end in group_rows(sorted_blocks, GROUP_OVERHEAD_BLOCKS):
            max_blocks = sorted_blocks[end - 1]
            table: list[int] = []
            for row in range(first, end):
                work = decodes[order[row]]
                needed = sorted_blocks[row]
                table.extend(work.block_ids[:needed])
                table.extend([0] * (max_blocks - needed))
            context_lens = torch.tensor(
                [decodes[order[row]].start_pos + 1 for row in range(first, end)], dtype=torch.long
            )
            mask = torch.arange(max_blocks * bs).view(1, -1) < context_lens.view(-1, 1)
            batch.decode_groups.append(
                DecodeGroup(
                    start=first,
                    end=end,
                    block_ids=torch.tensor(table, dtype=torch.long).to(device),
                    context_lens=context_lens.to(device),
                    mask=mask.view(end - first, 1, 1, -1).to(device),
                )
            )
        for work in chunks:
            start = len(input_ids)
            n = len(work.token_ids)
            input_ids.extend(work.token_ids)
            first = work.start_pos
            pos_range = range(first, first + n)
            positions.extend(pos_range)
            table = work.block_ids
            rows.extend(table[p // bs] * block_rows + p % bs for p in pos_range)
            context_len = first + n
            block_ids = None
            if first > 0:
                num_blocks = (context_len + bs - 1) // bs
                block_ids = torch.tensor(list(table[:num_blocks]), dtype=torch.long).to(device)
            batch.chunks.append(
                PrefillChunk(
                    start=start,
                    end=start + n,
                    context_len=context_len,
                    block_ids=block_ids,
                    positions=torch.arange(first, context_len, device=device),
                )
            )
            if work.sample:
                sample_rows.append(start + n - 1)
        batch.token_rows = torch.tensor(rows, dtype=torch.long).to(device)
        ids = torch.tensor(input_ids, dtype=torch.long).to(device).unsqueeze(0)
        pos_t = torch.tensor(positions, dtype=torch.long).to(device).unsqueeze(0)
        keep = torch.tensor(sample_rows, dtype=torch.long).to(device)
        out = self.model(
            input_ids=ids,
            position_ids=pos_t,
            use_cache=False,
            logits_to_keep=keep,
            **{BATCH_KWARG: batch},
        )
        return out.logits[0]


# A group's fixed cost (one gather + one SDPA call per layer) in blocks of padded KV.
GROUP_OVERHEAD_BLOCKS = 8


def group_rows(sorted_blocks: Sequence[int], overhead: int) -> list[tuple[int, int]]:
    """Split rows sorted by block count into [first, end) groups of least padded cost.

    Cost of a group = overhead + rows * its largest block count; exact dynamic programming
    over contiguous groups (rows <= max_num_seqs, so O(n^2) is cheap).
    """
    n = len(sorted_blocks)
    if n == 0:
        return []
    best = [0] * (n + 1)
    cut = [0] * (n + 1)
    for end in range(1, n + 1):
        width = sorted_blocks[end - 1]
        best_cost = -1
        for first in range(end):
            cost = best[first] + overhead + (end - first) * width
            if best_cost < 0 or cost < best_cost:
                best_cost, cut[end] = cost, first
        best[end] = best_cost
    groups: list[tuple[int, int]] = []
    end = n
    while end > 0:
        groups.append((cut[end], end))
        end = cut[end]
    groups.reverse()
    return groups
