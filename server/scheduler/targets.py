"""The latency targets a ticket is judged by: its tenant's own, over its class's.

Interactive targets are the bulk cap's (`bulk_cap.py`: stated in milliseconds, or derived from
the engine when nearly idle, a chat on a LoRA adapter's from its adapter's own idle step and
first token), so they move as the estimates do; a tenant's own replace them one by one. Bulk
has targets only where the configuration states them (none: never steered for, and the
simulator and the metrics judge it by completion alone).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from server.core.config import SloConfig, TenantConfig
from server.scheduler.bulk_cap import BulkCap
from server.scheduler.slo import SloTargets
from server.scheduler.types import BULK, Ticket


class Targets:
    def __init__(
        self, slo: SloConfig, tenants: Mapping[str, TenantConfig], bulk_cap: BulkCap
    ) -> None:
        stated = slo.bulk
        self._bulk = (
            None
            if stated.ttft_s is None and stated.itl_s is None
            else SloTargets(stated.ttft_s or math.inf, stated.itl_s or math.inf)
        )
        self._tenants = tenants
        self._bulk_cap = bulk_cap

    def of(self, ticket: Ticket) -> SloTargets | None:
        """The targets `ticket` is judged by now (None: a class without targets)."""
        if ticket.traffic_class is BULK:
            return self._bulk
        targets = self._bulk_cap.targets(ticket.adapter)
        tenant = self._tenants.get(ticket.tenant)
        own = None if tenant is None else tenant.slo
        if own is None:
            return targets
        return SloTargets(own.ttft_s or targets.ttft_s, own.itl_s or targets.itl_s)
