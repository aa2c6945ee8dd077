"""What the host adds to the engine in the simulator: the server's own loop, a noisy machine,
a slower one.

The `sim` timing model is an engine alone, and the start-up calibration sees only that. On a
real host a chat's token also waits for the server's event loop, which writes every output of
a step, one after another; the engine may share the CPU with that loop and wait for it; steps
vary from one to the next; a noisy neighbour makes the whole host slower or faster for a
second or two at a time; and the machine may slow down mid-run (a thermal limit, a neighbour
that stays). A `Host` turns an engine step's duration into the host's, and says when each of
a step's outputs is written to its client, where the server measures what chats get.
"""

from __future__ import annotations

import argparse
import math
import random

from pydantic import BaseModel, ConfigDict, Field, model_validator


class HostConfig(BaseModel):
    """The host's effects, all off by default (an engine alone, as before)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_ms: float = Field(
        0.0, ge=0, description="the server loop's time to write one output (one token's event)"
    )
    contention: float = Field(
        0.0,
        ge=0,
        le=1,
        description="share of the loop's writing the engine waits for (0: cores of its own; "
        "1: one core for both)",
    )
    jitter: float = Field(
        0.0, ge=0, description="each step's duration times a log-normal factor of this sigma"
    )
    request_ms: float = Field(
        0.0,
        ge=0,
        description="the server's time to read a request before the scheduler sees it (parse, "
        "tokenize), times a log-normal factor of sigma --host-request-jitter",
    )
    request_jitter: float = Field(0.0, ge=0, description="see --host-request-ms")
    slowdown_at_s: float | None = Field(
        None, ge=0, description="from this virtual second on, the host is --host-slowdown slower"
    )
    slowdown: float = Field(
        2.0, gt=0, description="how many times as long steps and writes take after the slowdown"
    )
    drift: float = Field(
        0.0,
        ge=0,
        description="a noisy neighbour: the host's speed wanders, steps and writes together, "
        "by a log-normal factor of this sigma that changes over --host-drift-s",
    )
    drift_s: float = Field(
        1.0, gt=0, description="see --host-drift: how long the host's speed takes to change"
    )
    drift_per_output: float = Field(
        0.0,
        ge=0,
        description="the neighbour's sigma grows by this much per output of the last step: on "
        "a small host the load generators and the server's loop share the engine's cores, and "
        "the more tokens a step writes, the more their work jostles the next steps",
    )
    seed: int = Field(0, description="the jitter's random seed")

    @model_validator(mode="after")
    def _growth_needs_a_neighbour(self) -> HostConfig:
        if self.drift_per_output and not self.drift:
            raise ValueError("drift_per_output grows the neighbour's sigma: set drift too")
        return self

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> HostConfig:
        return cls(**{name: getattr(args, f"host_{name}") for name in cls.model_fields})


class Host:
    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self._random = random.Random(config.seed)
        self._sigma = config.jitter
        self._writes_until = 0.0  # when the loop has written what it was given
        self._drift = 0.0  # the log of the neighbour's factor at `_drift_at`
        self._drift_at = 0.0
        self._outputs = 0  # the last step's outputs

    def factor(self, now: float) -> float:
        """How many times as long than the engine alone things take on the host at `now`."""
        at = self.config.slowdown_at_s
        slowdown = self.config.slowdown if at is not None and now >= at else 1.0
        return slowdown * self._neighbour(now) if self.config.drift else slowdown

    def _neighbour(self, now: float) -> float:
        """The noisy neighbour's factor at `now`: its log an Ornstein-Uhlenbeck process (mean
        0, sigma `drift`, correlation time `drift_s`), drawn exactly over any interval, so
        that it does not depend on how often it is read; mean 1."""
        sigma = self.config.drift
        if now > self._drift_at:
            keep = math.exp((self._drift_at - now) / self.config.drift_s)
            fresh = sigma * math.sqrt(1.0 - keep * keep) * self._random.gauss(0.0, 1.0)
            self._drift = self._drift * keep + fresh
            self._drift_at = now
        if not self.config.drift_per_output:
            return math.exp(self._drift - sigma * sigma / 2)
        loaded = sigma + self.config.drift_per_output * self._outputs
        return math.exp(self._drift * loaded / sigma - loaded * loaded / 2)

    def request_s(self, now: float) -> float:
        """The time until a request arriving at `now` reaches the scheduler."""
        setup = self.config.request_ms / 1000.0
        if setup and self.config.request_jitter:
            sigma = self.config.request_jitter
            setup *= self._random.lognormvariate(-sigma * sigma / 2, sigma)
        return setup * self.factor(now)

    def step_s(self, engine_s: float, now: float) -> float:
        """A step that the engine alone would run in `engine_s`, starting at `now`."""
        if self._sigma:
            sigma = self._sigma
            engine_s *= self._random.lognormvariate(-sigma * sigma / 2, sigma)
        return engine_s * self.factor(now)

    def write(self, outputs: int, now: float) -> tuple[float, float, float]:
        """A step's `outputs` handed to the loop at `now`: (when it starts writing them, the
        time each takes, when the engine may start its next step)."""
        self._outputs = outputs
        event_s = self.config.event_ms / 1000.0 * self.factor(now)
        start = now if now > self._writes_until else self._writes_until
        self._writes_until = start + outputs * event_s
        return start, event_s, now + self.config.contention * outputs * event_s
