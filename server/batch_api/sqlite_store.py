"""The Batch API's store in SQLite, under the data directory, shared by the processes of one
host.

One database file in WAL mode with full syncs: every change is one transaction, so a process
killed at any instant leaves each batch, file and line as it was before or after a change,
never between. Several processes open the same file (WAL lets readers go on beside a writer;
a writer waits for another's transaction, for up to `server.core.sqlite.BUSY_TIMEOUT_S`), and
a batch is run by the one that holds its row in `claims` (owner and lease expiry, on this
host's clock). The row exists while the batch is active.

A batch's output and error files are rows in `files` without content, naming the batch and
the states of its lines they hold; read, they are streamed from `lines`, a page at a time.

Each call is short (indexed reads, one transaction per write) and runs on the store's own
threads (`server.core.sqlite`): a held write lock or a slow sync never stalls the event loop.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Collection
from pathlib import Path
from typing import Any

from server.batch_api.store import (
    ACTIVE,
    CANCELLABLE,
    PAGE_LINES,
    RESULT_FILES,
    Batch,
    Line,
    file_object,
    finished,
    one_chunk,
    result_files,
)
from server.core.ids import new_id
from server.core.sqlite import SqliteDatabase, statements

# A batch's status: a column read from its body, where it is written once (indexed, and added
# to a store made before it).
STATUS = "status TEXT GENERATED ALWAYS AS (json_extract(body, '$.status')) VIRTUAL"
# A batch's result file: the batch, and the states of the lines it holds (JSON); its content is
# empty. Null for an uploaded file. (Added to a store made before it.)
RESULT_COLUMNS = "batch_id TEXT, states TEXT"
SCHEMA = f"""
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL,
    {RESULT_COLUMNS});
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL,
    {STATUS});
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL, body TEXT NOT NULL,
    state TEXT NOT NULL, result TEXT, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS pending_lines ON lines (batch_id, state, idx);
CREATE TABLE IF NOT EXISTS claims (
    batch_id TEXT PRIMARY KEY, owner TEXT, until REAL NOT NULL DEFAULT 0);
"""
BY_STATUS = "CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status)"

# A store made before claims existed: a row for each of its active batches.
CLAIMS_FOR_ACTIVE = """
INSERT OR IGNORE INTO claims (batch_id)
SELECT id FROM batches WHERE status IN ({})
""".format(", ".join(f"'{status}'" for status in ACTIVE))


class SqliteBatchStore:
    """`BatchStore` (`server.batch_api.store`) in `directory/batches.sqlite3`, its calls on
    threads of its own (`SqliteDatabase`). `clock`: the leases' (wall) clock, which every process
    of the host shares."""

    def __init__(self, directory: Path, clock: Callable[[], float] = time.time) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self._sql = SqliteDatabase(directory / "batches.sqlite3")
        # Two processes starting at once: one makes the tables.
        self._sql.transaction_now(_create)

    async def close(self) -> None:
        self._sql.close()

    # -- files ------------------------------------------------------------------------------

    async def add_file(
        self, tenant: str, purpose: str, filename: str, content: bytes
    ) -> dict[str, Any]:
        file = file_object(new_id("file"), len(content), int(time.time()), filename, purpose)
        await self._sql.transaction(_insert_file, tenant, file, content)
        return file

    async def file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        row = await self._sql.read(_one, FILE, (tenant, file_id))
        return None if row is None else file_object(*row)

    async def files(self, tenant: str, purpose: str | None = None) -> list[dict[str, Any]]:
        rows = await self._sql.read(_all, FILES, (tenant, purpose, purpose))
        return [file_object(*row) for row in rows]

    async def file_content(self, tenant: str, file_id: str) -> AsyncIterator[bytes] | None:
        row = await self._sql.read(_one, FILE_CONTENT, (tenant, file_id))
        if row is None:
            return None
        content, batch_id, states = row
        return one_chunk(bytes(content)) if batch_id is None else self._results(batch_id, states)

    async def _results(self, batch_id: str, states: str) -> AsyncIterator[bytes]:
        after = -1
        while rows := await self._sql.read(_all, RESULTS, (batch_id, after, states, PAGE_LINES)):
            yield "".join(result + "\n" for _, result in rows).encode()
            after = rows[-1][0]

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        return await self._sql.transaction(_changed, DELETE_FILE, (tenant, file_id)) > 0

    # -- batches ----------------------------------------------------------------------------

    async def add_batch(self, batch: Batch, lines: list[Line]) -> None:
        await self._sql.transaction(_add_batch, batch, lines)

    async def batch(self, tenant: str | None, batch_id: str) -> Batch | None:
        return await self._sql.read(_batch, tenant, batch_id)

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        rows = await self._sql.read(_batches, tenant, after, limit + 1)
        return [Batch.from_row(row[0]) for row in rows[:limit]], len(rows) > limit

    async def statuses(self) -> list[str]:
        rows = await self._sql.read(_all, "SELECT status FROM batches", ())
        return [status for (status,) in rows]

    async def cancel(self, tenant: str, batch_id: str, now: int) -> Batch | None:
        return await self._sql.transaction(_cancel, tenant, batch_id, now)

    # -- claims -----------------------------------------------------------------------------

    async def claimable(self, owner: str) -> list[str]:
        rows = await self._sql.read(_all, CLAIMABLE, (owner, self.clock()))
        return [batch_id for (batch_id,) in rows]

    async def claim(self, batch_id: str, owner: str, lease_s: float) -> Batch | None:
        return await self._sql.transaction(_claim, batch_id, owner, self.clock(), lease_s)

    async def renew(self, owner: str, batch_ids: Collection[str], lease_s: float) -> dict[str, str]:
        ids = json.dumps(sorted(batch_ids))
        return await self._sql.transaction(_renew, owner, ids, self.clock() + lease_s)

    async def release(self, batch_id: str, owner: str) -> None:
        await self._sql.transaction(_changed, RELEASE, (batch_id, owner))

    # -- lines ------------------------------------------------------------------------------

    async def pending(self, batch_id: str, limit: int, skip: Collection[int] = ()) -> list[Line]:
        rows = await self._sql.read(_all, PENDING, (batch_id, json.dumps(sorted(skip)), limit))
        return [Line(idx, custom_id, json.loads(body)) for idx, custom_id, body in rows]

    async def finish_line(
        self, batch_id: str, index: int, state: str, result: dict[str, Any]
    ) -> Batch:
        return await self._sql.transaction(_finish_line, batch_id, index, state, result)

    async def finalize(self, batch_id: str, status: str, now: int) -> Batch:
        return await self._sql.transaction(_finalize, batch_id, status, now)


# The statements and transactions, each run on the store's thread.

FILE = "SELECT id, bytes, created_at, filename, purpose FROM files WHERE tenant = ? AND id = ?"
FILES = (
    "SELECT id, bytes, created_at, filename, purpose FROM files WHERE tenant = ? AND "
    "(? IS NULL OR purpose = ?) ORDER BY created_at DESC, id"
)
FILE_CONTENT = "SELECT content, batch_id, states FROM files WHERE tenant = ? AND id = ?"
DELETE_FILE = "DELETE FROM files WHERE tenant = ? AND id = ?"
CLAIMABLE = "SELECT batch_id FROM claims WHERE owner IS NULL OR owner = ? OR until < ?"
RELEASE = "UPDATE claims SET owner = NULL, until = 0 WHERE batch_id = ? AND owner = ?"
PENDING = (
    "SELECT idx, custom_id, body FROM lines WHERE batch_id = ? AND state = 'pending' "
    "AND idx NOT IN (SELECT value FROM json_each(?)) ORDER BY idx LIMIT ?"
)
_IN_STATES = "state IN (SELECT value FROM json_each(?))"
RESULTS = (
    f"SELECT idx, result FROM lines WHERE batch_id = ? AND idx > ? AND {_IN_STATES} "
    "ORDER BY idx LIMIT ?"
)
RESULTS_SIZE = (
    "SELECT COALESCE(SUM(length(CAST(result AS BLOB)) + 1), 0) FROM lines "
    f"WHERE batch_id = ? AND {_IN_STATES}"
)


def _one(db: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> Any:
    return db.execute(sql, args).fetchone()


def _all(db: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> list[Any]:
    return db.execute(sql, args).fetchall()


def _changed(db: sqlite3.Connection, sql: str, args: tuple[Any, ...]) -> int:
    return db.execute(sql, args).rowcount


def _create(db: sqlite3.Connection) -> None:
    statements(db, SCHEMA)
    columns = {row[1] for row in db.execute("PRAGMA table_xinfo(batches)")}
    if "status" not in columns:
        db.execute(f"ALTER TABLE batches ADD COLUMN {STATUS}")
    if "batch_id" not in {row[1] for row in db.execute("PRAGMA table_info(files)")}:
        for column in RESULT_COLUMNS.split(", "):
            db.execute(f"ALTER TABLE files ADD COLUMN {column}")
    db.execute(BY_STATUS)
    db.execute(CLAIMS_FOR_ACTIVE)


def _add_batch(db: sqlite3.Connection, batch: Batch, lines: list[Line]) -> None:
    seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
    db.execute(
        "INSERT INTO batches (id, tenant, seq, body) VALUES (?, ?, ?, ?)",
        (batch.id, batch.tenant, seq, batch.to_row()),
    )
    db.executemany(
        "INSERT INTO lines VALUES (?, ?, ?, ?, 'pending', NULL)",
        [(batch.id, line.index, line.custom_id, json.dumps(line.body)) for line in lines],
    )
    if batch.status in ACTIVE:
        db.execute("INSERT INTO claims (batch_id) VALUES (?)", (batch.id,))


def _batches(db: sqlite3.Connection, tenant: str, after: str | None, limit: int) -> list[Any]:
    start = None
    if after is not None:
        found = db.execute(
            "SELECT seq FROM batches WHERE tenant = ? AND id = ?", (tenant, after)
        ).fetchone()
        start = found[0] if found is not None else None
    return db.execute(
        "SELECT body FROM batches WHERE tenant = ? AND (? IS NULL OR seq < ?) "
        "ORDER BY seq DESC LIMIT ?",
        (tenant, start, start, limit),
    ).fetchall()


def _cancel(db: sqlite3.Connection, tenant: str, batch_id: str, now: int) -> Batch | None:
    batch = _batch(db, tenant, batch_id)
    if batch is not None and batch.status in CANCELLABLE:
        batch.status, batch.times["cancelling"] = "cancelling", now
        _save(db, batch)
    return batch


def _claim(
    db: sqlite3.Connection, batch_id: str, owner: str, now: float, lease_s: float
) -> Batch | None:
    taken = db.execute(
        "UPDATE claims SET owner = ?, until = ? WHERE batch_id = ? AND "
        "(owner IS NULL OR owner = ? OR until < ?)",
        (owner, now + lease_s, batch_id, owner, now),
    ).rowcount
    return _batch(db, None, batch_id) if taken else None


def _renew(db: sqlite3.Connection, owner: str, ids: str, until: float) -> dict[str, str]:
    db.execute(
        "UPDATE claims SET until = ? WHERE owner = ? AND batch_id IN "
        "(SELECT value FROM json_each(?))",
        (until, owner, ids),
    )
    rows = db.execute(
        "SELECT claims.batch_id, batches.status FROM claims "
        "JOIN batches ON batches.id = claims.batch_id WHERE claims.owner = ? AND "
        "claims.batch_id IN (SELECT value FROM json_each(?))",
        (owner, ids),
    ).fetchall()
    return dict(rows)


def _finish_line(
    db: sqlite3.Connection, batch_id: str, index: int, state: str, result: dict[str, Any]
) -> Batch:
    changed = db.execute(
        "UPDATE lines SET state = ?, result = ? WHERE batch_id = ? AND idx = ? AND "
        "state = 'pending'",
        (state, json.dumps(result), batch_id, index),
    ).rowcount
    batch = _batch(db, None, batch_id)
    assert batch is not None
    if changed:
        batch.request_counts["completed" if state == "done" else "failed"] += 1
        _save(db, batch)
    return batch


def _finalize(db: sqlite3.Connection, batch_id: str, status: str, now: int) -> Batch:
    batch = _batch(db, None, batch_id)
    assert batch is not None
    if batch.status not in ACTIVE:
        return batch
    sizes = [
        db.execute(RESULTS_SIZE, (batch_id, json.dumps(states))).fetchone()[0]
        for _, _, states in RESULT_FILES
    ]
    for file, states in result_files(batch, sizes, now):
        _insert_file(db, batch.tenant, file, b"", (batch_id, json.dumps(states)))
    finished(batch, status, now)
    _save(db, batch)
    db.execute("DELETE FROM claims WHERE batch_id = ?", (batch_id,))
    return batch


def _batch(db: sqlite3.Connection, tenant: str | None, batch_id: str) -> Batch | None:
    row = db.execute(
        "SELECT body FROM batches WHERE id = ? AND (? IS NULL OR tenant = ?)",
        (batch_id, tenant, tenant),
    ).fetchone()
    return None if row is None else Batch.from_row(row[0])


def _save(db: sqlite3.Connection, batch: Batch) -> None:
    db.execute("UPDATE batches SET body = ? WHERE id = ?", (batch.to_row(), batch.id))


def _insert_file(
    db: sqlite3.Connection,
    tenant: str,
    file: dict[str, Any],
    content: bytes,
    results: tuple[str, str] | tuple[None, None] = (None, None),
) -> None:
    db.execute(
        "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            file["id"],
            tenant,
            file["purpose"],
            file["filename"],
            file["bytes"],
            file["created_at"],
            content,
            *results,
        ),
    )
