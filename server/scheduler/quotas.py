"""Per-tenant limits checked at admission: requests in flight and tokens per rolling minute.

Plain values and `now` passed in, like the rest of the core. The tenant's share of a class
queue is checked beside them, by admission (`admission.py`), which reads the queues.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from server.core.config import TenantConfig
from server.scheduler.types import Ticket

QUOTA_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class QuotaRefusal:
    message: str
    retry_after: float


class TokenWindow:
    """Tokens a tenant was admitted for over the last minute."""

    def __init__(self) -> None:
        self._entries: deque[tuple[float, int]] = deque()
        self.total = 0

    def trim(self, now: float) -> None:
        while self._entries and self._entries[0][0] <= now - QUOTA_WINDOW_S:
            self.total -= self._entries.popleft()[1]

    def add(self, now: float, tokens: int) -> None:
        self._entries.append((now, tokens))
        self.total += tokens

    def seconds_until_room(self, now: float, tokens: int, limit: int) -> float:
        excess = self.total + tokens - limit
        for time, amount in self._entries:
            excess -= amount
            if excess <= 0:
                return time + QUOTA_WINDOW_S - now
        return QUOTA_WINDOW_S


class TenantQuotas:
    """`max_concurrent` (queued + running) and `tokens_per_minute` (prompt + max_tokens)."""

    def __init__(self, tenants: Mapping[str, TenantConfig]) -> None:
        self._tenants = tenants
        self._active: dict[str, int] = {}
        self._windows: dict[str, TokenWindow] = {}

    def check(self, ticket: Ticket, now: float, *, share: int = 1) -> QuotaRefusal | None:
        """A refusal if admitting `ticket` would pass `1 / share` of a limit (at least 1)."""
        tenant = self._tenants.get(ticket.tenant)
        if tenant is None:
            return None
        if tenant.max_concurrent is not None:
            limit = max(1, tenant.max_concurrent // share)
            active = self._active.get(ticket.tenant, 0)
            if active >= limit:
                return QuotaRefusal(
                    f"tenant {ticket.tenant!r} has {active} requests in flight, "
                    f"its limit is {limit}",
                    retry_after=1.0,
                )
        if tenant.tokens_per_minute is not None:
            limit = max(1, tenant.tokens_per_minute // share)
            window = self._windows.setdefault(ticket.tenant, TokenWindow())
            window.trim(now)
            if window.total + ticket.reserved_tokens > limit:
                wait = window.seconds_until_room(now, ticket.reserved_tokens, limit)
                return QuotaRefusal(
                    f"tenant {ticket.tenant!r} exceeded {limit} tokens per minute",
                    retry_after=max(1.0, wait),
                )
        return None

    def admitted(self, ticket: Ticket, now: float) -> None:
        self._active[ticket.tenant] = self._active.get(ticket.tenant, 0) + 1
        tenant = self._tenants.get(ticket.tenant)
        if tenant is not None and tenant.tokens_per_minute is not None:
            window = self._windows.setdefault(ticket.tenant, TokenWindow())
            window.trim(now)  # (admissions may come without checks: kept to the minute)
            window.add(now, ticket.reserved_tokens)

    def ended(self, ticket: Ticket) -> None:
        left = self._active[ticket.tenant] - 1
        if left:
            self._active[ticket.tenant] = left
        else:
            del self._active[ticket.tenant]
