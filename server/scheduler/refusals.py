"""The schedulers' refusals as the client's errors: the one map from a reason to its class.

The cores decide and name a `RejectReason`; they know nothing of HTTP. The shells (the asyncio
runtimes, the simulator) ask here which error answers it.
"""

from __future__ import annotations

from server.core.errors import (
    DeadlineUnmeetable,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    SluiceError,
    TenantQuotaExceeded,
)
from server.scheduler.types import RejectReason

REFUSALS: dict[RejectReason, type[SluiceError]] = {
    RejectReason.OVERLOADED: Overloaded,
    RejectReason.TENANT_QUOTA_EXCEEDED: TenantQuotaExceeded,
    RejectReason.DEADLINE_UNMEETABLE: DeadlineUnmeetable,
    RejectReason.REQUEST_TOO_LARGE: InvalidRequest,
    RejectReason.NO_COMPATIBLE_WORKER: ModelNotFound,
    RejectReason.DUPLICATE_ID: InvalidRequest,
}


def refusal_error(
    reason: RejectReason, message: str, retry_after: float | None = None
) -> SluiceError:
    """The error a client gets for a ticket refused for `reason`."""
    return REFUSALS[reason](message, retry_after=retry_after)
