"""The batched sampler: one logits row per sequence that samples in this step -> its token,
and its log-probabilities when asked.

A step where every row is greedy and changes no logit (every new parameter at its neutral
value) is one batched argmax, the path and the cost it had before these parameters: the
check is one attribute a row. Otherwise, in vLLM's order:

1. masks: the grammar's allowed tokens (``engine.grammar``, one bitmask for the batch),
   ``allowed_token_ids``, EOS and stop tokens before ``min_tokens``; then ``logit_bias``;
2. penalties, batched over the rows that have any: output-token counts by one
   ``scatter_add`` over the padded output ids, a prompt mask the same way;
3. greedy rows: argmax of the processed logits;
4. random rows, batched: divide by the temperature, ``min_p`` (relative to the top
   probability), ``top_k`` (one ``topk`` at the largest k of the batch, a threshold a row),
   ``top_p`` (rows that ask are sorted), softmax, then inverse-CDF sampling: one cumulative
   sum for the batch and one ``searchsorted`` against each row's counter-based uniform
   (``engine.sampling.uniform``), so a row's draw depends only on its own seed, sequence and
   step.

Log-probabilities are those of the model's raw logits (vLLM's default ``raw_logprobs``):
log-softmax of the row before any of the above, at the chosen token, its rank, and the top
k. Prompt log-probabilities (:func:`prompt_logprobs`) are computed the same way, a slice
of rows at a time so a long prompt never holds a [tokens, vocab] float32 copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.grammar import Matcher, allocate_bitmask, apply_bitmask
from engine.sampling import SamplingParams, uniform

PROMPT_LOGPROB_ROWS = 256  # rows of logits turned into log-probabilities at once


@dataclass(slots=True)
class TokenLogprobs:
    """A token's log-probability, its rank among all tokens (1 = most likely), and the
    ``k`` most likely tokens with theirs."""

    token_id: int
    logprob: float
    rank: int
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class SampleRow:
    """One sequence about to draw output token number ``step``."""

    params: SamplingParams
    seed: int
    seq: int
    step: int
    prompt_ids: Sequence[int]  # read only for repetition_penalty
    output_ids: Sequence[int]  # read only for the penalties
    matcher: Matcher | None = None


def sample(
    logits: torch.Tensor,
    rows: Sequence[SampleRow],
    *,
    stop_ids: frozenset[int] = frozenset(),
    argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of ``logits`` [len(rows), vocab]: (token ids, logprobs per row,
    None where not asked). ``stop_ids``: the model's EOS ids (masked before min_tokens)."""
    logits = logits.float()
    processed: list[int] = []
    wants: list[int] = []
    randoms: list[int] = []
    for i, r in enumerate(rows):
        p = r.params
        if p.processes_logits:
            processed.append(i)
        if p.logprobs is not None:
            wants.append(i)
        if p.temperature != 0.0:
            randoms.append(i)
    if not processed and not randoms:  # the fast path: greedy, every parameter neutral
        chosen = _argmax(logits, argmax)
    else:
        with torch.inference_mode():  # the forward's logits are inference tensors
            work = logits.clone() if processed and wants else logits
            if processed:
                _process(work, rows, processed, stop_ids)
            chosen = _argmax(work, argmax)
            if randoms:
                picked = _draw(work, [rows[i] for i in randoms], randoms)
                chosen[torch.tensor(randoms, dtype=torch.long, device=chosen.device)] = picked
    token_ids = chosen.tolist()
    out: list[TokenLogprobs | None] = [None] * len(rows)
    if wants:
        index = torch.tensor(wants, dtype=torch.long, device=logits.device)
        raw = logits.index_select(0, index) if len(wants) < len(rows) else logits
        got = _logprobs(raw, chosen.index_select(0, index),
                        max(rows[i].params.logprobs or 0 for i in wants))
        for i, lp in zip(wants, got, strict=True):
            k = rows[i].params.logprobs or 0
            lp.top_token_ids, lp.top_logprobs = lp.top_token_ids[:k], lp.top_logprobs[:k]
            out[i] = lp
    return token_ids, out


def _argmax(logits: torch.Tensor, argmax: Callable[[torch.Tensor], torch.Tensor] | None
            ) -> torch.Tensor:
    if argmax is not None and logits.device.type == "cpu":
        return argmax(logits.contiguous())
    # max(dim) returns the first maximal index, like argmax, and runs faster on CPU.
    return logits.max(dim=-1).indices


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, next_ids: Sequence[int], k: int
                    ) -> list[TokenLogprobs]:
    """Row j of ``logits`` predicts ``next_ids[j]``: its log-probability, rank and top k."""
    out: list[TokenLogprobs] = []
    for start in range(0, len(next_ids), PROMPT_LOGPROB_ROWS):
        rows = logits[start : start + PROMPT_LOGPROB_ROWS].float()
        ids = torch.tensor(list(next_ids[start : start + rows.shape[0]]), dtype=torch.long,
                           device=rows.device)
        out += _logprobs(rows, ids, k)
    return out


def _logprobs(raw: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprobs]:
    lse = torch.logsumexp(raw, dim=-1, keepdim=True)
    picked = raw.gather(1, chosen.view(-1, 1))
    values = (picked - lse).squeeze(1).tolist()
    ranks = ((raw > picked).sum(dim=-1) + 1).tolist()
    top_ids: list[list[int]] = [[] for _ in values]
    top_lps: list[list[float]] = [[] for _ in values]
    if k > 0:
        top = torch.topk(raw, min(k, raw.shape[-1]), dim=-1)
        top_ids = top.indices.tolist()
        top_lps = (top.values - lse).tolist()
    return [TokenLogprobs(int(t), _finite(v), int(r), ti, [_finite(x) for x in tl])
            for t, v, r, ti, tl in zip(chosen.tolist(), values, ranks, top_ids, top_lps,
                                       strict=True)]


def _finite(x: float) -> float:
    """JSON has no -inf: a masked token's log-probability is reported as -9999.0 (vLLM's)."""
    return x if math.isfinite(x) else -9999.0


def _process(work: torch.Tensor, rows: Sequence[SampleRow], processed: list[int],
             stop_ids: frozenset[int]) -> None:
    """Masks, biases and penalties of the rows that have any, in place."""
    vocab = work.shape[-1]
    device = work.device
    grammar_rows = [i for i in processed if rows[i].matcher is not None]
    if grammar_rows:
        bitmask = allocate_bitmask(len(grammar_rows), vocab)
        for j, i in enumerate(grammar_rows):
            rows[i].matcher.fill(bitmask, j)  # type: ignore[union-attr]
        index = torch.tensor(grammar_rows, dtype=torch.long, device=device)
        sub = work.index_select(0, index)
        apply_bitmask(sub, bitmask)
        work.index_copy_(0, index, sub)
    for i in processed:
        p = rows[i].params
        row = work[i]
        if p.allowed_token_ids:
            ids = torch.tensor(p.allowed_token_ids, dtype=torch.long, device=device)
            kept = row.index_select(0, ids)
            row.fill_(float("-inf"))
            row.index_copy_(0, ids, kept)
        if rows[i].step < p.min_tokens:
            masked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(stop_ids))
            if masked:
                row[torch.tensor(sorted(masked), dtype=torch.long, device=device)] = float("-inf")
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=work.dtype, device=device)
            row.index_add_(0, ids, bias)
    penalized = [i for i in processed if rows[i].params.has_penalties]
    if penalized:
        _penalize(work, [rows[i] for i in penalized], penalized)


def _counts(id_lists: Sequence[Sequence[int]], vocab: int, device: torch.device
            ) -> torch.Tensor:
    """[rows, vocab] occurrence counts of each row's ids (one scatter_add for the batch)."""
    width = max((len(ids) for ids in id_lists), default=0)
    padded = torch.full((len(id_lists), max(width, 1)), vocab, dtype=torch.long)
    for j, ids in enumerate(id_lists):
        if ids:
            padded[j, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    counts = torch.zeros(len(id_lists), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab].to(device)


def _penalize(work: torch.Tensor, rows: list[SampleRow], where: list[int]) -> None:
    vocab = work.shape[-1]
    device = work.device
    index = torch.tensor(where, dtype=torch.long, device=device)
    sub = work.index_select(0, index)
    counts = _counts([r.output_ids for r in rows], vocab, device)
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device).view(-1, 1)
    if bool((rep != 1.0).any()):
        seen = (counts > 0) | (_counts([r.prompt_ids for r in rows], vocab, device) > 0)
        scaled = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, scaled, sub)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device).view(-1, 1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device).view(-1, 1)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    work.index_copy_(0, index, sub)


def _draw(work: torch.Tensor, rows: list[SampleRow], where: list[int]) -> torch.Tensor:
    """A token for each random row, by inverse-CDF over its filtered distribution.

    Rows with ``top_k`` or ``top_p`` sample from a short candidate list (``topk``: sorted,
    so the nucleus needs no sort of the vocabulary); a ``top_p`` row without ``top_k``
    takes the top ``CANDIDATES`` and falls back to the whole vocabulary only when those do
    not hold its nucleus. The rest use the whole row.
    """
    device = work.device
    index = torch.tensor(where, dtype=torch.long, device=device)
    temps = torch.tensor([r.params.temperature for r in rows], device=device).view(-1, 1)
    sub = work.index_select(0, index) / temps
    vocab = sub.shape[-1]
    picked = torch.zeros(len(rows), dtype=torch.long, device=device)
    short = [j for j, r in enumerate(rows)
             if 0 < r.params.top_k < vocab or r.params.top_p < 1.0]
    full = [j for j in range(len(rows)) if j not in set(short)]
    if short:
        got, fallback = _draw_candidates(sub, [rows[j] for j in short], short)
        picked.index_copy_(0, torch.tensor(short, device=device), got)
        full += [short[j] for j in fallback]
    if full:
        got = _draw_full(sub, [rows[j] for j in full], full)
        picked.index_copy_(0, torch.tensor(full, device=device), got)
    return picked


CANDIDATES = 1024  # a top_p row's first try: the nucleus of a language model is this short


def _min_p_floor(values: torch.Tensor, rows: list[SampleRow], top: torch.Tensor
                 ) -> torch.Tensor:
    """Mask (True: removed) of ``min_p``: probability below min_p x the top one's."""
    log_min_p = torch.tensor([math.log(r.params.min_p) if r.params.min_p > 0 else -math.inf
                              for r in rows], device=values.device).view(-1, 1)
    return values < top + log_min_p


def _draw_candidates(sub: torch.Tensor, rows: list[SampleRow], where: list[int]
                     ) -> tuple[torch.Tensor, list[int]]:
    """Tokens of the rows that sample from their top candidates; the positions (in
    ``rows``) whose nucleus the candidates did not hold, to draw from the whole row."""
    device = sub.device
    vocab = sub.shape[-1]
    ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
    width = min(vocab, max(max(ks), CANDIDATES if not all(ks) else 1))
    part = sub.index_select(0, torch.tensor(where, dtype=torch.long, device=device))
    vals, ids = torch.topk(part, width, dim=-1)  # sorted, largest first
    neg_inf = float("-inf")
    kept = torch.arange(width, device=device).view(1, -1) < torch.tensor(
        [k or width for k in ks], device=device).view(-1, 1)
    if any(r.params.min_p > 0 for r in rows):
        kept &= ~_min_p_floor(vals, rows, vals[:, :1])
    vals = vals.masked_fill(~kept, neg_inf)
    # top-k rows renormalize over their k (vLLM applies top-k, then top-p); the others
    # keep the probabilities of the whole (min_p-filtered) row
    whole = part
    if any(r.params.min_p > 0 for r in rows):
        whole = part.masked_fill(_min_p_floor(part, rows, vals[:, :1]), neg_inf)
    has_k = torch.tensor([k > 0 for k in ks], device=device).view(-1, 1)
    norm = torch.where(has_k, torch.logsumexp(vals, dim=-1, keepdim=True),
                       torch.logsumexp(whole, dim=-1, keepdim=True) if not all(ks)
                       else torch.zeros_like(vals[:, :1]))
    probs = torch.exp(vals - norm)
    top_p = torch.tensor([r.params.top_p for r in rows], device=device).view(-1, 1)
    cum = torch.cumsum(probs, dim=-1)
    drop = (cum - probs) > top_p  # the tokens ranked above cover top_p already
    drop[:, 0] = False
    covered = (cum[:, -1:] >= top_p) | has_k
    fallback = [j for j, ok in enumerate(covered.view(-1).tolist()) if not ok]
    probs = probs.masked_fill(drop, 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    u = torch.tensor([uniform(r.seed, r.seq, r.step) for r in rows], dtype=cdf.dtype,
                     device=device).view(-1, 1)
    col = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=width - 1)
    ok = torch.isfinite(cdf[:, -1]) & (cdf[:, -1] > 0)
    ok &= probs.gather(1, col).view(-1) > 0
    col = torch.where(ok.view(-1, 1), col, torch.zeros_like(col))  # else the top candidate
    return ids.gather(1, col).view(-1), fallback


def _draw_full(sub: torch.Tensor, rows: list[SampleRow], where: list[int]) -> torch.Tensor:
    """Tokens of the rows that sample from the whole vocabulary."""
    device = sub.device
    part = sub.index_select(0, torch.tensor(where, dtype=torch.long, device=device))
    neg_inf = float("-inf")
    if any(r.params.min_p > 0 for r in rows):
        part = part.masked_fill(
            _min_p_floor(part, rows, part.max(dim=-1, keepdim=True).values), neg_inf)
    ks = [r.params.top_k if 0 < r.params.top_k < part.shape[-1] else 0 for r in rows]
    if any(ks):  # a top-k row here: its top_p candidates fell short
        top = torch.topk(part, max(ks), dim=-1).values
        kth = top.gather(1, torch.tensor([max(k, 1) - 1 for k in ks], device=device).view(-1, 1))
        kth = torch.where(torch.tensor(ks, device=device).view(-1, 1) > 0, kth,
                          torch.full_like(kth, neg_inf))
        part = part.masked_fill(part < kth, neg_inf)
    nucleus = [j for j, r in enumerate(rows) if r.params.top_p < 1.0]
    if nucleus:
        nidx = torch.tensor(nucleus, dtype=torch.long, device=device)
        rows_n = part.index_select(0, nidx)
        sorted_logits, order = torch.sort(rows_n, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        top_p = torch.tensor([rows[j].params.top_p for j in nucleus], device=device).view(-1, 1)
        drop = (torch.cumsum(probs, dim=-1) - probs) > top_p
        drop[:, 0] = False
        rows_n = rows_n.scatter(1, order, sorted_logits.masked_fill(drop, neg_inf))
        part = part.index_copy(0, nidx, rows_n)
    probs = torch.softmax(part, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    u = torch.tensor([uniform(r.seed, r.seq, r.step) for r in rows], dtype=cdf.dtype,
                     device=device).view(-1, 1)
    picked = torch.searchsorted(cdf, u * total, right=True).clamp_(max=part.shape[-1] - 1)
    picked = picked.view(-1)
    ok = torch.isfinite(total.view(-1)) & (total.view(-1) > 0)
    ok &= probs.gather(1, picked.view(-1, 1)).view(-1) > 0
    if not bool(ok.all()):
        # Logits the model made non-finite (or every token masked): the most likely finite
        # token, never a raise.
        fallback = torch.nan_to_num(part, nan=neg_inf).max(dim=-1).indices
        picked = torch.where(ok, picked, fallback)
    return picked
