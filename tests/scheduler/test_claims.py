"""Claims: what a waiting request sees claimed before it on a worker, kept incrementally,
equals the walk over every claim that the plan used to make."""

import random

from scheduler.claims import Claims


def _walk(claims: list[tuple[str, int, int, int]], worker: str, tier: int, need: int) -> int:
    return sum(b for w, t, n, b in claims if w == worker
               and (t < tier or (t == tier and n <= need)))


def test_held_matches_the_walk_over_every_claim() -> None:
    rng = random.Random(7)
    for _ in range(50):
        c = Claims(4)
        added: list[tuple[str, int, int, int]] = []
        for _ in range(rng.randint(0, 60)):
            w, t, n, b = rng.choice("ab"), rng.randrange(4), rng.randint(1, 12), rng.randint(0, 12)
            c.add(w, t, n, b)
            added.append((w, t, n, b))
            for _ in range(5):
                qw, qt, qn = rng.choice("abc"), rng.randrange(4), rng.randint(0, 14)
                assert c.held(qw, qt, qn) == _walk(added, qw, qt, qn)
        for w in "ab":
            assert sorted(c.entries(w)) == sorted((t, n, b) for x, t, n, b in added if x == w)


def test_equal_needs_count_each_claim_once() -> None:
    c = Claims(2)
    c.add("a", 1, 5, 10)
    c.add("a", 1, 5, 3)
    c.add("a", 0, 9, 4)
    assert c.held("a", 1, 5) == 17
    assert c.held("a", 1, 4) == 4
    assert c.held("a", 0, 100) == 4


def test_a_dispatch_that_passes_a_claim_is_noted() -> None:
    """A dispatch of tier 1 needing 4 passes a tier-1 claim needing 16 and any tier-2
    claim on its worker (those were sized by the blocks it now took); a more urgent or a
    smaller own-tier claim, or another worker's, is not passed."""
    c = Claims(3)
    c.add("w0", 0, 8, 8)
    c.add("w0", 1, 2, 2)
    c.add("w1", 1, 16, 10)
    c.note_dispatch("w0", 1, 4)
    c.note_dispatch("w2", 1, 4)
    assert not c.passed
    c.note_dispatch("w1", 1, 4)
    assert c.passed
    d = Claims(3)
    d.add("w0", 2, 3, 3)
    d.note_dispatch("w0", 1, 20)
    assert d.passed
