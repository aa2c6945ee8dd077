"""SQLite off the event loop: a store's database on two threads of its own, one that writes and
one that reads, each with its connection.

Every call runs `fn(connection, *args)` on one of them, in the order the calls were made,
while the loop goes on serving streams. A slow disk, a full sync, or another process holding
the write lock (a writer waits up to `BUSY_TIMEOUT_S` for it) delays that store's writes,
never the loop, and never its reads: WAL lets a reader go on beside a writer, and a read
made after a write returned sees it (it was committed). `transaction` wraps `fn` in
`BEGIN IMMEDIATE` ... `COMMIT`, and rolls back on any error, so each change is one
transaction.

A caller cancelled while its call runs does not stop the call: the transaction ends as it
would have (committed or rolled back), and only the result is lost. The stores built on this
(the Batch API's, the Responses API's) make every change whole, so that is safe.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

# How long a writer waits for another process's transaction on the same database to end, for
# every store: off the loop, a long wait delays only that store's writes.
BUSY_TIMEOUT_S = 10.0

T = TypeVar("T")
Call = Callable[..., T]  # called as fn(connection, *args)


class SqliteDatabase:
    """`path`'s database in WAL mode with full syncs (an in-memory one, `":memory:"`, has one
    connection and thread for both, as it cannot be shared)."""

    def __init__(self, path: Path | str, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        name = "memory" if path == ":memory:" else Path(path).name
        self._writer = _Thread(f"sqlite-{name}-write", str(path), busy_timeout_s)
        self._reader = (
            self._writer
            if path == ":memory:"
            else _Thread(f"sqlite-{name}-read", str(path), busy_timeout_s)
        )

    @classmethod
    def under(cls, directory: Path | None, name: str, schema: str) -> SqliteDatabase:
        """A store's database: `directory/name` (the directory made if need be), or in memory
        with no directory; `schema`'s statements run in one transaction first."""
        path: Path | str = ":memory:"
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / name
        database = cls(path)
        database.transaction_now(statements, schema)
        return database

    async def read(self, fn: Call[T], *args: Any) -> T:
        """`fn(connection, *args)` on the reading thread."""
        return await self._reader.run(fn, *args)

    async def transaction(self, fn: Call[T], *args: Any) -> T:
        """`fn(connection, *args)` on the writing thread, as one transaction."""
        return await self._writer.run(_in_transaction, fn, *args)

    def transaction_now(self, fn: Call[T], *args: Any) -> T:
        """`transaction`, waited for on the caller's thread (a store's set-up, before any loop
        serves it)."""
        return self._writer.submit(_in_transaction, fn, *args).result()

    def close(self) -> None:
        """Close the connections once the calls made before have run."""
        for thread in {self._writer, self._reader}:
            thread.close()


class _Thread:
    def __init__(self, name: str, path: str, busy_timeout_s: float) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._db = self._executor.submit(_open, path, busy_timeout_s).result()

    def submit(self, fn: Call[T], *args: Any) -> Any:
        return self._executor.submit(fn, self._db, *args)

    async def run(self, fn: Call[T], *args: Any) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        self._executor.submit(self._db.close).result()
        self._executor.shutdown()


def statements(db: sqlite3.Connection, script: str) -> None:
    """Each `;`-separated statement of `script` (a schema), inside the caller's transaction
    (`executescript` would commit it first)."""
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _open(path: str, busy_timeout_s: float) -> sqlite3.Connection:
    # Made, used and closed on its thread alone (sqlite3 checks that it is).
    db = sqlite3.connect(path, timeout=busy_timeout_s, isolation_level=None)
    if path != ":memory:":
        db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db


def _in_transaction(db: sqlite3.Connection, fn: Call[T], *args: Any) -> T:
    db.execute("BEGIN IMMEDIATE")
    try:
        result = fn(db, *args)
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")
    return result
