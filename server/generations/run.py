"""One generation's life: admit → dispatch → engine deltas → an event log → end.

A `GenerationRun` owns the lifecycle in one task of its own. What the engine produces becomes
numbered events (1, 2, 3, …) in the run's log; responses are readers of that log from an
offset: an SSE stream writes each event's rendered bytes under `id: N`, a WebSocket renders
the same events as messages carrying `seq: N`, and a whole JSON response waits for the one
event that carries its body. A reader that leaves does not end the run by itself: the run is
cancelled when its last reader leaves (at once, or after a grace period for a resumable run).

Every run ends exactly once, with its timeline finished and its terminal event logged, however
it ends: completed, refused or expired in the queue, failed, or cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from engine_adapters.protocol import (
    EngineDeadError,
    EngineError,
    EngineRequestError,
    EngineUnsupported,
)
from server.core.errors import (
    EngineUnavailable,
    GenerationCancelled,
    GenerationFailed,
    InvalidRequest,
    SluiceError,
    StateUnavailable,
    UnsupportedParameter,
)
from server.generations.assembler import StreamAssembler
from server.generations.log import Event, EventLog, Kind
from server.generations.ports import LogFollower, LogMirror
from server.generations.shape import Shape, StreamEncoder
from server.generations.timeline import RequestTimeline
from server.scheduler.types import Admission, Generation

logger = logging.getLogger("sluice.server")


def engine_failure(exc: EngineError) -> SluiceError:
    """An engine's error as the client's: what it cannot do or refuses is a 400."""
    if isinstance(exc, EngineDeadError):
        return EngineUnavailable(
            "the engine stopped while generating; retry shortly", retry_after=5
        )
    if isinstance(exc, EngineUnsupported):
        return UnsupportedParameter(str(exc), param=exc.param)
    if isinstance(exc, EngineRequestError):
        return InvalidRequest(str(exc), param=exc.param)
    return GenerationFailed(f"generation failed: {exc}")


# (number of the last, events, whether they end the run: the response may end with them)
Deliver = Callable[[int, list[Event], bool], Awaitable[None]]


class _Writer:
    """A run's one reader that is handed the run's events where they are logged (`written`).
    One `flush` delivers at a time; another, asked meanwhile, leaves the events to it."""

    def __init__(self, log: EventLog, deliver: Deliver) -> None:
        self.log = log
        self.deliver = deliver
        self.after = 0  # the last event delivered
        self.busy = False

    async def flush(self, *, ending: bool = False) -> None:
        """Deliver every event logged and not yet delivered, a batch at a time (`ending`: the
        log is closed, and its last batch is the run's last)."""
        if self.busy:
            return
        self.busy = True
        try:
            while batch := self.log.take(self.after):
                self.after += len(batch)
                await self.deliver(self.after, batch, ending and self.after == len(self.log))
        finally:
            self.busy = False


class GenerationRun:
    """A generation and its event log. `start()` it once; read it as one reader
    (`server.generations.reading.reader`, which every API's reply uses) + `events(after)` /
    `log.batches(after)`; `cancel(error)` it from anywhere. Its events are typed (`Event`);
    those of a run whose readers speak the wire its shape names also carry their bytes,
    rendered once by the wire's encoder (`server.generations.shape`).

    Shared by replicas (the ports in `server.generations.ports`), a run either writes its
    log to the shared state as it goes (`mirror`: its readers see what is written), or
    follows another replica's (`follow`) and, if that replica dies, continues it here
    (`takeover` makes the admission that does).
    """

    def __init__(
        self,
        shape: Shape,
        timeline: RequestTimeline,
        admission: Admission[Any] | None,
        *,
        resumable: bool = False,
        grace_seconds: float = 30.0,
        on_end: Callable[[GenerationRun], None] | None = None,
        mirror: LogMirror | None = None,
        follow: LogFollower | None = None,
        takeover: Callable[[GenerationRun], Admission[Any]] | None = None,
    ) -> None:
        self.shape = shape
        self.timeline = timeline
        self.resumable = resumable
        self.grace_seconds = grace_seconds
        # Nobody can come back for a run that is not resumable: its log holds only what its
        # one reader has not taken.
        self.log = EventLog(stream=shape.stream, keep=resumable)
        # A stream's, once it is dispatched here (`Unrendered`: its readers render their own).
        self.encoder: StreamEncoder | None = None
        self._admission: Admission[Any] | None = admission
        self._on_end = on_end
        self._mirror = mirror
        self._follow = follow
        self._takeover = takeover
        self._checking: asyncio.Task[None] | None = None  # for a reader on another replica
        self._task: asyncio.Task[None] | None = None
        self._running = False  # the task's coroutine has begun
        self._cancel_with: SluiceError | None = None
        self._handed_over = False
        self._readers = 0
        self._grace: asyncio.TimerHandle | None = None
        self._writer: _Writer | None = None  # a reader writing in this run's task (`written`)

    # -- the producer ---------------------------------------------------------------------

    def start(self) -> None:
        assert self._task is None, "a run starts once"
        self._task = asyncio.get_running_loop().create_task(self._produce())
        if self._mirror is not None:
            self._mirror.start(self.log, self.cancel)

    @property
    def dispatched(self) -> bool:
        """Whether the generation reached the engine (here, or on the replica it follows)."""
        return self.log.dispatched

    @property
    def ended(self) -> bool:
        """Whether the run is over: its last event logged, what it held released."""
        return self.log.closed

    @property
    def size(self) -> int:
        """Bytes its log holds, roughly."""
        return self.log.size

    @property
    def shared(self) -> bool:
        """Whether its log is shared with other replicas (written there, or read from)."""
        return self._mirror is not None or self._follow is not None

    def cancel(self, error: SluiceError, *, hand_over: bool = False) -> None:
        """End the run with `error` (a no-op once it has ended): out of the queue, or the
        engine request aborted. `hand_over` (a shared run, on a replica that stops): the error
        ends this replica's readers only; the generation is left for another replica to take
        over at once."""
        if self.log.concluded or self._cancel_with is not None:
            return
        self._cancel_with = error
        self._handed_over = hand_over and self.shared
        if self._running and self._task is not None:
            self._task.cancel()
        # Not begun yet: the coroutine sees `_cancel_with` first thing (cancelling a task
        # before it runs would skip its code, and with it the run's end).

    async def _produce(self) -> None:
        self._running = True
        admission = self._admission
        try:
            if self._cancel_with is not None:  # cancelled before it began
                raise asyncio.CancelledError
            if self._follow is not None:
                try:
                    continuing = await self._follow.into(self.log, self._has_readers)
                except StateUnavailable:  # its log cannot be read: this replica's end alone
                    self._handed_over = True
                    raise EngineUnavailable(
                        "the shared state stopped answering; resume the generation again shortly",
                        retry_after=1,
                    ) from None
                if not continuing:
                    return  # its log concluded on the replica that ran it
                # Ours now: what happens next is written to the shared log, a refusal of the
                # takeover too (it ends the generation for every replica, and the lease).
                self._mirror = self._follow.mirror(len(self.log))
                self._mirror.start(self.log, self.cancel)
                assert self._takeover is not None
                admission = self._admission = self._takeover(self)
            assert admission is not None
            async with admission as generation:
                self.timeline.dispatched(generation)
                self.log.mark_dispatched()
                try:
                    if self.shape.stream:
                        await self._stream(generation)
                    else:
                        await self._whole(generation)
                except EngineError as exc:
                    raise engine_failure(exc) from None
        except SluiceError as error:
            self._fail(error)
        except asyncio.CancelledError:  # `cancel`; or the SendGuard, while it writes (`written`)
            self._fail(self._cancel_with or GenerationCancelled("the generation was cancelled"))
        except Exception:
            logger.exception("generation %s failed", self.timeline.request_id)
            self._fail(GenerationFailed("the generation failed"))
        finally:
            # Concluded: `cancel` no longer interrupts, so this await runs to its end.
            if admission is not None:
                await admission.leave()  # idempotent; releases what was never entered
            self._admission = None
            self._end()

    async def _stream(self, generation: Generation) -> None:
        """The loop: each engine delta through the assembler into the log, and the log
        written to a reader that writes in this task (`written`) after each."""
        timeline, log = self.timeline, self.log
        assembler = StreamAssembler(
            self.shape, timeline.prompt_tokens, log.append, lambda: timeline.cached_tokens
        )
        timeline.chunk_tokens = self.shape.stream_interval
        self.encoder = assembler.encoder
        if log:  # taken over: the earlier replica's events are the stream's beginning
            assembler.resume(log)
            timeline.generated_tokens = assembler.generated
        else:
            assembler.begin()
        add = assembler.add
        async for delta in generation:
            count = add(delta)
            if count:
                timeline.wrote_tokens(count)
            if self._writer is not None:
                await self._writer.flush()
        assembler.end(timeline.timings(), timeline.cached_tokens or 0)
        timeline.finish("completed")
        log.append(Event(Kind.DONE, self.shape.wire.done))

    async def _whole(self, generation: Generation) -> None:
        shape, timeline = self.shape, self.timeline
        choices = shape.choices(keep=True)
        async for delta in generation:
            timeline.wrote_tokens(len(delta.token_ids))
            choices.add(delta)
        choices.check_all_finished()
        body = shape.wire.whole(
            shape,
            choices,
            timeline.prompt_tokens,
            timeline.generated_tokens,
            timeline.cached_tokens or 0,
            timeline.timings(),
        )
        timeline.finish("completed")
        self.log.append(Event(Kind.WHOLE, body=body))

    def _fail(self, error: SluiceError) -> None:
        """Log the error that ends the run (kept without its traceback, which would hold the
        producer's frame and, through it, the run)."""
        if self.log.concluded:
            return
        error.__traceback__ = error.__cause__ = error.__context__ = None
        self.timeline.fail(error)
        local, wire = self._handed_over, self.shape.wire
        self.log.append(Event(Kind.FAILED, wire.error(error.to_body()), error=error, local=local))
        if self.shape.stream:
            self.log.append(Event(Kind.DONE, wire.done, local=local))

    def _end(self) -> None:
        if self.ended:
            return
        if not self.log.concluded:  # (a path above that did not log its end: a bug)
            self._fail(GenerationFailed("the generation ended without a result"))
        self.timeline.finish("completed")  # (a followed run's, which records nothing)
        self._task = None
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None
        self.log.close()
        if self._on_end is not None:
            self._on_end(self)

    # -- readers ----------------------------------------------------------------------------

    @property
    def writable(self) -> bool:
        """Whether its reader may write it in the run's own task (`written`): a stream that
        nobody can resume or follow, read on this replica alone."""
        return self.shape.stream and not self.resumable and not self.shared

    async def written(self, deliver: Deliver) -> None:
        """Read the run to its end by delivering (`deliver`: a batch and the number of its
        last event, to write it) what it logs as it logs it, in the run's own task: no other
        task is woken per token to write it. This reader's task delivers what was logged
        before and what the run logs as it ends. A client slower than the engine holds the
        run in `deliver`, and the engine's next delta brings every token made meanwhile (as
        vLLM's output collector does): the backlog waits in the engine, not in the log."""
        assert self.writable and self._writer is None
        writer = self._writer = _Writer(self.log, deliver)
        try:
            await writer.flush()
            await self.log.closing()
            await writer.flush(ending=True)
        finally:
            self._writer = None

    def attach(self) -> None:
        """A reader begins (each `attach` is matched by one `detach`)."""
        self._readers += 1
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def detach(self) -> None:
        """A reader left. When the last one leaves a running run, it is cancelled: at once, or
        for a resumable run after `grace_seconds` without a reader (here or, for a mirrored
        run, on another replica)."""
        self._readers -= 1
        if self._readers or self.ended:
            return
        if self.resumable:
            self._grace = asyncio.get_running_loop().call_later(self.grace_seconds, self._unread)
        else:
            self.cancel(GenerationCancelled("the client left"))

    def _has_readers(self) -> bool:
        return self._readers > 0

    def _unread(self) -> None:
        self._grace = None
        if self._mirror is None:
            self.cancel(self._abandoned())
        elif self._checking is None:
            self._checking = asyncio.get_running_loop().create_task(self._read_elsewhere())

    async def _read_elsewhere(self) -> None:
        """Cancel the run unless a replica following it has a reader. A question the shared
        state did not answer ends nothing: it is asked again after another grace period (a
        busy host's slow round trip once cancelled a generation read on another replica)."""
        assert self._mirror is not None
        try:
            read = await self._mirror.read_elsewhere()
        finally:
            self._checking = None
        if self._readers or self.ended:
            return
        if read is not False:
            self._grace = asyncio.get_running_loop().call_later(self.grace_seconds, self._unread)
        else:
            self.cancel(self._abandoned())

    def _abandoned(self) -> GenerationCancelled:
        return GenerationCancelled(f"no client read the generation for {self.grace_seconds:g} s")

    @contextmanager
    def reading(self) -> Iterator[None]:
        """A reader while the block runs (`server.generations.reading.reader`: one that
        waits for the run's dispatch or end)."""
        self.attach()
        try:
            yield
        finally:
            self.detach()

    async def started(self) -> None:
        """Until the run is dispatched to the engine, or has ended."""
        while not (self.log.dispatched or self.log.closed):
            await self.log.changed()

    async def until_ended(self) -> Event:
        """The run's last event, once it has ended (and readers may see it)."""
        return await self.log.until_closed()

    def events(self, after: int = 0) -> AsyncIterator[tuple[int, Event]]:
        """(number, event) for every event after number `after`, live, to the end."""
        return self.log.events(after)

    @property
    def failure(self) -> SluiceError | None:
        """The error that ended the run before it was dispatched (a refusal, an expiry)."""
        if self.ended and not self.dispatched:
            return self.log[0].error if self.log else None
        return None
