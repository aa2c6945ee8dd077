"""The queued work a new request would wait behind, by traffic class and tenant.

Kept in tokens (prompt tokens to prefill, output tokens expected to decode) and turned into time
only when asked, with the estimates of that moment: requests queued while the engine looked fast
are judged by how fast it is now.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.scheduler.types import BULK, INTERACTIVE, Ticket, TrafficClass

_CLASSES = tuple(TrafficClass)  # iterating the enum itself runs Python code at each call


@dataclass(slots=True)
class _Work:
    requests: int = 0
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0


class Backlog:
    def __init__(self) -> None:
        self._by_class: dict[TrafficClass, dict[str, _Work]] = {c: {} for c in TrafficClass}
        self._expected_output: dict[str, float] = {}

    def add(self, ticket: Ticket, expected_output: float) -> None:
        self._expected_output[ticket.request_id] = expected_output
        by_tenant = self._by_class[ticket.traffic_class]
        work = by_tenant.get(ticket.tenant)
        if work is None:  # (not setdefault: that would build one for every request)
            work = by_tenant[ticket.tenant] = _Work()
        work.requests += 1
        work.prompt_tokens += ticket.prompt_tokens
        work.output_tokens += expected_output

    def remove(self, ticket: Ticket) -> float:
        """Take `ticket` out; returns the output tokens it was expected to generate."""
        expected_output = self._expected_output.pop(ticket.request_id)
        by_tenant = self._by_class[ticket.traffic_class]
        work = by_tenant[ticket.tenant]
        work.requests -= 1
        if work.requests == 0:
            del by_tenant[ticket.tenant]  # and with it any rounding left in its sums
        else:
            work.prompt_tokens -= ticket.prompt_tokens
            work.output_tokens -= expected_output
        return expected_output

    def seconds_ahead(
        self,
        traffic_class: TrafficClass,
        tenant: str | None,
        own_seconds: float,
        prefill_tokens_per_s: float,
        step_s: float,
    ) -> float:
        """Sequence-seconds queued ahead of a new request of `tenant` in `traffic_class`: each
        line's prompt tokens at `prefill_tokens_per_s`, and its output tokens at `step_s` each.

        All queued interactive work is ahead of bulk. Inside its own class, tenants share by
        fair queueing: the request waits for its own tenant's line, and meanwhile each other
        tenant is served about as much (that line plus the request's own `own_seconds`), not
        its whole backlog. `tenant=None` asks for everything queued ahead, first come first
        served.
        """
        total = 0.0
        for tc in _CLASSES:
            if tc is BULK and traffic_class is INTERACTIVE:
                break
            by_tenant = self._by_class[tc]
            # Sums kept as sum() keeps them (from 0, in order), without a generator's cost.
            lines: float = 0
            if tc is not traffic_class or tenant is None:
                for w in by_tenant.values():
                    lines += w.prompt_tokens / prefill_tokens_per_s + w.output_tokens * step_s
                total += lines
                continue
            own = by_tenant.get(tenant)
            own_line = (
                own.prompt_tokens / prefill_tokens_per_s + own.output_tokens * step_s
                if own
                else 0.0
            )
            total += own_line
            share = own_line + own_seconds
            for name, w in by_tenant.items():
                if name != tenant:
                    line = w.prompt_tokens / prefill_tokens_per_s + w.output_tokens * step_s
                    lines += min(share, line)
            total += lines
        return total
