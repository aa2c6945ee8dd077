"""Responses kept for their tenant: found by id (`GET /v1/responses/{id}`, a next request's
`previous_response_id`), another tenant's never.

A running background response is this process's (`ResponseRecord`: its run lives here). An
ended one is a `KeptResponse`, kept in a `ResponseStore` (`server.generations.ports`) for
`responses.retention_seconds` after its end, within `responses.max_bytes` for each tenant's
together (the oldest go first): in Redis with `state.url`, so that any replica finds it, or
here, in SQLite under the data directory (`SqliteResponses`), so that it outlives the process.
With Redis, a running background response is kept there too, as it began, with the id of its
run (which any replica follows, `server.generations.ports`), and replaced once it ended.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from server.conversations_api.service import Turn
from server.core.sqlite import SqliteDatabase
from server.generations.ports import StoredResponse
from server.generations.registry import evictions, past_retention
from server.generations.run import GenerationRun
from server.responses_api.wire import ResponseBuilder, ResponseEvent

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL, id TEXT NOT NULL, ended_at REAL NOT NULL, size INTEGER NOT NULL,
    body BLOB NOT NULL, PRIMARY KEY (tenant, id));
CREATE INDEX IF NOT EXISTS responses_by_tenant_end ON responses (tenant, ended_at);
CREATE INDEX IF NOT EXISTS responses_by_end ON responses (ended_at);
"""


@dataclass(slots=True)
class ResponseRecord:
    """One response while it runs: its object as it stands (`builder`), the conversation it
    continues (chat messages: the earlier ones and its input, then its output once it ended),
    its run (whose log replays its events), for a background one, its events as its keeper
    read them (kept with it once it ends, to be streamed again) and, with `conversation`, its
    turn in that conversation (ended with it)."""

    tenant: str
    builder: ResponseBuilder
    conversation: list[dict[str, Any]]
    run: GenerationRun | None = None
    background: bool = False
    events: list[ResponseEvent] = field(default_factory=list)
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # its builder saw the end
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # and its end was kept
    turn: Turn | None = None

    @property
    def response_id(self) -> str:
        return self.builder.response_id

    def snapshot(self) -> dict[str, Any]:
        return self.builder.snapshot()

    def kept(self) -> KeptResponse:
        """The response to store: ended, or (its run shared by replicas) as it began."""
        if self.settled.is_set():
            events = self.events if self.background else None
            return KeptResponse(self.builder.snapshot(), self.conversation, events)
        assert self.run is not None
        return KeptResponse(
            self.builder.snapshot(),
            self.conversation,
            run_id=self.run.shape.public_id,
            turn=None if self.turn is None else self.turn.kept(),
        )


@dataclass(frozen=True, slots=True)
class KeptResponse:
    """A response as a store keeps it: its object, the conversation a next response
    continues, a background one's events once it ended and, while it runs (with Redis: on
    any replica), its run's public id instead (its object is then as it began), with its
    turn in a conversation if it has one (the replica that continues it ends it)."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    events: list[ResponseEvent] | None = None
    run_id: str | None = None
    turn: dict[str, Any] | None = None

    @property
    def background(self) -> bool:
        return bool(self.response["background"])

    @property
    def ended(self) -> bool:
        return self.run_id is None

    def snapshot(self) -> dict[str, Any]:
        return self.response

    def stored(self, tenant: str, ended_at: float) -> StoredResponse:
        body = orjson.dumps(
            {
                "response": self.response,
                "conversation": self.conversation,
                "events": self.events,
                "run_id": self.run_id,
                "turn": self.turn,
            }
        )
        return StoredResponse(tenant, self.response["id"], body, ended_at)

    @staticmethod
    def read(stored: StoredResponse) -> KeptResponse:
        fields = orjson.loads(stored.body)
        return KeptResponse(
            fields["response"],
            fields["conversation"],
            fields["events"],
            fields["run_id"],
            fields.get("turn"),  # (none in a response stored before conversations)
        )


class _Entry(NamedTuple):
    """A stored response as eviction reads it."""

    tenant: str
    response_id: str
    ended_at: float
    size: int


class SqliteResponses:
    """Ended responses in `directory/responses.sqlite3` (in memory with no directory): the
    `ResponseStore` of one host. WAL mode, each write one transaction that waits its turn, so
    processes sharing the directory share the responses, and none locks the others out. Its
    calls run on threads of its own (`SqliteDatabase`), never on the event loop."""

    def __init__(
        self,
        directory: Path | None,
        retention_seconds: float,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.retention_seconds = retention_seconds
        self.max_bytes = max_bytes
        self._clock = clock
        self._sql = SqliteDatabase.under(directory, "responses.sqlite3", SCHEMA)

    def close(self) -> None:
        self._sql.close()

    async def put(self, response: StoredResponse) -> None:
        await self._sql.transaction(self._put, response)

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        row = await self._sql.read(
            lambda db: db.execute(
                "SELECT body, ended_at FROM responses WHERE tenant = ? AND id = ?",
                (tenant, response_id),
            ).fetchone()
        )
        if row is None:
            return None
        stored = StoredResponse(tenant, response_id, bytes(row[0]), row[1])
        if past_retention(stored, self._clock(), self.retention_seconds):
            return None  # (dropped by the next write)
        return stored

    def _put(self, db: sqlite3.Connection, response: StoredResponse) -> None:
        db.execute(
            "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
            (
                response.tenant,
                response.response_id,
                response.ended_at,
                response.size,
                response.body,
            ),
        )
        self._sweep(db, response.tenant)

    def _sweep(self, db: sqlite3.Connection, tenant: str) -> None:
        """Drop every tenant's responses past their retention, then this tenant's oldest
        while its responses hold more than the bound."""
        self._evict(db, "", (), 0)
        (total,) = db.execute(
            "SELECT COALESCE(SUM(size), 0) FROM responses WHERE tenant = ?", (tenant,)
        ).fetchone()
        self._evict(db, "WHERE tenant = ?", (tenant,), total)

    def _evict(self, db: sqlite3.Connection, where: str, args: tuple[str, ...], total: int) -> None:
        """Drop what `evictions` says of the responses `where` picks (`total`: their bytes),
        read oldest first, and only as far as it drops."""
        rows = db.execute(
            f"SELECT tenant, id, ended_at, size FROM responses {where} ORDER BY ended_at", args
        )
        dropped = [
            (entry.tenant, entry.response_id)
            for entry in evictions(
                (_Entry(*row) for row in rows),
                total,
                self._clock(),
                self.retention_seconds,
                self.max_bytes,
            )
        ]
        rows.close()
        db.executemany("DELETE FROM responses WHERE tenant = ? AND id = ?", dropped)
