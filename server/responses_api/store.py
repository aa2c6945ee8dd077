"""Responses kept for their tenant: found by id (`GET /v1/responses/{id}`, a next request's
`previous_response_id`), another tenant's never.

A record lives while its generation runs and for `retention_seconds` after it ends, within
`max_bytes` for all of them together; past the bound, the oldest ended records go first (as
the idempotency store's, `server.generations.registry`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from server.generations.registry import past_retention, sweep
from server.generations.run import GenerationRun
from server.openai.responses_api import ResponseBuilder


@dataclass(slots=True)
class ResponseRecord:
    """One response: its object as it stands (`builder`), the conversation it continues (chat
    messages: the earlier ones and its input, then its output once it ended) and, while a
    background response runs and after, its run (whose log replays its events)."""

    tenant: str
    builder: ResponseBuilder
    conversation: list[dict[str, Any]]
    run: GenerationRun | None = None
    background: bool = False
    ended_at: float | None = None
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # its builder saw the end
    _size: int = 0

    @property
    def response_id(self) -> str:
        return self.builder.response_id

    @property
    def size(self) -> int:
        """Bytes it holds, roughly."""
        return self._size + (self.run.size if self.run is not None else 0)

    def end(self, now: float) -> None:
        self.ended_at = now
        self._size = len(orjson.dumps([self.builder.snapshot(), self.conversation]))


class ResponseStore:
    def __init__(
        self, retention_seconds: float, max_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.retention_seconds = retention_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._records: dict[tuple[str, str], ResponseRecord] = {}  # oldest first

    def __len__(self) -> int:
        return len(self._records)

    def add(self, record: ResponseRecord) -> None:
        self._records[(record.tenant, record.response_id)] = record
        self.sweep()

    def get(self, tenant: str, response_id: str) -> ResponseRecord | None:
        record = self._records.get((tenant, response_id))
        if record is not None and past_retention(record, self._clock(), self.retention_seconds):
            self._drop(record)
            return None
        return record

    def ended(self, record: ResponseRecord) -> None:
        """A record's response ended: kept from now for the retention."""
        record.end(self._clock())
        self.sweep()

    def sweep(self) -> None:
        now = self._clock()
        sweep(self._records.values(), now, self.retention_seconds, self.max_bytes, self._drop)

    def _drop(self, record: ResponseRecord) -> None:
        self._records.pop((record.tenant, record.response_id), None)
