"""A Prometheus counter whose counts something else keeps, read when Prometheus scrapes.

The scheduler's core counts its own decisions as plain integers (it runs in the simulator too,
with no registry); `Gauge.set_function` reads such a value at scrape time, but a count only
grows, and Prometheus's `rate()` and `increase()` want it typed a counter. prometheus_client's
`Counter` has no `set_function`, so this exports through its public interface for custom
collectors (`CounterMetricFamily`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily


class CounterReadAtScrape:
    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        *,
        registry: CollectorRegistry,
    ) -> None:
        self._name = name.removesuffix("_total")
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._reads: dict[tuple[str, ...], Callable[[], float]] = {}
        registry.register(self)

    def set_function(self, labels: Sequence[str], read: Callable[[], float]) -> None:
        """The series `labels` reads its count from `read` at each scrape."""
        if len(labels) != len(self._labelnames):
            raise ValueError(f"{self._name}: expected labels {self._labelnames}")
        self._reads[tuple(labels)] = read

    def _family(self) -> CounterMetricFamily:
        return CounterMetricFamily(self._name, self._documentation, labels=self._labelnames)

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield self._family()

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = self._family()
        for labels, read in list(self._reads.items()):
            family.add_metric(list(labels), read())
        yield family
