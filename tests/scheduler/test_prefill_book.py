"""A worker's prefill book: its seconds, kept between changes, equal a fresh book's."""

from __future__ import annotations

import random

from scheduler.backlog import PrefillBook
from scheduler.step_costs import GPU_PRIOR, StepCosts, StepShape


def _fresh(book: PrefillBook, num_tiers: int, chunk: int, tiers: dict[str, int]) -> PrefillBook:
    out = PrefillBook(num_tiers, chunk)
    for rid, left in book.as_dict().items():
        out.put(rid, left, tiers[rid])
    return out


def test_kept_seconds_equal_a_fresh_book_after_every_change() -> None:
    rng = random.Random(3)
    costs = StepCosts(GPU_PRIOR, chunk_tokens=256)
    book = PrefillBook(4, 256)
    tiers: dict[str, int] = {}
    for i in range(2000):
        rid = f"r{rng.randrange(40)}"
        if rng.random() < 0.3:
            book.pop(rid)
        else:
            tier = tiers.setdefault(rid, rng.randrange(4))
            book.put(rid, rng.randint(-5, 20_000), tier)
        if rng.random() < 0.05:  # the worker's fitted costs move on
            costs.observe(StepShape.of([(rng.randint(1, 4096), 0)], []), rng.uniform(0.01, 0.2))
        fresh = _fresh(book, 4, 256, tiers)
        if rng.random() < 0.5:  # read in either order: each is kept on its own
            assert book.by_tier_s(costs) == fresh.by_tier_s(costs), i
            assert book.backlog_s(costs) == fresh.backlog_s(costs), i
        else:
            assert book.backlog_s(costs) == fresh.backlog_s(costs), i
            assert book.by_tier_s(costs) == fresh.by_tier_s(costs), i
