"""The bulk controller: the share of the engine chats leave to bulk, steered by what chats get.

Feed-forward, the step-time model (the start-up calibration, then the online estimates) says
how many sequences fit a step budget: `BulkCap` runs the most whose predicted step fits it, and
`PrefillPacer` lets bulk prefill into a step only what the target leaves beyond it. Feedback,
what chats measured where the server wrote their tokens (`ChatMeter`) says how far that model
is from what chats get on this host, now. The controller moves two numbers:

* `scale`, by which the cap's step budgets (and the pacer's headroom) are multiplied: 1 is the
  model as it stands, 0.5 says that chats get twice the gaps the model predicts;
* `pace` (at most 1), the speed at which the pacer lets bulk start: 0.5 spaces bulk's starts,
  and so its prefills, twice as far apart as the model would.

Gaps steer the scale, in two loops, one inside the other:

* inner, every `PERIOD_S`: the median gap share of the last second against the `aim`;
  log(scale) moves by `GAIN` x log(aim / median) when the median is over the aim, by
  `GROWTH_GAIN` (half that) when under it. The model maps a budget to the sequences whose
  step fits it, so the gaps chats get grow about in proportion to the scale (less, by the
  frontend's fixed share): the loop's own gain is at most `GAIN` per period, and an
  integrator with that gain over a measurement about 2.5 periods old converges without
  overshoot (a delayed integrator x' = -g x(t - d) does so for g d < 1/e). A step cost that
  doubles is undone within about two seconds; one that halves is taken up within about four.
  Growth is the slower because on a host whose speed wanders from second to second (a noisy
  neighbour), the window's median is mostly that noise: a loop as quick to grow as to shrink
  chases it, and the bulk it lets start in a calm second is still running in the next slow
  one. Half the gain for growth halves that chase, and costs only slack left unused for a
  few seconds (docs/design/bulk-controller.md has what it bought in virtual time).
* outer, as chats end: the aim, the window's median that leaves `goal` of chats within their
  gap target. Each chat that ends is a ratio: its own median gap share over the aim it lived
  under. It holds all that the inner loop does not: how far one chat strays from what chats
  got together (its prefills, its neighbours', the host's noise) and how closely the loop
  held its aim. The aim is one over the goal's quantile of the last `SPREAD_CHATS` ratios (a
  chat there lands on its target), so that spread, which differs by host and by load, is
  measured rather than assumed; until `MIN_SPREAD` chats have ended it is `AIM_START`. Before
  the inner loop first holds its aim (below), a chat over its target is no part of the spread:
  it measured the model's first guess, or a fresh engine's first steps, not how chats stray
  under a loop that holds; kept, the handful of a fresh server's first second would set the
  aim for the minute they stay among the last 250 (on the real flood, 0.47-0.67 where 0.7-0.8
  holds). Without them, a fresh server's aim is the start's and the ceiling's, set at the
  hold: `AIM_START` is below where the loop settles on the hosts measured, because on a fresh
  server nothing yet says how much wider chats stray at the bulk a higher aim lets in. The
  goal's quantile is a tail: of 100 chats at a goal of 97%, the third highest, and from one
  hundred to the next it moves the aim, and bulk with it, by more than the spread itself
  changes. 250 chats (a minute at 4 chats/s) hold it still enough. A spread learnt at one
  bulk understates the spread at the more bulk its aim then lets in, so misses are also
  counted where they happen: once the inner loop has first held its aim (the window's median
  back to it after being over it; before, a miss is the model's first guess, or a fresh
  engine's first steps at each batch shape), each chat over its gap target lowers a ceiling
  on the aim by `CEILING_STEP` (in log), and each within it raises the ceiling by a share of
  that, so that at most half the goal's misses are gaps (a stochastic approximation, as the
  pace's: first tokens have the other half). The aim is the lower of the two. The ceiling
  must not wind up where it holds nothing: it starts, at the hold, `CEILING_MARGIN` above
  the aim, and a chat within its target raises it only while it is less than that above the
  spread's limit (a chat under an aim the ceiling did not set says nothing of the ceiling).
  So when the spread's limit jumps (the start-up's chats leave the last 250; a calm minute),
  the aim follows it no faster than chats at each new aim show that it holds, instead of
  jumping to a ceiling that a long calm run left at its bound.

First tokens steer the pace: a chat whose first token came late behind bulk's prefills (the
scheduler judges that as it sees the token: `BulkAllowance._late_behind_bulk`) slows the pace
by `PACE_STEP` (in log); each other first token speeds it back by a share of that, so that
half the goal's misses at most are such first tokens (a stochastic approximation). Fewer bulk
starts mean fewer prefills in the steps a chat's first token waits for, and, where bulk's
requests are long to prefill, less bulk. A first token late for any other reason (the
frontend, a queue, a step that would be as long without bulk's starts) is no lever of the
pace's, and moves nothing: counted, it would sink the pace to its floor for first tokens that
no pace brings in.

The scale only grows while bulk waits at its cap (a cap nobody uses teaches nothing), and only
shrinks while bulk runs above its floor and within the cap: an integrator that cannot move what
it steers must not wind up. Both numbers stay within bounds. With `slo.feedback: false` neither
moves: the model alone.
"""

from __future__ import annotations

import math
from collections import deque

from server.core.config import SloConfig
from server.scheduler.attainment import ChatMeter, Ended

PERIOD_S = 0.2
GAIN = 0.12  # while chats' gaps are over the aim
GROWTH_GAIN = 0.06  # under it
SCALE_BOUNDS = (0.1, 8.0)
AIM_START = 0.65
AIM_BOUNDS = (0.4, 0.9)
SPREAD_CHATS = 250  # the last chats whose spread sets the aim
MIN_SPREAD = 20  # chats ended before it does
CEILING_STEP = 0.03  # of log(ceiling), per chat over its gap target
CEILING_MARGIN = 0.05  # of log(ceiling), the most it rises above the spread's limit
PACE_STEP = 0.2  # of log(pace), per first token late behind bulk's prefills
PACE_MIN = 0.05


class BulkController:
    def __init__(self, goal: float, *, enabled: bool) -> None:
        self.goal = goal
        self.enabled = enabled
        self.scale = 1.0
        self.aim = AIM_START
        self.pace = 1.0
        self.steps = 0  # inner-loop moves, for metrics and tests
        self._log_scale = 0.0
        self._spread: deque[float] = deque(maxlen=SPREAD_CHATS)  # median share / aim
        self.spread_limit = AIM_START  # the aim the spread sets (within the bounds)
        self.ceiling = AIM_BOUNDS[1]  # the aim the misses allow
        self._over = False  # whether chats' median gap share has been over the aim yet
        self._held = False  # whether the inner loop has since brought it back to the aim
        self.next_at = -math.inf  # the next period
        self.median = 0.0  # the window's median gap share when last read (0: none)
        self._first_tokens = 0  # chats' first tokens since the last period
        self._late = False  # whether one of them came late behind bulk's prefills

    @classmethod
    def for_slo(cls, slo: SloConfig) -> BulkController:
        """Steering only where there is a cap to steer (`cap_bulk`), set by the model (no
        fixed `bulk_cap_sequences`), and feedback is on."""
        return cls(
            slo.attainment_goal,
            enabled=slo.feedback and slo.cap_bulk and slo.bulk_cap_sequences is None,
        )

    def due(self, now: float) -> bool:
        return self.enabled and now >= self.next_at

    def steer(
        self,
        now: float,
        meter: ChatMeter,
        *,
        may_grow: bool,
        may_shrink: bool,
        bulk_about: bool = True,
    ) -> bool:
        """One period: the pace from the first tokens since the last, the aim from the chats
        that ended, then the scale from the window's median gap. Returns whether the scale moved."""
        self.next_at = now + PERIOD_S
        if self._first_tokens:
            self._learn_pace()
        ended = meter.take_ended()
        if ended:
            self._learn_aim(ended)
        if not bulk_about:
            self.median = 0.0
            return False  # (nor is the window read: with no bulk about, nothing to steer)
        median = meter.gap_median(now)
        self.median = median or 0.0
        if median is None or median <= 0.0:
            return False
        # Held: the window's median came back to the aim after being over it, so the loop has
        # corrected its first guess (and a fresh engine's first steps at each new batch shape).
        if self._over and median <= self.aim and not self._held:
            self._held = True
            self.ceiling = min(self.ceiling, self.aim * math.exp(CEILING_MARGIN))
        self._over = self._over or median > self.aim
        error = math.log(self.aim / median)
        if (error > 0 and not may_grow) or (error < 0 and not may_shrink):
            return False
        low, high = SCALE_BOUNDS
        gain = GROWTH_GAIN if error > 0 else GAIN
        self._log_scale = min(math.log(high), max(math.log(low), self._log_scale + gain * error))
        self.scale = math.exp(self._log_scale)
        self.steps += 1
        return True

    def first_token(self, *, late: bool) -> None:
        """A chat's first token, and whether it came late behind bulk's prefills."""
        self._first_tokens += 1
        self._late = self._late or late

    def _learn_pace(self) -> None:
        allowed = (1.0 - self.goal) / 2  # of first tokens late behind bulk's prefills
        # Chats late together were late behind the same prefill: one slowing for them all.
        move = PACE_STEP * (allowed * self._first_tokens - self._late) / (1.0 - allowed)
        self.pace = min(1.0, max(PACE_MIN, self.pace * math.exp(move)))
        self._first_tokens, self._late = 0, False

    def _learn_aim(self, ended: list[Ended]) -> None:
        allowed = (1.0 - self.goal) / 2  # of chats over their gap target (the pace has the rest)
        low, high = AIM_BOUNDS  # (the ceiling too, so that it cannot wind up)
        for chat in ended:
            if chat.median_gap_share is None:
                continue
            missed = chat.median_gap_share > 1.0
            if self._held or not missed:
                self._spread.append(chat.median_gap_share / self.aim)
            if not self._held:  # (before, a miss is the model's first guess, not the aim's)
                continue
            if missed or self.ceiling < self.spread_limit * math.exp(CEILING_MARGIN):
                move = CEILING_STEP * (allowed - missed) / (1.0 - allowed)
                self.ceiling = min(high, max(low, self.ceiling * math.exp(move)))
        if len(self._spread) >= MIN_SPREAD:
            ordered = sorted(self._spread)
            # The k-th of n ratios leaves (n - k + 1) / (n + 1) of the next chats above it, on
            # average: k = goal x (n + 1) leaves 1 - goal of them to miss.
            rank = round(self.goal * (len(ordered) + 1))
            quantile = 1.0 / ordered[min(len(ordered), max(1, rank)) - 1]
            self.spread_limit = max(low, min(high, quantile))
        self.aim = min(self.ceiling, self.spread_limit)
