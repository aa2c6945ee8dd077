"""Small builders shared by the scheduler tests (virtual time: plain floats)."""

from __future__ import annotations

from typing import Any

from server.core.config import SluiceConfig, parse_config
from server.scheduler.budgets import BudgetLimits
from server.scheduler.core import Admitted, SchedulerCore
from server.scheduler.types import Ticket, TrafficClass

CHAT = TrafficClass.INTERACTIVE
BULK = TrafficClass.BULK

# Rate priors so optimistic that admission never predicts a deadline miss.
OPTIMISTIC: dict[str, Any] = {
    "estimates": {"decode_tokens_per_s": 1e9, "prefill_tokens_per_s": 1e9}
}


def config(**sections: Any) -> SluiceConfig:
    return parse_config({**OPTIMISTIC, **sections})


def core(
    cfg: SluiceConfig | None = None,
    *,
    tokens: int = 10_000,
    kv_blocks: int = 10_000,
    sequences: int = 100,
    block_size: int = 16,
    adapter_slots: int = 0,
) -> SchedulerCore:
    return SchedulerCore(
        cfg or config(),
        BudgetLimits(tokens, kv_blocks, sequences, block_size, adapter_slots=adapter_slots),
    )


def ticket(
    request_id: str,
    *,
    at: float = 0.0,
    deadline: float = 1000.0,
    traffic_class: TrafficClass = CHAT,
    tenant: str = "default",
    prompt: int = 10,
    max_tokens: int = 10,
    open_ended: bool = False,
    adapter: str | None = None,
    preemptible: bool = True,
) -> Ticket:
    return Ticket(
        request_id,
        tenant,
        traffic_class,
        "m",
        at,
        deadline,
        prompt,
        max_tokens,
        open_ended,
        preemptible=preemptible,
        adapter=adapter,
    )


def admit(scheduler: SchedulerCore, t: Ticket, now: float | None = None) -> None:
    decision = scheduler.submit(t, t.arrival if now is None else now)
    assert isinstance(decision, Admitted), decision


def ids(tickets: list[Ticket]) -> list[str]:
    return [t.request_id for t in tickets]
