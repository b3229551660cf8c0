"""The seed objective every report carries: the weighted miss probability over the tiers.

    weighted_miss = sum_t w_t * (1 - attainment_t) / sum_t w_t

over the tiers that had requests (``attainment_t`` not None), with ``w_t`` the tier's
``TierSpec.weight`` from the config the run used (:func:`tier_weights`). 0 is every request
of every tier on target; 1 is none. Lower is better; it is what the scheduler is meant to
minimise (issue 22).

A miss is every request that did not end on target, whatever ended it: the attainment
figures the reports pass in already count a rejection (HTTP 429 or the kernel's REJECTED),
an error and a client timeout as a miss, because each divides the requests that met every
target of their tier by *all* of that tier's requests:

- ``bench.http_replay.summarize`` (``tierserve bench``, ``bench --peer``, ``bench.compare``,
  ``bench-pressure``): ``met / len(mine)``, where ``slo_met`` is False for an outcome that is
  not ``ok`` (429, any other error, ``timeout``, no tokens);
- ``scheduler.sim.metrics.summarize`` (``tierserve simulate``): ``attained / total``, where
  ``total`` counts rejected and unfinished requests and only a completed request that met
  its targets is attained.

Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from scheduler.tiers import TierConfig


def tier_weights(tiers: TierConfig) -> tuple[float, ...]:
    """Each tier's weight, in tier order."""
    return tuple(t.weight for t in tiers.tiers)


def weighted_miss(attainment_by_tier: Mapping[int | str, float | None] | Sequence[float | None],
                  weights: Sequence[float]) -> float | None:
    """``sum_t w_t (1 - a_t) / sum_t w_t`` over the tiers whose attainment ``a_t`` is known.

    ``attainment_by_tier``: per tier, the share of its requests that met every target
    (misses include rejections, errors and timeouts, see the module docstring), or None
    for a tier that had no request; a mapping keyed by the tier (``0`` or ``"0"``, as the
    reports' JSON has it) or a sequence in tier order. ``weights``: per tier, in tier
    order (:func:`tier_weights`). Returns None when no tier had a request.

    Raises ValueError for an attainment outside [0, 1], a weight that is not a positive
    number, or a tier with no weight.
    """
    items = (attainment_by_tier.items() if isinstance(attainment_by_tier, Mapping)
             else enumerate(attainment_by_tier))
    num = den = 0.0
    for key, a in items:
        tier = int(key)
        if not 0 <= tier < len(weights):
            raise ValueError(f"weighted_miss: tier {key} has no weight ({len(weights)} given)")
        if a is None:
            continue
        a = float(a)
        if not (math.isfinite(a) and 0.0 <= a <= 1.0):
            raise ValueError(f"weighted_miss: tier {key} attainment {a} is not in [0, 1]")
        w = float(weights[tier])
        if not (math.isfinite(w) and w > 0):
            raise ValueError(f"weighted_miss: tier {key} weight {w} is not positive")
        num += w * (1.0 - a)
        den += w
    return num / den if den > 0 else None
