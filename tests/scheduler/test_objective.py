"""scheduler/objective.py: the weighted miss objective every report carries."""

from __future__ import annotations

import pytest

from scheduler.objective import tier_weights, weighted_miss
from scheduler.tiers import default_tiers


def test_weights_come_from_the_config_in_tier_order() -> None:
    tiers = default_tiers()
    assert tier_weights(tiers) == tuple(t.weight for t in tiers.tiers)
    assert tier_weights(tiers)[0] > tier_weights(tiers)[-1]  # tier 0 matters most


def test_every_tier_on_target_is_zero_and_none_on_target_is_one() -> None:
    w = (8.0, 4.0, 2.0, 1.0)
    assert weighted_miss([1.0, 1.0, 1.0, 1.0], w) == 0.0
    assert weighted_miss([0.0, 0.0, 0.0, 0.0], w) == 1.0


def test_a_miss_costs_its_tiers_weight() -> None:
    w = (8.0, 4.0, 2.0, 1.0)
    # Half of tier 0 missed: 8 * 0.5 / 15; the same half of tier 3 costs 8 times less.
    assert weighted_miss([0.5, 1.0, 1.0, 1.0], w) == pytest.approx(4.0 / 15.0)
    assert weighted_miss([1.0, 1.0, 1.0, 0.5], w) == pytest.approx(0.5 / 15.0)
    assert weighted_miss([0.9, 0.8, 0.7, 0.6], w) == pytest.approx(
        (8 * 0.1 + 4 * 0.2 + 2 * 0.3 + 1 * 0.4) / 15.0)


def test_tiers_without_requests_are_left_out_of_both_sums() -> None:
    w = (8.0, 4.0, 2.0, 1.0)
    # Only tiers 1 and 3 had requests: (4 * 0.5 + 1 * 0) / (4 + 1).
    assert weighted_miss([None, 0.5, None, 1.0], w) == pytest.approx(0.4)
    assert weighted_miss([None, None, None, None], w) is None
    assert weighted_miss({}, w) is None


def test_the_reports_json_shape_is_taken_as_it_is() -> None:
    w = (8.0, 4.0, 2.0, 1.0)
    by_str = {"0": 0.5, "1": 1.0, "2": None, "3": 0.0}
    assert weighted_miss(by_str, w) == weighted_miss({0: 0.5, 1: 1.0, 3: 0.0}, w) \
        == weighted_miss([0.5, 1.0, None, 0.0], w) == pytest.approx((4.0 + 1.0) / 13.0)


@pytest.mark.parametrize("att, weights", [
    ([1.5, 1.0], (1.0, 1.0)), ([-0.1, 1.0], (1.0, 1.0)), ([float("nan"), 1.0], (1.0, 1.0)),
    ([1.0, 1.0], (1.0, 0.0)), ([1.0, 1.0, 1.0], (1.0, 1.0)), ({"5": 1.0}, (1.0, 1.0)),
])
def test_bad_figures_are_refused(att: object, weights: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        weighted_miss(att, weights)  # type: ignore[arg-type]

