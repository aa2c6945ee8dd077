"""What the Batch API keeps, and the one interface every place that keeps it implements.

`Batch` and `Line` are the stored objects; `BatchStore` the port: files, batches, each batch's
lines, and the claim that lets exactly one process run a batch at a time. Two stores implement
it: `SqliteBatchStore` (`server.batch_api.sqlite_store`, under the data directory, shared by
the processes of one host) and `RedisBatchStore` (`server.state.batches`, with `state.url`,
shared by every replica using that Redis).

Every change is atomic. A line is `pending` until its result is written with it; a line whose
result is already written is not written again (`finish_line` answers the batch as it is), so
a line run twice (its process died, or lost its claim, after it started) is in the output once.

A claim names its owner (one per runner) and lasts `lease_s`: the owner renews it while it
runs the batch; a process that dies stops renewing and, once the lease has passed, another
claims the batch and goes on from its pending lines. A change made elsewhere (a cancel) is in
the store, and the owner reads it when it renews.

A batch's output and error files are not written out when it ends: each is its lines' results
in some states (`RESULT_FILES`), sized then, and read from the lines a page at a time
whenever the file is read. A batch of any size ends in one short transaction, and its output
is never whole in memory.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.core.ids import new_id

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
CANCELLABLE = ("validating", "in_progress")
# The files a batch's end names (the batch's attribute, the file's name), and the states of
# the lines whose results each holds, in the lines' order.
RESULT_FILES = (
    ("output_file_id", "output", ("done",)),
    ("error_file_id", "errors", ("failed", "expired")),
)
PAGE_LINES = 256  # results read at a time, to stream a batch's file


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
    # The W3C trace context of the request that created it: its lines' spans are children of
    # its parent (OpenAI's lines carry no headers). Not part of OpenAI's object.
    traceparent: str | None = None
    tracestate: str | None = None

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
    def from_row(text: str | bytes) -> Batch:
        return Batch(**json.loads(text))


def file_object(
    file_id: str, size: int, created_at: int, filename: str, purpose: str
) -> dict[str, Any]:
    """OpenAI's file object."""
    return {
        "id": file_id,
        "object": "file",
        "bytes": size,
        "created_at": created_at,
        "filename": filename,
        "purpose": purpose,
    }


def result_files(
    batch: Batch, sizes: Sequence[int], now: int
) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """The files a batch's end names (`RESULT_FILES`, each only if not empty), as (file object,
    the states of the lines whose results it holds); `sizes` are their contents' bytes, each
    result a line. Each is named on the batch (`output_file_id`, `error_file_id`)."""
    files = []
    for (attribute, name, states), size in zip(RESULT_FILES, sizes, strict=True):
        if size:
            file = file_object(
                new_id("file"), size, now, f"{batch.id}_{name}.jsonl", "batch_output"
            )
            setattr(batch, attribute, file["id"])
            files.append((file, states))
    return files


async def one_chunk(content: bytes) -> AsyncIterator[bytes]:
    yield content


async def read_all(content: AsyncIterator[bytes]) -> bytes:
    return b"".join([chunk async for chunk in content])


def finished(batch: Batch, status: str, now: int) -> str:
    """The status a batch ends with when its runner ends it `status` at `now`: a batch
    cancelled meanwhile (elsewhere) ends cancelled. Stamps the time (and, completed, when it
    began finalizing)."""
    if batch.status == "cancelling":
        status = "cancelled"
    if status == "completed":
        batch.times["finalizing"] = now
    batch.status = status
    batch.times[status] = now
    return status


class BatchStore(Protocol):
    """See the module's docstring. `tenant` scopes files and batches: another tenant's object
    is not found, exactly as an unknown one."""

    async def close(self) -> None: ...

    # -- files ------------------------------------------------------------------------------

    async def add_file(
        self, tenant: str, purpose: str, filename: str, content: bytes
    ) -> dict[str, Any]: ...

    async def file(self, tenant: str, file_id: str) -> dict[str, Any] | None: ...

    async def files(self, tenant: str, purpose: str | None = None) -> list[dict[str, Any]]:
        """The tenant's files, newest first."""
        ...

    async def file_content(self, tenant: str, file_id: str) -> AsyncIterator[bytes] | None:
        """The file's content, in chunks (a batch's output is read a page of lines at a time,
        as it is sent); None: no such file."""
        ...

    async def delete_file(self, tenant: str, file_id: str) -> bool: ...

    # -- batches ----------------------------------------------------------------------------

    async def add_batch(self, batch: Batch, lines: list[Line]) -> None:
        """The batch and its lines, all pending; an active batch is claimable at once."""
        ...

    async def batch(self, tenant: str | None, batch_id: str) -> Batch | None: ...

    async def batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """The tenant's batches, newest first, after the one with id `after`; and whether
        there are more."""
        ...

    async def statuses(self) -> list[str]:
        """Every batch's status (the `sluice_batches` gauge)."""
        ...

    async def cancel(self, tenant: str, batch_id: str, now: int) -> Batch | None:
        """Mark a validating or in-progress batch `cancelling` (its owner stops it); any
        other is left as it is. The batch as it now is; None: not found."""
        ...

    # -- claims -----------------------------------------------------------------------------

    async def claimable(self, owner: str) -> list[str]:
        """The active batches that no live lease holds (and those `owner` holds)."""
        ...

    async def claim(self, batch_id: str, owner: str, lease_s: float) -> Batch | None:
        """Hold the batch for `lease_s`, if it is active and no other owner's lease is live:
        the batch as it is; None: another holds it, or it has ended."""
        ...

    async def renew(self, owner: str, batch_ids: Collection[str], lease_s: float) -> dict[str, str]:
        """Extend the leases `owner` still holds among `batch_ids`: each one's status (a
        batch missing was lost: another claimed it after the lease had passed)."""
        ...

    async def release(self, batch_id: str, owner: str) -> None:
        """Let the batch go at once (a process stopping), if `owner` holds it."""
        ...

    # -- lines ------------------------------------------------------------------------------

    async def pending(self, batch_id: str, limit: int, skip: Collection[int] = ()) -> list[Line]:
        """Up to `limit` pending lines, first first, leaving out the indices in `skip` (those
        running)."""
        ...

    async def finish_line(
        self, batch_id: str, index: int, state: str, result: dict[str, Any]
    ) -> Batch:
        """Write a pending line's result (`done`, `failed` or `expired`) and count it in the
        batch, together; a line already finished is left as it is. The batch as it now is."""
        ...

    async def finalize(self, batch_id: str, status: str, now: int) -> Batch:
        """End an active batch `status` (see `finished`), name its output and error files
        (`result_files`), and drop its claim, together. A batch that has already ended is left
        as it is. The batch as it now is."""
        ...
