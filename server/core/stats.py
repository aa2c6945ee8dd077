"""Percentiles, one rule for the whole project: the nearest rank (the smallest value with at
least `q` of the values at or below it), so that a p99 is always a value that was measured."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def nearest_rank(ordered: Sequence[float], q: float) -> float:
    """The `q` quantile (0 < q <= 1) of sorted, non-empty values."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def quantile(values: Iterable[float], q: float) -> float | None:
    """The `q` quantile (0 < q <= 1) of `values`, in any order (None: no values)."""
    ordered = sorted(values)
    return nearest_rank(ordered, q) if ordered else None
