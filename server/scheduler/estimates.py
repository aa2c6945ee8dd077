"""Online estimates of how fast the engine serves: prefill rate, decode step time, output length.

Moving averages updated from what the shells observe (dispatch, first token, each output, finish),
starting from configured priors or from the start-up calibration. They feed predictions
(admission, Retry-After, autoscale pressure) and the bulk cap (`bulk_cap.py`); no budget depends
on them.

Decode speed depends on how many sequences run together: each engine step produces one token for
every running sequence, and a step over 200 sequences takes longer than a step over 20. So the
decode estimate is a step time per concurrency level (`StepTimes`), measured over windows of
engine time from the tokens the shells report as they stream. It is the base model's: a step
that runs a LoRA adapter's sequences costs more (its `AdapterCost`, the most of those running),
so a window over them is taken at that cost less, and a prediction for the sequences running
now (`step_s`) at that cost more. The start-up calibration times the base model's steps at each
concurrency and each adapter's idle step alone; a flood on adapters teaches the same curve.
A per-request rate measured at request end arrived too late: under a sudden surge the
scheduler kept admitting at the rate it had seen at low load, and a third of what it admitted
then missed its deadline.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass

from server.core.config import EstimateConfig
from server.scheduler.types import Ticket

# Engine time (with sequences running) per decode-step observation.
STEP_WINDOW_S = 0.5
# A window restarts when the running sequences move beyond this factor of its average, and by
# more than `WINDOW_JUMP_MIN` sequences: at a few sequences one chat arriving is a factor of 2,
# and a window that restarted at each would never close (see `running_changed`).
WINDOW_JUMP = 1.5
WINDOW_JUMP_MIN = 4
# A window whose time was mostly prefill (an engine filling up) says little about decode steps.
MIN_DECODE_SHARE = 0.5
# One window counts for at most this factor of the step time estimated at its concurrency (see
# `StepTimes.observe`).
STALL_CLAMP = 2.0
# Rates (or step times) within this factor of each other are the same rate.
_SAME_RATE = 1.01
# Concurrency levels are grouped in half-octave bins (1, 1.4, 2, 2.8, 4, ... sequences).
_BINS_PER_OCTAVE = 2
# Time constant of the average number of chats running or waiting together.
CHATS_TOGETHER_WINDOW_S = 10.0
# Time constant of the rate at which chats arrive.
CHAT_RATE_WINDOW_S = 10.0
# Prompts shorter than this do not update the prefill rate (see `observe_prefill`).
PREFILL_SAMPLE_MIN_TOKENS = 256
# A chat dispatched with at most this many other sequences running saw a nearly idle engine: its
# time to first token is the idle reference the interactive SLO is relative to.
NEARLY_IDLE_OTHERS = 1


@dataclass(frozen=True, slots=True)
class AdapterCost:
    """What a LoRA adapter costs on an idle engine against the base model: its step and its
    engine's time to first token, each as a ratio to the base model's (1: no more).

    Ratios, not seconds: measured beside the base model's runs in the same probe
    (`calibration.py`), a host's drift over the probe cancels out of them, and the base
    model's idle step and first token, refined online, carry every adapter's with them."""

    step: float = 1.0
    ttft: float = 1.0


BASE_COST = AdapterCost()  # the base model's, and an adapter's not calibrated yet


def concurrency_bin(concurrency: float) -> int:
    return round(_BINS_PER_OCTAVE * math.log2(max(1.0, concurrency)))


class StepTimes:
    """Seconds per decode step (per token of each running sequence) by concurrency.

    Each observed bin keeps a moving average of its concurrency and step time. Between observed
    bins the estimate is interpolated; below the lowest it is the lowest bin's (steps are not
    assumed to get faster); above the highest it grows in proportion to the concurrency, as if
    the engine's total token rate had stopped growing. Both extrapolations err slow, so
    admission errs towards refusing, until the engine has been seen at that load.

    The same assumption, that more sequences never make fewer tokens/s, ages what was seen at
    higher concurrencies: each observation moves every higher bin that shows a lower rate
    towards this one's rate, by the same weight. A stall seen once at a level the bulk cap no
    longer reaches (a shared host's) would otherwise stand for good, hold the knee below it and
    the cap with it; it fades, and the knee tries that level again. Where the rate really
    falls, the engine shows it falling again there.

    One window counts for at most `STALL_CLAMP` times the estimate at its concurrency. A shared
    host that freezes the server for seconds (seen: 3 s, with 18 ms of its CPU) makes a window
    of one step and almost no tokens: a step time thousands of times the engine's, which set
    the bulk cap to a few sequences at once, and the next freeze there lowered it again. A
    real slowdown is learnt over a few windows instead of one (20% a window, at weight 0.2).
    """

    def __init__(self, prior_step_s: float, weight: float) -> None:
        self._prior = prior_step_s
        self._weight = weight
        self._bins: dict[int, tuple[float, float]] = {}  # bin -> (concurrency, step seconds)
        self._points: list[tuple[float, float]] = []  # the bins' values, by concurrency
        self.revision = 0  # counts the observations that changed the estimate
        # The last `at` asked and its answer: one admission asks the same level two or three
        # times (its wait, its own service time), a million admissions in a simulation.
        self._last_at = (math.nan, 0.0)

    def observe(self, concurrency: float, step_s: float) -> None:
        if concurrency <= 0 or step_s <= 0:
            return
        if self._points:
            step_s = min(step_s, STALL_CLAMP * self.at(concurrency))
        key = concurrency_bin(concurrency)
        old = self._bins.get(key)
        if old is None:
            self._bins[key] = (concurrency, step_s)
        else:
            w = self._weight
            self._bins[key] = (old[0] + w * (concurrency - old[0]), old[1] + w * (step_s - old[1]))
        here_c, here_s = self._bins[key]
        for higher in [k for k in self._bins if k > key]:
            c, s = self._bins[higher]
            same_rate_s = here_s * c / here_c
            if s > same_rate_s:
                s += self._weight * (same_rate_s - s)
                # Within a hair of the same rate is the same rate (see `knee`).
                self._bins[higher] = (c, same_rate_s if s <= same_rate_s * _SAME_RATE else s)
        self._points = sorted(self._bins.values())
        self._last_at = (math.nan, 0.0)
        self.revision += 1

    def at(self, concurrency: float) -> float:
        last_c, last_s = self._last_at
        if concurrency == last_c:
            return last_s
        step_s = self._at(concurrency)
        self._last_at = (concurrency, step_s)
        return step_s

    def _at(self, concurrency: float) -> float:
        points = self._points
        if not points:
            return self._prior
        c = max(1.0, concurrency)
        low_c, low_s = points[0]
        if c <= low_c:
            return low_s
        high_c, high_s = points[-1]
        if c >= high_c:
            return high_s * c / high_c
        i = bisect.bisect_left(points, (c, 0.0))
        (c0, s0), (c1, s1) = points[i - 1], points[i]
        return s0 + (s1 - s0) * (c - c0) / (c1 - c0)

    def within(self, step_s: float) -> float:
        """The most sequences that can run with steps of at most `step_s`: the first point where
        the estimate crosses it (0 when even one sequence's step is slower)."""
        if self.at(1.0) > step_s:
            return 0.0
        points = self._points
        if not points:
            return math.inf  # the prior is flat: no concurrency is known to cross it
        prev_c, prev_s = 1.0, self.at(1.0)
        for c, s in points:
            if c > prev_c and s > step_s:
                return prev_c + (c - prev_c) * (step_s - prev_s) / (s - prev_s)
            if c > prev_c:
                prev_c, prev_s = c, s
        high_c, high_s = points[-1]
        return max(prev_c, high_c * step_s / high_s)  # beyond: steps grow with concurrency

    def knee(self, share: float) -> float | None:
        """The fewest sequences that reach `share` of the best total tokens/s observed; beyond
        them more sequences add little throughput and much step time. None before any
        observation. When the best rate was seen at the highest concurrency observed, more
        might still help: twice that is returned, so the engine is tried there."""
        points = self._points
        if not points:
            return None
        rates = [c / s for c, s in points]
        best = max(rates)
        if rates[-1] * _SAME_RATE >= best:
            return 2.0 * points[-1][0]
        return next(c for (c, _), rate in zip(points, rates, strict=True) if rate >= share * best)


@dataclass(slots=True)
class _Window:
    """Engine time since the window opened: busy seconds, sequence-seconds, tokens, and the
    prefill dispatched into it (engine seconds)."""

    busy_s: float = 0.0
    sequence_s: float = 0.0
    tokens: int = 0
    prefill_s: float = 0.0
    step_cost: float = 1.0  # the most its steps cost for the LoRA adapters that ran in them

    def concurrency(self) -> float:
        return self.sequence_s / self.busy_s if self.busy_s > 0 else 0.0

    def decode_step_s(self) -> float | None:
        """Seconds per decode step: sequence-seconds per token, less what the prefills took
        (every running sequence waited through them); None if prefill was most of it."""
        decode_s = self.busy_s - self.prefill_s
        if decode_s < MIN_DECODE_SHARE * self.busy_s or self.tokens == 0:
            return None
        return decode_s * self.concurrency() / self.tokens


class RateEstimates:
    def __init__(self, config: EstimateConfig) -> None:
        self._weight = config.smoothing
        self.prefill_tokens_per_s = config.prefill_tokens_per_s
        self.steps = StepTimes(1.0 / config.decode_tokens_per_s, config.smoothing)
        self.output_fraction = 1.0  # generated tokens / max_tokens, of completed requests
        self.open_ended_output_tokens = config.open_ended_output_tokens
        # A chat's time to first token on an idle server, in two parts: the frontend's
        # lead-in (from its arrival to the scheduler's seeing it: reading, parsing, tokenizing;
        # observed on every chat) and the engine's (from its dispatch to its first token on a
        # nearly idle engine: the calibration's, then observed). The engine's alone, the
        # calibration's probe, would hold a chat to what no chat gets, even on an idle server.
        self.engine_ttft_s: float | None = None
        self._lead_in_s: float | None = None
        # Each calibrated LoRA adapter's cost against the base model (`AdapterCost`).
        self.adapters: dict[str, AdapterCost] = {}
        self._running = 0
        # What a step over the running sequences costs against the base model's: the most
        # of their LoRA adapters' (`AdapterCost.step`).
        self.step_cost = 1.0
        self._changed_at: float | None = None
        self._window = _Window()
        self._prefill_pending_s = 0.0  # dispatched, not yet run
        # Interactive requests running or waiting, averaged over time (idle time included):
        # by Little's law, how many more a chat can expect to arrive while it runs.
        self.chats_together = 0.0
        self._chats = 0
        self._chats_at: float | None = None
        # Chats arrived per second, each counted 1 / window and decaying since `_rate_at`.
        self._chat_rate = 0.0
        self._rate_at = -math.inf

    def _blend(self, old: float | None, new: float) -> float:
        """`new` smoothed into `old` (None: nothing observed yet, so `new` itself)."""
        return new if old is None else old + self._weight * (new - old)

    # --- observations --------------------------------------------------------------------
    def running_changed(self, running: int, now: float, adapters: Iterable[str] = ()) -> None:
        """The number of running sequences is `running` from `now` on, on these LoRA
        `adapters` (a step that runs any of them costs the most of theirs)."""
        self._advance(now)
        self._running = running
        self.step_cost = max((self.adapter_cost(a).step for a in adapters), default=1.0)
        level = self._window.concurrency()
        jumped = not level / WINDOW_JUMP <= running <= level * WINDOW_JUMP
        if level and jumped and abs(running - level) > WINDOW_JUMP_MIN:
            # A jump (a bulk cap falling from 96 sequences to 8, say): a window across it would
            # blend two levels into a point that is neither. Small moves (chats coming and
            # going) stay in one window, whose tokens and time then match; at a few sequences
            # they are small in number though large as a factor, and a window restarted at
            # each would never close: the estimate there would stay whatever it last was (a
            # stall of a shared host, say), and the bulk cap with it.
            self._window = _Window()
        window = self._window
        window.step_cost = max(window.step_cost, self.step_cost)

    def tokens_generated(self, tokens: int, now: float) -> None:
        """The engine produced `tokens` output tokens (across sequences) by `now`."""
        window = self._window
        if now == self._changed_at:  # the same instant (a step's outputs): nothing to close
            window.tokens += tokens
            return
        if (
            window.busy_s >= STEP_WINDOW_S
            and window.tokens >= window.concurrency()
            and self._changed_at is not None
            and now > self._changed_at
        ):
            # The window closes before the time moves on, so it holds whole engine steps, and
            # only once it holds one step's tokens at least: sequences that made fewer had not
            # been decoding (a burst dispatched and cancelled before the engine ran them: 116
            # sequences and 2 tokens in 0.6 s, read as a step of 35 s at every concurrency).
            # Sequence-seconds per token is the step time; busy time gives the concurrency.
            step = window.decode_step_s()
            if step is not None:  # (the base model's: its adapters' cost less)
                self.steps.observe(window.concurrency(), step / window.step_cost)
            window = self._window = _Window(step_cost=self.step_cost)
        self._advance(now)
        window.tokens += tokens

    def chats_changed(self, chats: int, now: float) -> None:
        """`chats` interactive requests run or wait from `now` on."""
        if self._chats_at is not None and now > self._chats_at:
            weight = 1.0 - math.exp(-(now - self._chats_at) / CHATS_TOGETHER_WINDOW_S)
            self.chats_together += weight * (self._chats - self.chats_together)
        self._chats, self._chats_at = chats, now

    def chat_arrived(self, now: float) -> None:
        self._chat_rate = self.chat_rate(now) + 1.0 / CHAT_RATE_WINDOW_S
        self._rate_at = now

    def chat_rate(self, now: float) -> float:
        """Chats arriving per second, by recent arrivals (an exponential average)."""
        if self._chat_rate == 0.0:
            return 0.0
        return self._chat_rate * math.exp(-(now - self._rate_at) / CHAT_RATE_WINDOW_S)

    def chats_rarer_than(self, interval_s: float) -> float:
        """When the chat rate falls to one per `interval_s`, if no chat arrives meanwhile."""
        expected = self._chat_rate * interval_s  # chats per interval at `_rate_at`
        if expected <= 1.0:
            return self._rate_at
        return self._rate_at + CHAT_RATE_WINDOW_S * math.log(expected)

    def prefill_dispatched(self, seconds: float) -> None:
        """A request was dispatched whose prefill will take the engine about `seconds`: its
        step is that much longer for every sequence, and that is not decode time. It is
        charged to the windows as engine time passes, where it runs."""
        self._prefill_pending_s += seconds

    def _advance(self, now: float) -> None:
        if self._changed_at is not None and self._running > 0 and now > self._changed_at:
            elapsed = now - self._changed_at
            self._window.busy_s += elapsed
            self._window.sequence_s += elapsed * self._running
            pending = self._prefill_pending_s
            prefill = elapsed if elapsed < pending else pending
            self._window.prefill_s += prefill
            self._prefill_pending_s -= prefill
        self._changed_at = now

    def observe_prefill(self, prompt_tokens: int, seconds: float, others: int) -> None:
        """A prompt's first token `seconds` after dispatch, its prefill sharing a step with
        `others` decoding sequences. Only long prompts teach the rate: for a short one the
        step it joined, and the one it waited for, are most of the time."""
        if prompt_tokens < PREFILL_SAMPLE_MIN_TOKENS:
            return
        prefill_s = seconds - self.step_s(others + 1)
        if prefill_s > 0:
            rate = prompt_tokens / prefill_s
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, rate)

    def adapter_cost(self, adapter: str | None) -> AdapterCost:
        """What `adapter` costs against the base model (None: the base model itself)."""
        return BASE_COST if adapter is None else self.adapters.get(adapter, BASE_COST)

    @property
    def idle_ttft_s(self) -> float | None:
        """A chat's time to first token on an idle server (None: the engine's not known yet)."""
        return self.idle_ttft_on(BASE_COST)

    def idle_ttft_on(self, cost: AdapterCost) -> float | None:
        """The same for a chat on an adapter of `cost`: the engine's part is its own."""
        if self.engine_ttft_s is None:
            return None
        return (self._lead_in_s or 0.0) + cost.ttft * self.engine_ttft_s

    def observe_engine_ttft(self, ttft_s: float, adapter: str | None = None) -> None:
        """Dispatch to first token on a nearly idle engine, of a request on `adapter`: taken
        as the base model's (its adapter's ratio out), so that chats on any adapter refine
        one estimate, which every adapter's is a ratio of."""
        if adapter is not None:
            ttft_s /= self.adapter_cost(adapter).ttft
        self.engine_ttft_s = self._blend(self.engine_ttft_s, ttft_s)

    def observe_lead_in(self, seconds: float) -> None:
        """A chat's arrival to its submission to the scheduler."""
        self._lead_in_s = self._blend(self._lead_in_s, seconds)

    def observe_completion(self, output_tokens: int, ticket: Ticket) -> None:
        if ticket.open_ended:
            self.open_ended_output_tokens = self._blend(
                self.open_ended_output_tokens, float(output_tokens)
            )
        elif ticket.max_tokens > 0:
            fraction = output_tokens / ticket.max_tokens
            fraction = fraction if fraction < 1.0 else 1.0
            self.output_fraction = self._blend(self.output_fraction, fraction)

    # --- predictions ---------------------------------------------------------------------
    def step_s(self, concurrency: float) -> float:
        """Seconds of a step over `concurrency` sequences, on the adapters running now."""
        return self.step_cost * self.steps.at(concurrency)

    def expected_output_tokens(self, ticket: Ticket) -> float:
        """What `ticket` will likely generate, all its choices together: a share of max_tokens,
        or, when the client set none, the typical length of such answers (not the whole
        context it reserves)."""
        if ticket.open_ended:
            return ticket.n * min(float(ticket.max_tokens), self.open_ended_output_tokens)
        return ticket.n * ticket.max_tokens * self.output_fraction

    def decode_tokens_per_s(self, concurrency: float) -> float:
        """Tokens per second of one sequence among `concurrency` running together."""
        return 1.0 / self.step_s(concurrency)

    def service_seconds(self, ticket: Ticket, concurrency: float) -> float:
        """Expected time from dispatch to the last token of `ticket`, running among
        `concurrency` sequences (its choices run side by side)."""
        expected_output = self.expected_output_tokens(ticket) / ticket.n
        expected_output = expected_output if expected_output > 1.0 else 1.0
        return ticket.prompt_tokens / self.prefill_tokens_per_s + expected_output * self.step_s(
            concurrency
        )
