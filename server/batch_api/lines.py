"""What a batch's lines run, by the batch's endpoint, and which of them may start together.

A `LineEndpoint` checks a line's body when the batch is made, says which lines must run one
after another (`key`: a Responses line's conversation), and starts one: a `LineRun`, read to
its end for the line's body or the error that ended it. The Batch API runs chat and
completions lines itself (`GENERATION_LINES`); the Responses API, above this package, hands
the runner its own.

`Turns` decides, without asyncio or a clock of its own, which pending lines start: lines that
share a key run one at a time, in the file's order, and a key refused for now (another holds
its conversation) waits until its time, while the batch's other lines go on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.batch_api.store import Line
from server.core.errors import InvalidRequest, SluiceError
from server.generations.log import Kind
from server.generations.planner import RequestContext
from server.generations.reading import reader
from server.generations.run import GenerationRun
from server.generations.service import Generations
from server.generations.timeline import RequestTimeline
from server.observability.access_log import Api
from server.openai_wire.requests import parse_request


class LineRun(Protocol):
    """A line's generation, started."""

    @property
    def run(self) -> GenerationRun: ...

    async def outcome(self) -> dict[str, Any] | SluiceError:
        """Read to its end: the line's body (status 200), or the error that ended it."""
        ...


class LineEndpoint(Protocol):
    """How a batch's endpoint runs its lines. `api`: its lines' timelines are of this API."""

    @property
    def api(self) -> Api: ...

    def check(self, body: dict[str, Any]) -> None:
        """Raise the SluiceError of a body that cannot run (the batch fails at once)."""
        ...

    def key(self, body: dict[str, Any]) -> str | None:
        """Lines of one key run one after another, in the file's order (None: any time)."""
        ...

    async def start(
        self, body: dict[str, Any], timeline: RequestTimeline, context: RequestContext
    ) -> LineRun:
        """The line's generation admitted and started; raises a SluiceError if refused."""
        ...


def no_stream(names: Iterable[str], body: Any) -> None:
    """A batch line is answered whole, in the output file: one that asks to be streamed, or
    run in the background, cannot run (OpenAI's batch refuses both)."""
    for name in names:
        if getattr(body, name, None):
            raise InvalidRequest(f"a batch request cannot use '{name}'", param=name)


@dataclass(frozen=True, slots=True)
class WholeRun:
    """A chat's or completion's run, answered whole."""

    run: GenerationRun

    async def outcome(self) -> dict[str, Any] | SluiceError:
        async with reader(self.run, "ended"):
            last = self.run.log[-1]
        if last.kind is Kind.WHOLE and last.body is not None:
            return last.body
        assert last.error is not None
        return last.error


@dataclass(frozen=True, slots=True)
class GenerationLines:
    """Chat completions' or completions' lines (`kind`: the request parser's)."""

    generations: Generations
    kind: str
    api: Api

    def check(self, body: dict[str, Any]) -> None:
        no_stream(("stream",), parse_request(body, self.kind))

    def key(self, body: dict[str, Any]) -> str | None:
        return None

    async def start(
        self, body: dict[str, Any], timeline: RequestTimeline, context: RequestContext
    ) -> LineRun:
        parsed = parse_request(body, self.kind)
        run, _ = await self.generations.generate(
            parsed, body, timeline, context, None, stream=False
        )
        return WholeRun(run)


def generation_lines(generations: Generations) -> dict[str, LineEndpoint]:
    """The endpoints whose lines the Batch API runs itself, by path."""
    return {
        "/v1/chat/completions": GenerationLines(generations, "chat", "chat"),
        "/v1/completions": GenerationLines(generations, "completion", "completions"),
    }


@dataclass(slots=True)
class Turns:
    """See the module's docstring: the keys of running lines, and of those refused for now,
    with the time each may be offered again."""

    running: set[str] = field(default_factory=set)
    not_before: dict[str, float] = field(default_factory=dict)

    def startable(
        self, lines: Iterable[tuple[Line, str | None]], now: float, seats: int
    ) -> list[tuple[Line, str | None]]:
        """Of the pending `lines` (first first, with their keys), those to start now, at most
        `seats`: each key's first line, where the key is neither running nor waiting."""
        chosen: list[tuple[Line, str | None]] = []
        seen: set[str] = set()
        for line, key in lines:
            if len(chosen) == seats:
                break
            if key is not None:
                if key in seen or key in self.running or self.not_before.get(key, now) > now:
                    seen.add(key)
                    continue
                seen.add(key)
            chosen.append((line, key))
        return chosen

    def started(self, key: str | None) -> None:
        if key is not None:
            self.running.add(key)
            self.not_before.pop(key, None)

    def ended(self, key: str | None, retry_at: float | None = None) -> None:
        """The line of `key` ended; `retry_at`: it was refused for now, and its key waits
        until then."""
        if key is None:
            return
        self.running.discard(key)
        if retry_at is not None:
            self.not_before[key] = retry_at

    def next_time(self, now: float) -> float | None:
        """When a waiting key may be offered again (None: none waits)."""
        for key in [key for key, at in self.not_before.items() if at <= now]:
            del self.not_before[key]
        return min(self.not_before.values(), default=None)
