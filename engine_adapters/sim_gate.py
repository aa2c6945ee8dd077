"""`StepGate`: when the `sim` engine's next step may begin (`SimEngine.gate`)."""

from __future__ import annotations

import asyncio

__all__ = ["StepGate"]


class StepGate:
    """A hand on the sim engine's progress, for a test or a demo that needs its events in an
    order rather than at a pace: "the first response still runs when the second arrives" held
    by the gate, not by the seconds a long answer takes.

    Open (the default), steps run at the model's pace. `hold()`: no step begins, until
    `step(n)` lets n more begin, then holds again, or `open()` lets them all; steps let
    through by `step` or by `open(paced=False)` run at once (their time is not waited: what
    they stand for is the order, not the time). While held, requests still arrive, queue in
    the model and are aborted, and the step under way ends and delivers its tokens.

    Methods of the engine's event loop (another thread calls them through the loop, e.g.
    `loop.call_soon_threadsafe`). Unused, it costs the engine's loop a test and a call a step,
    nothing a token.
    """

    __slots__ = ("_credit", "_moved", "_paced")

    def __init__(self) -> None:
        self._credit: int | None = None  # steps that may begin before it holds (None: any)
        self._paced = True
        self._moved = asyncio.Event()  # a step may begin again

    @property
    def held(self) -> bool:
        """Whether no step may begin now."""
        return self._credit == 0

    def hold(self) -> None:
        """No step begins until `step` or `open`."""
        self._credit = 0

    def step(self, count: int = 1) -> None:
        """Let `count` more steps begin, each at once, then hold."""
        if count < 1:
            raise ValueError("count must be >= 1")
        self._credit = (self._credit or 0) + count
        self._moved.set()

    def open(self, *, paced: bool = True) -> None:
        """Let every step begin: at the model's pace, or back to back (`paced=False`)."""
        self._credit = None
        self._paced = paced
        self._moved.set()

    async def opened(self) -> None:
        """Return once a step may begin (at once when one may)."""
        while self._credit == 0:
            self._moved.clear()
            await self._moved.wait()

    def begin(self) -> bool:
        """A step begins (the engine's loop says so); whether its time is to be waited."""
        credit = self._credit
        if credit is None:
            return self._paced
        self._credit = credit - 1
        return False
