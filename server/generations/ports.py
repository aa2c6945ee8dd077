"""What resumable generations and stored responses need of the state replicas share, declared
here and implemented elsewhere (`server.state.runs`, `server.state.responses`, on Redis): the
composition root hands an implementation in, and nothing in `server.generations` knows which.

A generation made with an idempotency key is recorded (`SharedRuns.open`) so that any replica
finds it (`find`). The replica that runs it writes its log there ahead of its readers (a
`LogMirror`); any other replica reads that log into a local run (a `LogFollower`) and, if
the running replica dies, claims the generation and continues it. Every call may raise
`StateUnavailable`: each caller says what it does without the shared state.

An ended response of the Responses API is kept in a `ResponseStore`: Redis's, which any
replica reads, or SQLite's on the host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from server.core.errors import SluiceError
from server.generations.log import EventLog


@dataclass(frozen=True, slots=True)
class RunRecord:
    """A resumable generation as any replica finds it: enough to follow it or continue it."""

    tenant: str
    public_id: str
    kind: str  # "chat" | "completion"
    request: Any  # the body `parse_request` reads
    stream: bool
    request_id: str
    created: int  # its chunks' `created`
    traffic_class: str | None = None  # what the client asked for
    timeout_s: float | None = None
    key: str | None = None
    fingerprint: str = ""  # of the request made under `key`


class LogMirror(Protocol):
    """Writes a run's log to the shared state as it grows, and shows the log's readers only
    what is written (`EventLog.durable`)."""

    def start(self, log: EventLog, cancel: Callable[[SluiceError], None]) -> None:
        """Mirror `log` until it concludes; `cancel` ends the run (another replica took the
        generation over)."""
        ...

    async def read_elsewhere(self) -> bool | None:
        """Whether a replica following the run has a reader; None when the shared state
        cannot tell (it did not answer in time)."""
        ...


class LogFollower(Protocol):
    """Reads another replica's generation into a local log, and claims the generation when
    that replica is gone."""

    async def into(self, log: EventLog, reading: Callable[[], bool]) -> bool:
        """Follow the shared log into `log` (`reading`: whether the run has a reader here):
        False once the log concluded; True when the generation is now this replica's to
        continue, `log` holding every event the shared log had."""
        ...

    def mirror(self, written: int) -> LogMirror:
        """The mirror that continues the shared log past its first `written` events."""
        ...


class SharedRuns(Protocol):
    """Resumable generations shared by replicas: their idempotency keys and their logs."""

    @property
    def up(self) -> bool:
        """Whether the shared state answers (if not, new generations are this replica's)."""
        ...

    async def open(self, record: RunRecord, key: str, fingerprint: str) -> tuple[str, str] | None:
        """Record a new generation under `key`, run by this replica. None: made; else (the
        id, the fingerprint) of the generation already made under the key."""
        ...

    async def record(self, record: RunRecord) -> None:
        """Record a new generation made without a key (a background response's), run by this
        replica."""
        ...

    async def forget(self, record: RunRecord) -> None:
        """Drop a generation recorded by `open` or `record` that was refused before it
        began."""
        ...

    async def find(self, tenant: str, public_id: str) -> RunRecord | None: ...

    def mirror(self, record: RunRecord) -> LogMirror:
        """A mirror for the run of a generation this replica just recorded."""
        ...

    def follow(self, record: RunRecord) -> LogFollower: ...


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """An ended response of the Responses API, kept for its tenant: `body` is its JSON (which
    only `server.responses_api` reads), `ended_at` wall-clock seconds (it outlives a
    process, and is compared across replicas)."""

    tenant: str
    response_id: str
    body: bytes
    ended_at: float

    @property
    def size(self) -> int:
        return len(self.body)


class ResponseStore(Protocol):
    """Ended responses, each kept for its tenant from its end for a retention, within a bound
    in bytes for each tenant's together (past it, the oldest go first): what
    `server.generations.registry.evictions` drops. Implemented in SQLite, on the host
    (`server.responses_api.store`), and in Redis, shared by replicas (`server.state.responses`);
    Redis's calls may raise `StateUnavailable`."""

    async def put(self, response: StoredResponse) -> None:
        """Keep `response` (replacing one with its id), and drop what is past the bounds."""
        ...

    async def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        """The tenant's response with this id (None: unknown, dropped, or another tenant's)."""
        ...
