"""Values every part of the scheduler speaks in."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from engine_adapters.protocol import GenerationRequest, TokenDelta


class TrafficClass(StrEnum):
    INTERACTIVE = "interactive"
    BULK = "bulk"


@dataclass(slots=True)
class Ticket:
    """An admitted request as the scheduler sees it. Times are seconds on the shell's clock."""

    request_id: str
    tenant: str
    traffic_class: TrafficClass
    model: str
    arrival: float
    deadline: float
    prompt_tokens: int
    max_tokens: int
    open_ended: bool = False  # the client set no max_tokens: it may run to the context's end

    @property
    def reserved_tokens(self) -> int:
        """Tokens held in the budget while running: the prompt plus every token it may emit."""
        return self.prompt_tokens + self.max_tokens


class Generation(Protocol):
    """A dispatched request's output stream, as the route consumes it."""

    @property
    def dispatched_at(self) -> float:
        """When the request left Sluice's queue for the engine (shell clock, seconds)."""
        ...

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...


class Dispatcher(Protocol):
    """What routes call: the scheduler shell in front of the engine (continuous or batch).

    `generation(ticket, request)` is an async context manager. Entering it admits the ticket
    and waits in the queue until dispatch; it raises a `server.errors.SluiceError` at once for
    a refusal (Overloaded, TenantQuotaExceeded, DeadlineUnmeetable) and DeadlineExceeded if the
    deadline passes while queued. Cancelling the waiting task removes the ticket from the
    queue without touching the engine. Inside, iterate the Generation for token deltas; a
    deadline passing while running aborts the engine request and raises DeadlineExceeded.
    Leaving the block, by any path, releases every budget the ticket held.
    """

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generation(
        self, ticket: Ticket, request: GenerationRequest
    ) -> AbstractAsyncContextManager[Generation]: ...
