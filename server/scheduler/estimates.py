"""Online estimates of how fast the engine serves: prefill rate, decode step time, output length.

Moving averages updated from what the shells observe (dispatch, first token, each output, finish),
starting from configured priors. They only feed predictions (admission, Retry-After, autoscale
pressure); no budget depends on them.

Decode speed depends on how many sequences run together: each engine step produces one token for
every running sequence, and a step over 200 sequences takes longer than a step over 20. So the
decode estimate is a step time per concurrency level (`StepTimes`), measured over windows of
engine time from the tokens the shells report as they stream. A per-request rate measured at
request end arrived too late: under a sudden surge the scheduler kept admitting at the rate it
had seen at low load, and a third of what it admitted then missed its deadline.
"""

from __future__ import annotations

import bisect
import math

from server.config import EstimateConfig
from server.scheduler.types import Ticket

# Engine time (with at least one sequence running) per decode-step observation.
STEP_WINDOW_S = 0.5
# Concurrency levels are grouped in half-octave bins (1, 1.4, 2, 2.8, 4, ... sequences).
_BINS_PER_OCTAVE = 2


class StepTimes:
    """Seconds per decode step (per token of each running sequence) by concurrency.

    Each observed bin keeps a moving average of its concurrency and step time. Between observed
    bins the estimate is interpolated; below the lowest it is the lowest bin's (steps are not
    assumed to get faster); above the highest it grows in proportion to the concurrency, as if
    the engine's total token rate had stopped growing. Both extrapolations err slow, so
    admission errs towards refusing, until the engine has been seen at that load.
    """

    def __init__(self, prior_step_s: float, weight: float) -> None:
        self._prior = prior_step_s
        self._weight = weight
        self._bins: dict[int, tuple[float, float]] = {}  # bin -> (concurrency, step seconds)
        self._points: list[tuple[float, float]] = []  # the bins' values, by concurrency

    def observe(self, concurrency: float, step_s: float) -> None:
        if concurrency <= 0 or step_s <= 0:
            return
        key = round(_BINS_PER_OCTAVE * math.log2(max(1.0, concurrency)))
        old = self._bins.get(key)
        if old is None:
            self._bins[key] = (concurrency, step_s)
        else:
            w = self._weight
            self._bins[key] = (old[0] + w * (concurrency - old[0]), old[1] + w * (step_s - old[1]))
        self._points = sorted(self._bins.values())

    def at(self, concurrency: float) -> float:
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


class RateEstimates:
    def __init__(self, config: EstimateConfig) -> None:
        self._weight = config.smoothing
        self.prefill_tokens_per_s = config.prefill_tokens_per_s
        self.steps = StepTimes(1.0 / config.decode_tokens_per_s, config.smoothing)
        self.output_fraction = 1.0  # generated tokens / max_tokens, of completed requests
        self.open_ended_output_tokens = config.open_ended_output_tokens
        # The current window: engine time with sequences running, sequence-seconds, tokens.
        self._running = 0
        self._changed_at: float | None = None
        self._busy_s = 0.0
        self._sequence_s = 0.0
        self._tokens = 0

    def _blend(self, old: float, new: float) -> float:
        return old + self._weight * (new - old)

    # --- observations --------------------------------------------------------------------
    def running_changed(self, running: int, now: float) -> None:
        """The number of running sequences is `running` from `now` on."""
        self._advance(now)
        self._running = running

    def tokens_generated(self, tokens: int, now: float) -> None:
        """The engine produced `tokens` output tokens (across sequences) by `now`."""
        if (self._busy_s >= STEP_WINDOW_S and self._tokens > 0
                and self._changed_at is not None and now > self._changed_at):
            # The window closes before the time moves on, so it holds whole engine steps.
            # Sequence-seconds per token is the step time; busy time gives the concurrency.
            self.steps.observe(self._sequence_s / self._busy_s, self._sequence_s / self._tokens)
            self._busy_s = self._sequence_s = 0.0
            self._tokens = 0
        self._advance(now)
        self._tokens += tokens

    def _advance(self, now: float) -> None:
        if self._changed_at is not None and self._running > 0 and now > self._changed_at:
            elapsed = now - self._changed_at
            self._busy_s += elapsed
            self._sequence_s += elapsed * self._running
        self._changed_at = now

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens > 0 and seconds > 0:
            rate = prompt_tokens / seconds
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, rate)

    def observe_completion(self, output_tokens: int, ticket: Ticket) -> None:
        if ticket.open_ended:
            self.open_ended_output_tokens = self._blend(
                self.open_ended_output_tokens, float(output_tokens))
        elif ticket.max_tokens > 0:
            fraction = min(1.0, output_tokens / ticket.max_tokens)
            self.output_fraction = self._blend(self.output_fraction, fraction)

    # --- predictions ---------------------------------------------------------------------
    def expected_output_tokens(self, ticket: Ticket) -> float:
        """What `ticket` will likely generate: a share of max_tokens, or, when the client set
        none, the typical length of such answers (not the whole context it reserves)."""
        if ticket.open_ended:
            return min(float(ticket.max_tokens), self.open_ended_output_tokens)
        return ticket.max_tokens * self.output_fraction

    def decode_tokens_per_s(self, concurrency: float) -> float:
        """Tokens per second of one sequence among `concurrency` running together."""
        return 1.0 / self.steps.at(concurrency)

    def service_seconds(self, ticket: Ticket, concurrency: float) -> float:
        """Expected time from dispatch to the last token of `ticket`, running among
        `concurrency` sequences."""
        expected_output = max(1.0, self.expected_output_tokens(ticket))
        return (
            ticket.prompt_tokens / self.prefill_tokens_per_s
            + expected_output * self.steps.at(concurrency)
        )
