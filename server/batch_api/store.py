"""Durable state of the Batch API: files, batches and each batch's lines, in SQLite.

One database file under the data directory, in WAL mode with full syncs: every change is one
transaction, so a process killed at any instant leaves each batch, file and line as it was
before or after a change, never between. A line is `pending` until its result is written with
it in one transaction; a line that was running when the process died is still `pending`, and
runs again (its half-made output was never written).

The interface is small (`BatchStore`), so that a shared store (Redis, Postgres) can take its
place when several replicas share batches.
"""

from __future__ import annotations

import fcntl
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL, result TEXT, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS pending_lines ON lines (batch_id, state, idx);
"""

# A batch's statuses, in the order it may pass them (OpenAI's); each after the first stamps
# its `<status>_at` time.
STATUSES = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "expired",
    "cancelling",
    "cancelled",
)
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(slots=True)
class Line:
    index: int
    custom_id: str
    body: dict[str, Any]


@dataclass(slots=True)
class Batch:
    """OpenAI's batch object, as stored (`to_api` adds nothing that is not here)."""

    id: str
    tenant: str
    input_file_id: str
    endpoint: str
    completion_window: str
    created_at: int
    expires_at: int
    status: str = "validating"
    metadata: dict[str, str] | None = None
    errors: dict[str, Any] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict[str, int | None] = field(default_factory=dict)
    request_counts: dict[str, int] = field(
        default_factory=lambda: {"total": 0, "completed": 0, "failed": 0}
    )

    def to_api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": self.errors,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            **{f"{name}_at": self.times.get(name) for name in STATUSES[1:]},
            "request_counts": dict(self.request_counts),
            "metadata": self.metadata,
        }

    def to_row(self) -> str:
        return json.dumps({key: getattr(self, key) for key in Batch.__slots__})

    @staticmethod
    def from_row(text: str) -> Batch:
        return Batch(**json.loads(text))


class DataDirInUse(RuntimeError):
    """Another Sluice process owns this data directory (and its batches)."""


class BatchStore:
    """Files, batches and lines (see the module's docstring), in `directory/batches.sqlite3`.
    One process owns a directory at a time (an exclusive lock on `directory/lock`). Each call
    is short (indexed reads, one transaction per write)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = (directory / "lock").open("w")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise DataDirInUse(
                f"{directory} is in use by another Sluice process; give this one its own --data-dir"
            ) from None
        path = directory / "batches.sqlite3"
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        self._db.close()
        self._lock_file.close()

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    # -- files ------------------------------------------------------------------------------

    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        file = {
            "id": "file-" + uuid.uuid4().hex,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
        }
        with self._transaction() as db:
            db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                (file["id"], tenant, purpose, filename, len(content), file["created_at"], content),
            )
        return file

    def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        row = self._db.execute(
            "SELECT id, bytes, created_at, filename, purpose FROM files WHERE tenant = ? AND "
            "id = ?",
            (tenant, file_id),
        ).fetchone()
        return None if row is None else _file(row)

    def files(self, tenant: str, purpose: str | None = None) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT id, bytes, created_at, filename, purpose FROM files WHERE tenant = ? AND "
            "(? IS NULL OR purpose = ?) ORDER BY created_at DESC, id",
            (tenant, purpose, purpose),
        ).fetchall()
        return [_file(row) for row in rows]

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        row = self._db.execute(
            "SELECT content FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)
        ).fetchone()
        return None if row is None else bytes(row[0])

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._transaction() as db:
            return (
                db.execute(
                    "DELETE FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)
                ).rowcount
                > 0
            )

    # -- batches ----------------------------------------------------------------------------

    def add_batch(self, batch: Batch, lines: list[Line]) -> None:
        with self._transaction() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?)",
                (batch.id, batch.tenant, seq, batch.to_row()),
            )
            db.executemany(
                "INSERT INTO lines VALUES (?, ?, ?, ?, 'pending', NULL)",
                [(batch.id, line.index, line.custom_id, json.dumps(line.body)) for line in lines],
            )

    def batch(self, tenant: str | None, batch_id: str) -> Batch | None:
        row = self._db.execute(
            "SELECT body FROM batches WHERE id = ? AND (? IS NULL OR tenant = ?)",
            (batch_id, tenant, tenant),
        ).fetchone()
        return None if row is None else Batch.from_row(row[0])

    def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """The tenant's batches, newest first, after the one with id `after`; and whether
        there are more."""
        start = None
        if after is not None:
            found = self._db.execute(
                "SELECT seq FROM batches WHERE tenant = ? AND id = ?", (tenant, after)
            ).fetchone()
            start = found[0] if found is not None else None
        rows = self._db.execute(
            "SELECT body FROM batches WHERE tenant = ? AND (? IS NULL OR seq < ?) "
            "ORDER BY seq DESC LIMIT ?",
            (tenant, start, start, limit + 1),
        ).fetchall()
        return [Batch.from_row(row[0]) for row in rows[:limit]], len(rows) > limit

    def statuses(self) -> list[str]:
        return [
            Batch.from_row(row[0]).status for row in self._db.execute("SELECT body FROM batches")
        ]

    def active(self) -> list[Batch]:
        rows = self._db.execute("SELECT body FROM batches ORDER BY seq").fetchall()
        return [
            batch for batch in (Batch.from_row(row[0]) for row in rows) if batch.status in ACTIVE
        ]

    def save(self, batch: Batch) -> None:
        with self._transaction() as db:
            db.execute("UPDATE batches SET body = ? WHERE id = ?", (batch.to_row(), batch.id))

    # -- lines ------------------------------------------------------------------------------

    def pending(self, batch_id: str, limit: int, skip: Collection[int] = ()) -> list[Line]:
        """Up to `limit` pending lines, first first, leaving out the indices in `skip` (those
        running), so only the lines returned are read and decoded."""
        rows = self._db.execute(
            "SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND state = 'pending' "
            "AND idx NOT IN (SELECT value FROM json_each(?)) ORDER BY idx LIMIT ?",
            (batch_id, json.dumps(sorted(skip)), limit),
        ).fetchall()
        return [Line(idx, custom_id, json.loads(body)) for idx, custom_id, body in rows]

    def finish_line(self, batch: Batch, index: int, state: str, result: dict[str, Any]) -> None:
        """The line's result and the batch's counts, in one transaction."""
        with self._transaction() as db:
            changed = db.execute(
                "UPDATE lines SET state = ?, result = ? WHERE batch_id = ? AND idx = ? AND "
                "state = 'pending'",
                (state, json.dumps(result), batch.id, index),
            ).rowcount
            if changed:
                batch.request_counts["completed" if state == "done" else "failed"] += 1
                db.execute("UPDATE batches SET body = ? WHERE id = ?", (batch.to_row(), batch.id))

    def results(self, batch_id: str, state: str) -> Iterator[str]:
        for (result,) in self._db.execute(
            "SELECT result FROM lines WHERE batch_id = ? AND state = ? ORDER BY idx",
            (batch_id, state),
        ):
            yield result

    def finalize(self, batch: Batch, status: str, output: bytes, errors: bytes, now: int) -> None:
        """Store the output and error files and the batch's end, in one transaction."""
        with self._transaction() as db:
            for content, attribute, name in (
                (output, "output_file_id", "output"),
                (errors, "error_file_id", "errors"),
            ):
                if content:
                    file_id = "file-" + uuid.uuid4().hex
                    db.execute(
                        "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (
                            file_id,
                            batch.tenant,
                            "batch_output",
                            f"{batch.id}_{name}.jsonl",
                            len(content),
                            now,
                            content,
                        ),
                    )
                    setattr(batch, attribute, file_id)
            batch.status = status
            batch.times[status] = now
            db.execute("UPDATE batches SET body = ? WHERE id = ?", (batch.to_row(), batch.id))


def _file(row: tuple[Any, ...]) -> dict[str, Any]:
    file_id, size, created_at, filename, purpose = row
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
    }
