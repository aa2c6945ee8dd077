"""Values every part of the scheduler speaks in."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final, Generic, Protocol, TypeVar

from engine_adapters.protocol import GenerationRequest, TokenDelta
from server.core.config import TrafficClass as TrafficClass  # declared with the configuration

if TYPE_CHECKING:
    from server.scheduler.attainment import SloWatch

# The classes, bound once: in Python 3.11 reading a member off an enum class goes through its
# metaclass's attribute hook (about 60 ns, a call's worth), and the core reads them in every
# decision.
INTERACTIVE: Final = TrafficClass.INTERACTIVE
BULK: Final = TrafficClass.BULK


class RejectReason(StrEnum):
    """Why a scheduler refused a ticket at admission. The shells answer each with its error
    class (`server/scheduler/refusals.py`); the simulators report it as is."""

    OVERLOADED = "overloaded"  # its queue is full
    TENANT_QUOTA_EXCEEDED = "tenant_quota_exceeded"
    DEADLINE_UNMEETABLE = "deadline_unmeetable"
    REQUEST_TOO_LARGE = "request_too_large"  # it could never fit the budgets
    NO_COMPATIBLE_WORKER = "no_compatible_worker"
    DUPLICATE_ID = "duplicate_id"


class PreemptCause(StrEnum):
    """Why the scheduler named a running bulk request to stop (it resumes where it was)."""

    CHATS_FAR_OVER = "chats_far_over"  # bulk over its cap, chats measured far over their target
    STEP_OVER_TARGET = "step_over_target"  # bulk over its cap, the model's step far over it
    CHAT_BURST = "chat_burst"  # bulk over its cap, more chats than usually run together
    WAITING_CHAT = "waiting_chat"  # a chat waited its threshold with no budget room
    ADAPTER_SLOT = "adapter_slot"  # a chat on an adapter waits for a slot bulk holds


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
    # A preempted request's continuation: the last `resumed_tokens` prompt tokens are its own
    # earlier output (an engine with prefix caching holds all but the last partial block).
    resumed_tokens: int = 0
    preemptible: bool = True  # False: never stopped to make room (it could not resume as is)
    n: int = 1  # choices: sequences the engine runs for it, each up to max_tokens
    adapter: str | None = None  # the LoRA adapter it runs on (None: the base model)
    # Tokens held in the budget while running: the prompt plus every token it may emit. Kept,
    # not a property: the budgets, the queues and the quotas read it several times a request.
    reserved_tokens: int = field(init=False)
    # Its line in its class's queue: its tenant's requests on its model take turns with the
    # other lines (`queues.py`), so tenants, and one tenant's adapters, share fairly.
    flow: tuple[str, str | None] = field(init=False)

    def __post_init__(self) -> None:
        self.reserved_tokens = self.prompt_tokens + self.n * self.max_tokens
        self.flow = (self.tenant, self.adapter)

    def continued(self, generated: int) -> Ticket:
        """The ticket that continues this one after it generated `generated` tokens."""
        return replace(
            self,
            prompt_tokens=self.prompt_tokens + generated,
            max_tokens=self.max_tokens - generated,
            resumed_tokens=self.resumed_tokens + generated,
        )


class Generation(Protocol):
    """A dispatched request's output stream, as the route consumes it."""

    @property
    def dispatched_at(self) -> float:
        """When the request left Sluice's queue for the engine (shell clock, seconds)."""
        ...

    @property
    def preemptions(self) -> int:
        """Times the scheduler stopped it to make room for a chat, then resumed it."""
        ...

    @property
    def pauses(self) -> Sequence[tuple[float, float | None]]:
        """Each time the scheduler stopped it: (when, when it was dispatched again; None: not
        yet), on the shell's clock, in order."""
        ...

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the engine found in its prefix cache (None: it did not say)."""
        ...

    @property
    def finish_reasons(self) -> Sequence[str]:
        """The engine's finish reason of each choice that finished ("stop", "length"...), in
        the order they finished."""
        ...

    def __aiter__(self) -> AsyncIterator[TokenDelta]: ...


G = TypeVar("G", bound=Generation)


class Admission(Generic[G]):
    """A ticket the scheduler accepted: entering waits for its dispatch, leaving releases it.

    Leaving works whether or not the admission was entered, and only once; if entering fails
    or is cancelled (the client left while queued), the admission leaves by itself.
    """

    def __init__(
        self, enter: Callable[[], Awaitable[G]], leave: Callable[[G | None], Awaitable[None]]
    ) -> None:
        self._enter: Callable[[], Awaitable[G]] | None = enter
        self._leave = leave
        self._generation: G | None = None
        self._left = False

    async def __aenter__(self) -> G:
        enter, self._enter = self._enter, None  # once; it may hold the failed dispatch waiter
        if enter is None:
            raise RuntimeError("an admission can be entered once")
        try:
            self._generation = await enter()
        except BaseException:
            del enter  # its waiter keeps the error, whose traceback holds this frame
            await self.leave()
            raise
        return self._generation

    async def __aexit__(self, *exc_info: object) -> None:
        await self.leave()

    async def leave(self) -> None:
        if not self._left:
            self._left = True
            await self._leave(self._generation)


class Dispatcher(Protocol):
    """What routes call: the scheduler shell in front of the engine (continuous or batch).

    `generation(ticket, request)` submits the ticket at once: it raises a
    `server.core.errors.SluiceError` for a refusal (Overloaded, TenantQuotaExceeded,
    DeadlineUnmeetable) before anything awaits, so refusals cost one pass of the route. It
    returns an Admission, which the caller must enter or leave. Entering waits in the queue
    until dispatch, raising DeadlineExceeded if the deadline passes while queued; cancelling
    the waiting task removes the ticket from the queue without touching the engine. Inside,
    iterate the Generation for token deltas; a deadline passing while running aborts the
    engine request and raises DeadlineExceeded. Leaving, by any path, releases every budget
    the ticket held.
    """

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generation(self, ticket: Ticket, request: GenerationRequest) -> Admission[Any]: ...

    def slo(self, ticket: Ticket) -> SloWatch | None:
        """The latency targets `ticket` is judged by now, and where the times its tokens are
        written go (None: no targets)."""
        ...

    def queued(self) -> int:
        """Requests admitted and waiting in its queues, not dispatched yet (a preempted one
        waiting to resume too)."""
        ...

    def adapter_loaded(self, name: str) -> None:
        """The engine serves the LoRA adapter `name` from now on, loaded at runtime (the
        continuous scheduler times it, to judge its chats by it)."""
        ...
