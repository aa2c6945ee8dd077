"""Resumable generations, found again by their tenant: by id (to resume a stream) and by
idempotency key (to answer a retried request with the same generation).

A record lives while its run runs and for `retention_seconds` after it ends, within
`max_bytes` for all the logs together; past the bound, the oldest ended records go first. A
run that ended before it was dispatched (refused or expired in the queue) is forgotten at
once: its key is free for a retry.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import orjson

from server.generations.run import GenerationRun

MAX_KEY_LENGTH = 255


def fingerprint(kind: str, body: Any) -> str:
    """The request as canonical JSON (keys sorted), hashed."""
    return hashlib.sha256(orjson.dumps([kind, body], option=orjson.OPT_SORT_KEYS)).hexdigest()


class Kept(Protocol):
    """A record kept while it runs and for a retention after it ended."""

    @property
    def ended_at(self) -> float | None: ...

    @property
    def size(self) -> int: ...


K = TypeVar("K", bound=Kept)


def past_retention(record: Kept, now: float, retention_seconds: float) -> bool:
    return record.ended_at is not None and now - record.ended_at > retention_seconds


def evictions(
    oldest_first: Iterable[K], total: int, now: float, retention_seconds: float, max_bytes: int
) -> Iterator[K]:
    """Which of `oldest_first` to drop (`total`: their bytes together): those past their
    retention, and the oldest ended ones while the rest hold more than `max_bytes`. It reads
    no further than it must, so a store whose records come in the order they ended reads
    only those it drops, and one more."""
    for record in oldest_first:
        expired = past_retention(record, now, retention_seconds)
        if not expired and total <= max_bytes:
            return
        if expired or record.ended_at is not None:
            yield record
            total -= record.size


@dataclass(slots=True)
class _Record:
    tenant: str
    key: str | None
    fingerprint: str
    run: GenerationRun
    ended_at: float | None = None
    ended_size: int = 0  # its log's bytes when it ended (it grows no more)

    @property
    def size(self) -> int:
        return self.run.size if self.ended_at is None else self.ended_size


class RunStore:
    """Running records, and ended ones in the order they ended: a sweep reads the running
    (whose logs still grow) and, of the ended, only those it drops and one more."""

    def __init__(
        self, retention_seconds: float, max_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.retention_seconds = retention_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._running: dict[GenerationRun, _Record] = {}
        self._ended: dict[GenerationRun, _Record] = {}  # oldest first (the clock is monotonic)
        self._ended_bytes = 0
        self._by_id: dict[tuple[str, str], _Record] = {}
        self._by_key: dict[tuple[str, str], _Record] = {}

    def __len__(self) -> int:
        return len(self._running) + len(self._ended)

    def add(self, tenant: str, key: str | None, print_: str, run: GenerationRun) -> None:
        self.sweep()
        record = _Record(tenant, key, print_, run)
        self._running[run] = record
        self._by_id[(tenant, run.shape.public_id)] = record
        if key is not None:
            self._by_key[(tenant, key)] = record

    def by_key(self, tenant: str, key: str) -> tuple[GenerationRun, str] | None:
        """The run made under `key` and its request's fingerprint."""
        record = self._live(self._by_key.get((tenant, key)))
        return None if record is None else (record.run, record.fingerprint)

    def by_id(self, tenant: str, public_id: str) -> GenerationRun | None:
        record = self._live(self._by_id.get((tenant, public_id)))
        return None if record is None else record.run

    def ended(self, run: GenerationRun) -> None:
        record = self._running.get(run)
        if record is None:
            return
        if not run.dispatched:
            self._drop(record)
            return
        del self._running[run]
        record.ended_size = run.size
        record.ended_at = self._clock()
        self._ended[run] = record
        self._ended_bytes += record.ended_size
        self.sweep()

    def sweep(self) -> None:
        """Drop the ended records past their retention, then the oldest ended ones while all
        together hold more than `max_bytes`."""
        total = self._ended_bytes + sum(record.size for record in self._running.values())
        now = self._clock()
        for record in list(
            evictions(self._ended.values(), total, now, self.retention_seconds, self.max_bytes)
        ):
            self._drop(record)

    def _live(self, record: _Record | None) -> _Record | None:
        if record is not None and past_retention(record, self._clock(), self.retention_seconds):
            self._drop(record)
            return None
        return record

    def _drop(self, record: _Record) -> None:
        if self._ended.pop(record.run, None) is not None:
            self._ended_bytes -= record.size
        self._running.pop(record.run, None)
        self._by_id.pop((record.tenant, record.run.shape.public_id), None)
        if record.key is not None:
            self._by_key.pop((record.tenant, record.key), None)
