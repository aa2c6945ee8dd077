"""The engine's LoRA slots as a budget: the most distinct adapters that run at once.

An engine runs a step's sequences on at most `slots` distinct adapters (vLLM's `max_loras`);
a sequence on any other adapter waits inside it, where Sluice cannot order it, and a bulk flood
that holds every slot keeps a chat on another adapter waiting for as long as the flood lasts.
So a ticket on an adapter starts only where its adapter already runs or a slot is free, and
the scheduler decides who gets a slot: chats first (a chat waiting for a slot stops the bulk
that holds one), then bulk, and within a class the queues' turns (flows of a tenant and an
adapter) share the slots. Base-model tickets hold none.

Bulk whose head needs a slot it cannot have does not stall behind it: the first line's head
that needs no slot starts instead (`bulk_head`), for `ADAPTER_TURN_S`, then only the base
model's, so that the adapters that hold the slots end their turn and one frees. Stopping bulk
for a chat that waits for a slot is preemption's (`preemption.py`).
"""

from __future__ import annotations

from collections.abc import Collection

from server.scheduler.queues import TenantFairQueue
from server.scheduler.types import INTERACTIVE, Ticket

# While bulk's head waits for an adapter slot, bulk on the adapters that hold the slots goes on
# starting for this long, then stops starting, so that they end and free one (`_bulk_instead`).
ADAPTER_TURN_S = 10.0


def on_base_model(ticket: Ticket) -> bool:
    return ticket.adapter is None


class AdapterSlots:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._sequences: dict[str, int] = {}  # running sequences on each adapter
        self._chats: dict[str, int] = {}  # of which interactive
        self._bulk_waits_since: float | None = None  # bulk's head has waited for a slot

    def fits(self, ticket: Ticket) -> bool:
        """Whether `ticket` may start now: on the base model, on an adapter that runs, or with
        a slot free."""
        adapter = ticket.adapter
        return adapter is None or adapter in self._sequences or len(self._sequences) < self.slots

    def resident(self, ticket: Ticket) -> bool:
        """Whether `ticket` starts without taking a slot (base model, or its adapter runs)."""
        return ticket.adapter is None or ticket.adapter in self._sequences

    def acquire(self, ticket: Ticket) -> None:
        adapter = ticket.adapter
        if adapter is None:
            return
        self._sequences[adapter] = self._sequences.get(adapter, 0) + ticket.n
        if ticket.traffic_class is INTERACTIVE:
            self._chats[adapter] = self._chats.get(adapter, 0) + ticket.n

    def release(self, ticket: Ticket) -> None:
        adapter = ticket.adapter
        if adapter is None:
            return
        _take(self._sequences, adapter, ticket.n)
        if ticket.traffic_class is INTERACTIVE:
            _take(self._chats, adapter, ticket.n)

    def held_by_bulk_only(self) -> list[str]:
        """Adapters whose slot only bulk holds: those a waiting chat may take it from."""
        return [adapter for adapter in self._sequences if adapter not in self._chats]

    def in_use(self) -> int:
        return len(self._sequences)

    def running(self) -> Collection[str]:
        """The adapters sequences run on."""
        return self._sequences.keys()

    def bulk_head(
        self,
        bulk: TenantFairQueue,
        chat_head: Ticket | None,
        now: float,
        kept: Collection[str],
    ) -> Ticket | None:
        """The bulk ticket to start next, if bulk's other limits allow, while `chat_head` (if
        any) waits: bulk's head, unless it needs a slot. A free slot is a chat's first: while a
        chat waits for one, bulk starts on the base model only (bulk started on an adapter now
        would only be stopped for the chat), and bulk takes a free slot only while no chat
        waits, and only one that leaves a slot for each adapter of `kept` that does not run
        (those of the chats about, `BulkAllowance.slots_kept`). A head that needs a slot it
        cannot have waits (`_bulk_instead`)."""
        head = bulk.peek()
        if head is None or head.adapter is None:
            self._bulk_waits_since = None  # it waits for no slot
            return head
        if chat_head is not None and not self.fits(chat_head):
            return bulk.first(on_base_model)
        if self.resident(head) or (chat_head is None and self._free_for_bulk(head, kept)):
            self._bulk_waits_since = None  # it waits for no slot
            return head
        return self._bulk_instead(bulk, now)

    def _free_for_bulk(self, head: Ticket, kept: Collection[str]) -> bool:
        running = self._sequences
        wanted = sum(1 for a in kept if a not in running and a != head.adapter)
        return len(running) + wanted < self.slots

    def _bulk_instead(self, bulk: TenantFairQueue, now: float) -> Ticket | None:
        """What bulk starts while its head waits for an adapter slot: for `ADAPTER_TURN_S`,
        the first line's head that needs no slot (the base model's, or an adapter's that runs):
        the slots stay busy. Then only the base model's, so that the adapters that hold the
        slots end their turn and one frees (a line that always had a request waiting would
        otherwise keep its slot for ever)."""
        if self._bulk_waits_since is None:
            self._bulk_waits_since = now
        if now - self._bulk_waits_since < ADAPTER_TURN_S:
            return bulk.first(self.resident)
        return bulk.first(on_base_model)


def _take(counts: dict[str, int], adapter: str, n: int) -> None:
    left = counts[adapter] - n
    if left < 0:
        raise AssertionError(f"adapter {adapter!r} released below zero")
    if left:
        counts[adapter] = left
    else:
        del counts[adapter]
