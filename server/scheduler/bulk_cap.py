"""How many bulk sequences may run: few enough that chats keep their pace, as many as pay.

One engine step serves every running sequence, so a chat's tokens arrive once per step, and a
step over 96 sequences takes many times as long as a step over one. While interactive requests
run or wait, bulk is capped so that the predicted step time stays within the interactive gap
target: the most sequences whose step fits it (`StepTimes.within`), less the chats. When no chat
has been about for `bulk_hold_s`, bulk may grow to the knee, the fewest sequences that reach
`knee_share` of the best tokens/s seen, but not so far that one step would leave a chat that
arrives in the middle of it less than its TTFT target. Bulk keeps `bulk_min_share` of that idle
cap whatever the chats need, so it is never starved.

The targets themselves are relative to the engine when nearly idle: the step time over one
sequence and the time to first token of a request that found the engine (nearly) empty, both
measured at start-up and refined online. A setting in milliseconds overrides either.
"""

from __future__ import annotations

import math

from server.config import SloConfig
from server.scheduler.estimates import RateEstimates
from server.scheduler.types import SloTargets

# The prompt of a typical chat, to guess the idle time to first token before one is observed.
TYPICAL_CHAT_PROMPT_TOKENS = 64


class BulkCap:
    def __init__(
        self, config: SloConfig, estimates: RateEstimates, *, limit: int, min_share: float
    ) -> None:
        self._config = config
        self._estimates = estimates
        self._limit = limit  # bulk's share of the sequence budget
        self._min_share = min_share

    def targets(self) -> SloTargets:
        config, estimates = self._config, self._estimates
        itl = config.itl_s
        if itl is None:
            itl = config.itl_factor * estimates.steps.at(1.0)
        ttft = config.ttft_s
        if ttft is None:
            ttft = config.ttft_factor * self.idle_ttft()
        return SloTargets(ttft_s=ttft, itl_s=itl)

    def idle_ttft(self) -> float:
        """Time to first token on a nearly idle engine, as observed (or guessed until then)."""
        estimates = self._estimates
        if estimates.idle_ttft_s is not None:
            return estimates.idle_ttft_s
        return (estimates.steps.at(1.0)
                + TYPICAL_CHAT_PROMPT_TOKENS / estimates.prefill_tokens_per_s)

    def knee(self) -> int:
        """The fewest sequences past which more add little throughput (the budget's limit
        until the engine has been observed)."""
        knee = self._estimates.steps.knee(self._config.knee_share)
        return self._limit if knee is None else self._clamp(knee)

    def idle(self) -> int:
        """Bulk sequences allowed while no chat is about: the knee, unless one step there would
        outlast what a chat's TTFT target leaves beyond the idle time to first token."""
        if not self._config.cap_bulk:
            return self._limit
        headroom = self.targets().ttft_s - self.idle_ttft()
        within_ttft = self._clamp(self._estimates.steps.within(headroom))
        return max(1, min(self.knee(), within_ttft))

    def floor(self) -> int:
        """What bulk keeps however many chats run: its minimum share of the idle cap."""
        share = self._min_share * self.idle()
        return max(1, math.floor(share)) if share > 0 else 0

    def with_chats(self, chats: int) -> int:
        """Bulk sequences allowed while `chats` interactive requests run or wait."""
        if not self._config.cap_bulk:
            return self._limit
        within_itl = self._estimates.steps.within(self.targets().itl_s) - chats
        return max(self.floor(), min(self.idle(), self._clamp(within_itl)))

    def _clamp(self, sequences: float) -> int:
        if sequences >= self._limit:
            return self._limit
        return max(0, math.floor(sequences))


class PrefillPacer:
    """How much bulk prefill may enter the engine per step: a bucket of engine seconds that
    holds one step's headroom (what the target leaves beyond the decode step) and refills once
    per step. A start that needs more than the whole headroom goes when the bucket is full,
    alone, so bulk always gets at least one start per step."""

    MIN_HEADROOM_SHARE = 0.1  # of the step, when the target leaves none

    def __init__(self) -> None:
        self._credit_s = math.inf  # full, whatever the first capacity is
        self._at = -math.inf
        self._capacity_s = math.inf
        self._refill_per_s = 0.0

    def update(self, now: float, headroom_s: float, step_s: float) -> None:
        """Refill up to `now` at the rate in force, then set the rate for what follows."""
        self._refill(now)
        self._capacity_s = max(headroom_s, self.MIN_HEADROOM_SHARE * step_s)
        self._refill_per_s = self._capacity_s / step_s if step_s > 0 else math.inf
        self._credit_s = min(self._credit_s, self._capacity_s)

    def _refill(self, now: float) -> None:
        if now > self._at and self._refill_per_s > 0:
            elapsed = now - self._at
            self._credit_s = min(self._capacity_s, self._credit_s + elapsed * self._refill_per_s)
        self._at = max(self._at, now)

    # Credit refilled through float arithmetic may fall short of a level by a few ulps: a start
    # is allowed a millionth short, and `ready_at` aims at a billionth short, so that a poll at
    # the time it names always finds the start allowed.
    def allows(self, prefill_s: float) -> bool:
        return self._credit_s >= min(prefill_s, self._capacity_s) * (1.0 - 1e-6)

    def spend(self, prefill_s: float) -> None:
        self._credit_s -= prefill_s

    def ready_at(self, prefill_s: float) -> float:
        """When `allows(prefill_s)` turns true if nothing else changes."""
        missing = min(prefill_s, self._capacity_s) * (1.0 - 1e-9) - self._credit_s
        if missing <= 0:
            return self._at
        return self._at + missing / self._refill_per_s
