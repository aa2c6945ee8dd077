"""Online estimates of how fast the engine serves: prefill and decode rates, output length.

Moving averages updated from what the shells observe (dispatch, first token, finish), starting
from configured priors. They only feed predictions (admission, Retry-After, autoscale pressure);
no budget depends on them.
"""

from __future__ import annotations

from server.config import EstimateConfig
from server.scheduler.types import Ticket


class RateEstimates:
    def __init__(self, config: EstimateConfig) -> None:
        self._weight = config.smoothing
        self.prefill_tokens_per_s = config.prefill_tokens_per_s
        self.decode_tokens_per_s = config.decode_tokens_per_s  # per running sequence
        self.output_fraction = 1.0  # generated tokens / max_tokens, of completed requests
        self.open_ended_output_tokens = config.open_ended_output_tokens

    def _blend(self, old: float, new: float) -> float:
        return old + self._weight * (new - old)

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        if prompt_tokens > 0 and seconds > 0:
            rate = prompt_tokens / seconds
            self.prefill_tokens_per_s = self._blend(self.prefill_tokens_per_s, rate)

    def observe_decode(self, tokens_after_first: int, seconds: float) -> None:
        if tokens_after_first > 0 and seconds > 0:
            rate = tokens_after_first / seconds
            self.decode_tokens_per_s = self._blend(self.decode_tokens_per_s, rate)

    def observe_completion(self, output_tokens: int, ticket: Ticket) -> None:
        if ticket.open_ended:
            self.open_ended_output_tokens = self._blend(
                self.open_ended_output_tokens, float(output_tokens))
        elif ticket.max_tokens > 0:
            fraction = min(1.0, output_tokens / ticket.max_tokens)
            self.output_fraction = self._blend(self.output_fraction, fraction)

    def expected_output_tokens(self, ticket: Ticket) -> float:
        """What `ticket` will likely generate: a share of max_tokens, or, when the client set
        none, the typical length of such answers (not the whole context it reserves)."""
        if ticket.open_ended:
            return min(float(ticket.max_tokens), self.open_ended_output_tokens)
        return ticket.max_tokens * self.output_fraction

    def service_seconds(self, ticket: Ticket) -> float:
        """Expected time from dispatch to the last token of `ticket`."""
        expected_output = max(1.0, self.expected_output_tokens(ticket))
        return (
            ticket.prompt_tokens / self.prefill_tokens_per_s
            + expected_output / self.decode_tokens_per_s
        )

    def first_token_seconds(self, ticket: Ticket) -> float:
        return ticket.prompt_tokens / self.prefill_tokens_per_s + 1.0 / self.decode_tokens_per_s
