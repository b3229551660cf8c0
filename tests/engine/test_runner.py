"""Decode grouping: rows sorted by length split into groups of little padding."""

from __future__ import annotations

from engine.runner import group_rows


def covers(groups: list[tuple[int, int]], n: int) -> bool:
    return [g[0] for g in groups] == [0] + [g[1] for g in groups[:-1]] and groups[-1][1] == n


def test_equal_lengths_make_one_group() -> None:
    assert group_rows([5] * 10, overhead=8) == [(0, 10)]


def test_spread_lengths_split_where_padding_would_cost_more() -> None:
    blocks = [2] * 30 + [60] * 2
    groups = group_rows(blocks, overhead=8)
    assert covers(groups, len(blocks))
    assert groups == [(0, 30), (30, 32)]
    # With a huge per-group cost, one group is cheapest.
    assert group_rows(blocks, overhead=10_000) == [(0, 32)]


def test_empty_and_single() -> None:
    assert group_rows([], overhead=8) == []
    assert group_rows([3], overhead=8) == [(0, 1)]
