"""What chats got against their targets, measured where the server writes their tokens.

The shells report every interactive chunk's gap (the time since the stream's previous
chunk) as a share of its request's own gap target (1.0: exactly on it), and every interactive
request that ends: its own median gap share. Written at the transport, not at the engine, a
gap includes the frontend's own time, a noisy neighbour and the real shape of the step curve:
what a person sees. A gap is a chunk's, as a client reads it, not a token's: a token whose
text waits for the next (the detokenizer holds a piece of a character) arrives with it, after
two steps, and the reader waits the two (`RequestTimeline.wrote_tokens`). The bulk controller
(`controller.py`) reads them; nothing here decides anything.

Reporting a write costs one append: the window is trimmed and sorted only when read.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from server.scheduler.slo import SloTargets

# The window of gaps the controller steers by: long enough for about a hundred gaps of a few
# chats, short enough that a step cost that changes shows within it.
WINDOW_S = 1.0
# Fewer gaps than this in the window say too little to steer by.
MIN_GAPS = 16


class Ended(NamedTuple):
    """A chat that ended: its own median gap as a share of its gap target (None: fewer than
    two tokens)."""

    median_gap_share: float | None

    @classmethod
    def of(cls, targets: SloTargets, *, median_gap_s: float | None) -> Ended:
        return cls(None if median_gap_s is None else median_gap_s / targets.itl_s)


class SloWatch(NamedTuple):
    """A request's targets, and the meter its writes are reported to (None: nobody steers by
    them: bulk, or a cap that takes no feedback)."""

    targets: SloTargets
    meter: ChatMeter | None


class ChatMeter:
    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._gaps: deque[tuple[float, float]] = deque()  # (time, share)
        # Chats that ended since the controller last took them.
        self._ended: list[Ended] = []

    @property
    def has_gaps(self) -> bool:
        return bool(self._gaps)

    def gap(self, share: float, now: float) -> None:
        """A chunk written at `now`, `share` of its gap target after the stream's previous."""
        gaps = self._gaps
        # What left the window is kept no longer than another window: trimmed a window's
        # worth at a time, not at every write (`gap_median` trims to the window itself).
        if gaps and gaps[0][0] < now - 2 * self.window_s:
            self._trim(now)
        gaps.append((now, share))

    def _trim(self, now: float) -> None:
        gaps = self._gaps
        since = now - self.window_s
        while gaps and gaps[0][0] < since:
            gaps.popleft()

    def ended(self, chat: Ended) -> None:
        """A chat ended (completed, or refused or expired for capacity)."""
        self._ended.append(chat)

    def take_ended(self) -> list[Ended]:
        """The chats that ended since the last call."""
        ended, self._ended = self._ended, []
        return ended

    def gap_median(self, now: float) -> float | None:
        """The median share of the chunks written in the last `window_s` (None: too few to
        tell)."""
        self._trim(now)
        if len(self._gaps) < MIN_GAPS:
            return None
        return sorted(share for _, share in self._gaps)[(len(self._gaps) - 1) // 2]
