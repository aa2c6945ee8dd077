"""The engine's LoRA slots as a budget: the most distinct adapters that run at once.

An engine runs a step's sequences on at most `slots` distinct adapters (vLLM's `max_loras`);
a sequence on any other adapter waits inside it, where Sluice cannot order it, and a bulk flood
that holds every slot keeps a chat on another adapter waiting for as long as the flood lasts.
So a ticket on an adapter starts only where its adapter already runs or a slot is free, and
the scheduler decides who gets a slot: chats first (a chat waiting for a slot stops the bulk
that holds one), then bulk, and within a class the queues' turns (flows of a tenant and an
adapter) share the slots. Base-model tickets hold none.
"""

from __future__ import annotations

from server.scheduler.types import INTERACTIVE, Ticket


class AdapterSlots:
    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._sequences: dict[str, int] = {}  # running sequences on each adapter
        self._chats: dict[str, int] = {}  # of which interactive

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


def _take(counts: dict[str, int], adapter: str, n: int) -> None:
    left = counts[adapter] - n
    if left < 0:
        raise AssertionError(f"adapter {adapter!r} released below zero")
    if left:
        counts[adapter] = left
    else:
        del counts[adapter]
