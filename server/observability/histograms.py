"""Prometheus histograms whose observations arrive many at a time, or are kept elsewhere.

A stream's gaps between tokens are flushed to the registry once a second, a few hundred at a
time; `prometheus_client.Histogram` has no call for many observations, and one `observe` a
value costs about 1.9 µs here (a lock, a bucket search and two value updates each). This one
counts a whole list into its buckets in one pass and adds it under one lock (one value costs
0.3 µs: a request's dozen histograms at its end), and exports through prometheus_client's
public interface for custom collectors (`HistogramMetricFamily`), in the same series a
`Histogram` writes (`_bucket` by `le`, `_sum`, `_count`; no `_created`). `BatchedPair` counts
the same values into two of them in one pass; `HistogramReadAtScrape` exports counts something
else keeps (an engine's), read when Prometheus scrapes.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString


def with_infinity(buckets: Sequence[float]) -> tuple[float, ...]:
    """Bucket bounds, rising, the last +Inf."""
    bounds = sorted(float(b) for b in buckets)
    return (*bounds, math.inf) if bounds[-1] != math.inf else tuple(bounds)


def cumulative(les: Sequence[str], counts: Sequence[int]) -> list[tuple[str, float]]:
    """A histogram's buckets as the exposition has them: (le, the count up to it)."""
    buckets, running = [], 0
    for le, n in zip(les, counts, strict=True):
        running += n
        buckets.append((le, float(running)))
    return buckets


class BatchedChild:
    __slots__ = ("_lock", "bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...], lock: threading.Lock) -> None:
        self.bounds = bounds  # rising, the last +Inf
        self._lock = lock
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect_left(self.bounds, value)
        with self._lock:
            self.counts[i] += 1
            self.sum += value

    def observe_many(self, values: Sequence[float]) -> None:
        """Each of `values` counted in the first bucket whose bound it does not exceed."""
        bounds = self.bounds
        counts = [0] * len(bounds)
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        self.add(counts, sum(values))

    def add(self, counts: Sequence[int], total: float) -> None:
        """Values counted per bucket of its bounds already (not cumulative), summing `total`."""
        with self._lock:
            for i, n in enumerate(counts):
                if n:
                    self.counts[i] += n
            self.sum += total


class BatchedPair:
    """Two histograms of the same values, each with bounds of its own, counted in one pass:
    one bucket search a value, among the union of their bounds (Sluice's inter-token latency
    and vLLM's)."""

    __slots__ = ("_bounds", "_first", "_into_first", "_into_second", "_second")

    def __init__(self, first: BatchedChild, second: BatchedChild) -> None:
        self._first, self._second = first, second
        self._bounds = tuple(sorted({*first.bounds, *second.bounds}))
        # A value in the union's bucket i lies in each one's first bucket whose bound is at
        # least the union's bound i (no bound of either lies between two of the union's).
        self._into_first = [bisect_left(first.bounds, b) for b in self._bounds]
        self._into_second = [bisect_left(second.bounds, b) for b in self._bounds]

    def observe_many(self, values: Sequence[float]) -> None:
        bounds = self._bounds
        counts = [0] * len(bounds)
        for value in values:
            counts[bisect_left(bounds, value)] += 1
        total = sum(values)
        for child, into in ((self._first, self._into_first), (self._second, self._into_second)):
            theirs = [0] * len(child.bounds)
            for i, n in enumerate(counts):
                if n:
                    theirs[into[i]] += n
            child.add(theirs, total)


class BatchedHistogram:
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self.bounds = with_infinity(buckets)
        self._les = tuple(floatToGoString(b) for b in self.bounds)
        self._lock = threading.Lock()
        self._children: dict[tuple[str, ...], BatchedChild] = {}
        registry.register(self)

    def labels(self, *values: str) -> BatchedChild:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self._name}: expected labels {self._labelnames}")
            with self._lock:
                child = self._children.setdefault(values, BatchedChild(self.bounds, self._lock))
        return child

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=self._labelnames)
        with self._lock:
            children = [(v, list(c.counts), c.sum) for v, c in self._children.items()]
        for values, counts, total in children:
            family.add_metric(list(values), cumulative(self._les, counts), total)
        yield family


class HistogramReadAtScrape:
    """A histogram whose counts something else keeps (an engine's), exported from `read` when
    Prometheus scrapes: per bucket of `buckets` and one more above them (not cumulative), and
    their sum."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labels: dict[str, str],
        *,
        buckets: Sequence[float],
        read: Callable[[], tuple[Sequence[int], float]],
        registry: CollectorRegistry,
    ) -> None:
        self._name = name
        self._documentation = documentation
        self._labels = labels
        self._les = tuple(floatToGoString(b) for b in with_infinity(buckets))
        self._read = read
        registry.register(self)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self._name, self._documentation, labels=list(self._labels))
        counts, total = self._read()
        family.add_metric(list(self._labels.values()), cumulative(self._les, counts), total)
        yield family
