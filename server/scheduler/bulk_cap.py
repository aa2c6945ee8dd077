"""How many bulk sequences may run: few enough that chats keep their pace, as many as pay.

One engine step serves every running sequence, so a chat's tokens arrive once per step, and a
step over 96 sequences takes many times as long as a step over one. While interactive requests
run or wait (and after the last one, for `bulk_hold_s` and while chats still arrive more often
than that), bulk is capped so that the predicted step time stays within the interactive gap
target: the most sequences whose step fits `AIM` of it (`StepTimes.within`), less the chats
(at least one). Otherwise bulk may grow to the knee,
the fewest sequences that reach `knee_share` of the best tokens/s seen, but not so far that
one step would leave a chat that arrives in the middle of it less than its TTFT target.
However many chats run, bulk keeps `bulk_min_share` of the sequences the gap target allows (at
least one), so it is never starved. `PrefillPacer` bounds the bulk prefill one step takes in.

The targets themselves are relative to the engine when nearly idle: the step time over one
sequence and the time to first token of a request that found the engine (nearly) empty, both
measured at start-up and refined online. A chat on a LoRA adapter is judged by its adapter's
own (the base model's times its `AdapterCost`, calibrated at start-up or when it is loaded): a
step that runs an adapter costs more than the base model's, and a chat on one could never
get the base model's gaps. The cap budgets for the tightest targets of the chats about
(`judge_for`), and keeps them after the last one leaves. A setting in milliseconds overrides
either target, for every chat alike.

All of that is the model's prediction. The bulk controller (`controller.py`) corrects it by
what chats measured: the step budgets here (the gap target's, the TTFT headroom's, and the
prefill headroom's) are multiplied by its scale. Bulk's floor is not: it is a guarantee, not a
prediction. `slo.bulk_cap_sequences` fixes the cap instead, chats or none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from server.core.config import SloConfig
from server.scheduler.controller import BulkController
from server.scheduler.estimates import BASE_COST, AdapterCost, RateEstimates
from server.scheduler.slo import SloTargets

# The prompt of a typical chat, to guess the idle time to first token before one is observed.
TYPICAL_CHAT_PROMPT_TOKENS = 64
# The cap aims this far under the gap target: a chat arriving, a prefill in a step, spread
# the steps around the aim, and the target is a limit, not a mean.
AIM = 0.9


@dataclass(frozen=True, slots=True)
class _Levels:
    """What the cap derives from the estimates, while they stay as they are."""

    targets: SloTargets
    idle_ttft: float
    ttft_headroom: float  # the TTFT target less the idle time to first token
    within_itl: float  # sequences whose step fits AIM of the gap target
    knee: int
    idle: int
    floor: int


class BulkCap:
    """The cap's levels are pure functions of the estimates they read (the step times, the idle
    time to first token, the prefill rate) and of the configuration. They are asked for on
    every poll, so they are derived once for each state of those estimates and kept until one
    changes."""

    def __init__(
        self,
        config: SloConfig,
        estimates: RateEstimates,
        controller: BulkController,
        *,
        limit: int,
        min_share: float,
    ) -> None:
        self._config = config
        self._estimates = estimates
        self._controller = controller
        self._limit = limit  # bulk's share of the sequence budget
        self._min_share = min_share
        self._judged = BASE_COST  # the cost of the chats the cap budgets for (`judge_for`)
        self._levels_of: tuple[object, ...] = ()  # the estimates `_levels_now` derives from
        self._levels_now: _Levels | None = None

    def _levels(self) -> _Levels:
        estimates = self._estimates
        steps = estimates.steps
        key = (
            steps,
            steps.revision,
            estimates.idle_ttft_s,
            estimates.prefill_tokens_per_s,
            self._controller.scale,
            self._judged,
            estimates.step_cost,
        )
        levels = self._levels_now
        if levels is None or key != self._levels_of:
            levels = self._levels_now = self._derive()
            self._levels_of = key
        return levels

    def _targets(self, cost: AdapterCost) -> tuple[SloTargets, float]:
        """The class's targets for chats on an adapter of `cost`, and their idle time to first
        token (guessed until one is observed)."""
        config, estimates = self._config, self._estimates
        steps = estimates.steps
        idle_ttft = estimates.idle_ttft_on(cost)
        if idle_ttft is None:  # not observed yet: guessed
            prefill_s = TYPICAL_CHAT_PROMPT_TOKENS / estimates.prefill_tokens_per_s
            idle_ttft = cost.ttft * (steps.at(1.0) + prefill_s)
        itl = config.itl_s
        if itl is None:
            itl = config.itl_factor * cost.step * steps.at(1.0)
        ttft = config.ttft_s
        if ttft is None:
            ttft = config.ttft_factor * idle_ttft
        return SloTargets(ttft_s=ttft, itl_s=itl), idle_ttft

    def _derive(self) -> _Levels:
        config, steps = self._config, self._estimates.steps
        targets, idle_ttft = self._targets(self._judged)
        itl, ttft = targets.itl_s, targets.ttft_s
        scale = self._controller.scale
        ttft_headroom = scale * (ttft - idle_ttft)
        # The step model is the base model's; the steps budgeted for run the adapters running
        # now, and the chats' own, whichever cost the most.
        cost = max(self._estimates.step_cost, self._judged.step)
        within_itl = steps.within(scale * AIM * itl / cost)
        knee_at = steps.knee(config.knee_share)
        knee = self._limit if knee_at is None else self._clamp(knee_at)
        if not config.cap_bulk:
            idle = self._limit
        elif config.bulk_cap_sequences is not None:
            idle = self._clamp(config.bulk_cap_sequences)
        else:
            idle = max(1, min(knee, self._clamp(steps.within(ttft_headroom / cost))))
        floor = 0
        if self._min_share > 0:
            unscaled = within_itl if scale == 1.0 else steps.within(AIM * itl / cost)
            floor = max(1, math.floor(self._min_share * self._clamp(unscaled)))
        return _Levels(
            targets,
            idle_ttft,
            ttft_headroom,
            within_itl,
            knee,
            idle,
            floor,
        )

    def judge_for(self, cost: AdapterCost) -> None:
        """Budget for chats on an adapter of `cost` (the base model's: `BASE_COST`): the
        tightest targets of the chats about, as `BulkAllowance` follows them."""
        self._judged = cost

    def targets(self, adapter: str | None = None) -> SloTargets:
        """The class's targets for chats on `adapter` (None: the base model)."""
        cost = self._estimates.adapter_cost(adapter)
        if cost == self._judged:
            return self._levels().targets
        return self._targets(cost)[0]

    def step_limit(self) -> float:
        """The step time above which bulk beyond the cap is stopped at once: the gap target
        budgeted for, as the controller corrects the model's view of it."""
        return self._controller.scale * self._levels().targets.itl_s

    def idle_ttft(self) -> float:
        """Time to first token on a nearly idle engine, as observed (or guessed until then),
        of the chats the cap budgets for."""
        return self._levels().idle_ttft

    def knee(self) -> int:
        """The fewest sequences past which more add little throughput (the budget's limit
        until the engine has been observed)."""
        return self._levels().knee

    def idle(self) -> int:
        """Bulk sequences allowed while no chat is about: the knee, unless one step there would
        outlast what a chat's TTFT target leaves beyond the idle time to first token."""
        return self._levels().idle

    def floor(self) -> int:
        """What bulk keeps however many chats run: its minimum share of the sequences the gap
        target allows, and at least one (none if `bulk_min_share` is 0)."""
        return self._levels().floor

    def with_chats(self, chats: int) -> int:
        """Bulk sequences allowed while `chats` interactive requests run or wait."""
        if not self._config.cap_bulk:
            return self._limit
        levels = self._levels()
        if self._config.bulk_cap_sequences is not None:
            return levels.idle
        return max(levels.floor, min(levels.idle, self._clamp(levels.within_itl - chats)))

    def scaled(self, chats: int) -> bool:
        """Whether the cap with `chats` is the scaled gap budget's, so that a larger scale
        would allow more (not the knee's, the TTFT headroom's or the budgets')."""
        levels = self._levels()
        return self._clamp(levels.within_itl - chats) < min(levels.idle, self._limit)

    def prefill_headroom(self, step_s: float, *, chats_about: bool) -> float:
        """Engine seconds of prefill one step of `step_s` may add: up to the gap target while
        chats are about; else up to what the TTFT target leaves beyond the idle TTFT (the
        longest step a chat arriving in its middle can sit out)."""
        levels = self._levels()
        if chats_about:
            return self._controller.scale * levels.targets.itl_s - step_s
        return levels.ttft_headroom - step_s

    def _clamp(self, sequences: float) -> int:
        if sequences >= self._limit:
            return self._limit
        return max(0, math.floor(sequences))


class PrefillPacer:
    """How much bulk prefill may enter the engine per step: a bucket that holds one step's
    headroom (what the target leaves beyond the decode step) and refills over one step. It is
    kept as a fraction of that headroom, so a headroom that changes (a chat arriving or
    leaving) rescales it. A start that needs more than the whole headroom goes when the bucket
    is full, alone: its step is longer by its prefill, and the next start waits for that step
    and one more. It bounds what bulk adds to any one step, not bulk's share of the engine:
    bulk must still be able to replace what finishes.

    A start may also name the least share of the bucket it takes (`min_share`, at most 1),
    whatever its prefill, so that starts of small prefills are spread over steps too.

    The bulk controller's `pace` (at most 1) slows the refill: over `1 / pace` steps instead of
    one, so every start, and the wait after a start too large for one step, takes that much
    longer. First tokens late behind bulk's prefills lower it."""

    MIN_HEADROOM_SHARE = 0.1  # of the step, when the target leaves none

    def __init__(self) -> None:
        self._fill = 1.0  # share of one step's headroom available now
        self._at = -math.inf
        self._headroom_s = math.inf
        self._step_s = 0.0
        self._refill_s = 0.0  # the time the bucket takes to fill from empty

    def update(self, now: float, headroom_s: float, step_s: float, pace: float = 1.0) -> None:
        """Refill up to `now` at the pace in force, then take the new headroom, step and
        pace."""
        if now > self._at:
            if self._refill_s > 0:
                self._fill = min(1.0, self._fill + (now - self._at) / self._refill_s)
            self._at = now
        self._headroom_s = max(headroom_s, self.MIN_HEADROOM_SHARE * step_s)
        self._step_s = step_s
        self._refill_s = step_s / pace

    # Fill reached through float arithmetic may fall short of a level by a few ulps: a start is
    # allowed a millionth short, and `ready_at` aims at a billionth short, so that a poll at the
    # time it names always finds the start allowed.
    def _needed(self, prefill_s: float, min_share: float) -> float:
        return min(1.0, max(min_share, prefill_s / self._headroom_s))

    def allows(self, prefill_s: float, min_share: float = 0.0) -> bool:
        return self._fill >= self._needed(prefill_s, min_share) * (1.0 - 1e-6)

    def spend(self, prefill_s: float, min_share: float = 0.0, steps: int = 1) -> None:
        """A start whose prefill takes `prefill_s` of engine time, over `steps` steps (an
        engine that prefills a long prompt a chunk a step): the next start waits for them
        all, and one more step."""
        share = max(min_share, prefill_s / self._headroom_s)
        if steps <= 1 and (share <= self._fill or prefill_s <= self._fill * self._headroom_s):
            self._fill -= share
        else:  # alone, in the steps its prefill makes longer: wait for them and one more
            longer = prefill_s / self._step_s if self._step_s > 0 else 0.0
            self._fill = min(self._fill - min_share, -max(longer, steps - 1.0))

    def ready_at(self, prefill_s: float, min_share: float = 0.0) -> float:
        """When `allows(prefill_s, min_share)` turns true if nothing else changes."""
        missing = self._needed(prefill_s, min_share) * (1.0 - 1e-9) - self._fill
        if missing <= 0 or self._refill_s <= 0:
            return self._at
        return self._at + missing * self._refill_s
