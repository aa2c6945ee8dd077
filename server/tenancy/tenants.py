"""Who is calling, and what their request is allowed to be: API key -> tenant -> Ticket.

Traffic class: the class the client asked for (the edge reads it from `X-Traffic-Class`)
wins, else OpenAI's `service_tier` (`flex` -> bulk; `auto`, `default`, `priority`, `scale` ->
interactive), else the tenant's default class. A class the tenant may not use is *downgraded*
to the tenant's default class rather than refused: a client that always sends `service_tier:
priority` still gets served, within what its tenant pays for. Deadline: the client's timeout
(`X-Request-Timeout-Ms` at the edge), else the class default.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from server.core.config import OPEN_TENANT, SluiceConfig, TenantConfig
from server.core.errors import InvalidRequest, TooManyFailedAttempts, Unauthorized
from server.scheduler.types import Ticket, TrafficClass

SERVICE_TIER_CLASSES: dict[str, TrafficClass] = {
    "flex": TrafficClass.BULK,
    "auto": TrafficClass.INTERACTIVE,
    "default": TrafficClass.INTERACTIVE,
    "priority": TrafficClass.INTERACTIVE,
    "scale": TrafficClass.INTERACTIVE,
}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    config: TenantConfig
    configured: bool  # named in the configuration (safe as a metric label)

    @property
    def metric_label(self) -> str:
        return self.name if self.configured else "other"

    @property
    def cache_salt(self) -> str | None:
        """vLLM's `cache_salt` for the tenant's requests: its own prefix cache (None: shared)."""
        if self.config.prefix_cache == "shared":
            return None
        return _salt(self.name)


@functools.lru_cache(maxsize=256)
def _salt(tenant: str) -> str:  # (a hash per request otherwise; tenants are few)
    return hashlib.sha256(f"sluice-tenant:{tenant}".encode()).hexdigest()[:32]


def requested_class(service_tier: str | None, asked: TrafficClass | None) -> TrafficClass | None:
    """The class the client asked for, or None when it did not say."""
    if asked is not None:
        return asked
    if service_tier is not None:
        try:
            return SERVICE_TIER_CLASSES[service_tier]
        except KeyError:
            raise InvalidRequest(
                f"unsupported service_tier {service_tier!r}", param="service_tier"
            ) from None
    return None


class FailedAttempts:
    """Failed authentications per client address over a sliding window. An address with
    `limit` failures in `window_s` is refused until the oldest ages out, whatever key it
    sends, so the refusal tells nothing about any key. At most `max_clients` addresses are
    remembered (the least recent forgotten first)."""

    def __init__(self, limit: int = 10, window_s: float = 60.0, max_clients: int = 10_000) -> None:
        self.limit = limit
        self.window_s = window_s
        self.max_clients = max_clients
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def blocked_for(self, client: str | None, now: float) -> float | None:
        """Seconds until `client` may try again; None if it may now."""
        failures = self._failures.get(client or "")
        if failures is None:
            return None
        while failures and now - failures[0] > self.window_s:
            failures.popleft()
        if len(failures) < self.limit:
            return None
        return self.window_s - (now - failures[0])

    def failed(self, client: str | None, now: float) -> None:
        key = client or ""
        failures = self._failures.pop(key, None) or deque()
        failures.append(now)
        while len(failures) > self.limit:
            failures.popleft()
        self._failures[key] = failures
        while len(self._failures) > self.max_clients:
            self._failures.popitem(last=False)


class TenantDirectory:
    def __init__(self, config: SluiceConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self.failed_attempts = FailedAttempts()
        # Every accepted key as a digest: a key is checked against each of them in full,
        # whichever matches, and plain keys are not kept beyond the configuration.
        self._digests = [
            (bytes.fromhex(digest), tenant) for digest, tenant in config.digest_tenants.items()
        ]
        self._digests += [
            (hashlib.sha256(key.encode()).digest(), tenant)
            for key, tenant in config.key_tenants.items()
        ]
        self._tenants = {
            name: Tenant(name, tenant_config, configured=True)
            for name, tenant_config in config.tenants.items()
        }
        # Tickets made in a class other than the one asked for, by (tenant label, asked).
        self.downgrades: Counter[tuple[str, TrafficClass]] = Counter()

    @property
    def is_open(self) -> bool:
        return self._config.is_open

    def tenant(self, name: str) -> Tenant:
        """The configured tenant `name`. Unauthorized: there is none (a batch or a resumable
        run made by a tenant since removed from the configuration)."""
        found = self._tenants.get(name)
        if found is None:
            raise Unauthorized(f"tenant {name!r} is no longer in the configuration")
        return found

    def metric_labels(self) -> tuple[str, ...]:
        """Every tenant label a metric may carry, besides "other"."""
        return tuple(t.metric_label for t in self._tenants.values())

    def authenticate(self, api_key: str | None, client: str | None = None) -> Tenant:
        """The tenant an API key belongs to; the open tenant when no keys are configured.

        A `client` address with too many failures lately is refused (429) before its key is
        looked at."""
        if self._config.is_open:
            return self._tenants[OPEN_TENANT]
        now = self._clock()
        wait = self.failed_attempts.blocked_for(client, now)
        if wait is not None:
            raise TooManyFailedAttempts(
                "too many failed authentications from this address; retry later",
                retry_after=max(1.0, wait),
            )
        if not api_key:
            self.failed_attempts.failed(client, now)
            raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'")
        presented = hashlib.sha256(api_key.encode()).digest()
        found = None
        for digest, tenant in self._digests:  # no early exit: the same work for every key
            if hmac.compare_digest(digest, presented):
                found = tenant
        if found is None:
            self.failed_attempts.failed(client, now)
            raise Unauthorized("invalid API key")
        return self._tenants[found]

    def traffic_class(
        self, tenant: Tenant, service_tier: str | None, asked: TrafficClass | None
    ) -> TrafficClass:
        wanted = requested_class(service_tier, asked)
        if wanted is None or wanted not in tenant.config.allowed_classes:
            return tenant.config.default_class
        return wanted

    def make_ticket(
        self,
        *,
        tenant: Tenant,
        request_id: str,
        model: str,
        service_tier: str | None,
        asked_class: TrafficClass | None,
        timeout_s: float | None,
        prompt_tokens: int,
        max_tokens: int,
        open_ended: bool = False,
        arrival: float,
        preemptible: bool = True,
        n: int = 1,
        adapter: str | None = None,
    ) -> Ticket:
        traffic_class = self.traffic_class(tenant, service_tier, asked_class)
        wanted = requested_class(service_tier, asked_class)
        if wanted is not None and wanted is not traffic_class:
            self.downgrades[tenant.metric_label, wanted] += 1
        timeout = (
            timeout_s if timeout_s is not None else (self._config.classes[traffic_class].deadline_s)
        )
        return Ticket(
            request_id=request_id,
            tenant=tenant.name,
            traffic_class=traffic_class,
            model=model,
            arrival=arrival,
            deadline=arrival + timeout,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            open_ended=open_ended,
            preemptible=preemptible,
            n=n,
            adapter=adapter,
        )
