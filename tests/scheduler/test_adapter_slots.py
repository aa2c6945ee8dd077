"""LoRA adapter slots as a budget, in virtual time: never more distinct adapters running than
slots, chats first across adapters, bulk on one adapter stopped for another adapter's chat,
and bulk's turns at the slots."""

from __future__ import annotations

import itertools

from server.scheduler.adapters import ADAPTER_TURN_S
from server.scheduler.core import SchedulerCore
from server.scheduler.types import PreemptCause

from .helpers import BULK, admit, config, core, ids, ticket

# No interactive reserve and no bulk floor: the slots alone decide who waits.
OPEN = {"interactive_reserve_share": 0.0, "bulk_min_share": 0.0}


def slotted(slots: int) -> SchedulerCore:
    return core(config(budgets=OPEN), sequences=16, adapter_slots=slots)


def running_adapters(s: SchedulerCore) -> set[str | None]:
    return {t.adapter for t in s.running_tickets()}


def test_no_more_distinct_adapters_run_than_there_are_slots() -> None:
    s = slotted(2)
    for name, adapter in [("a1", "a"), ("b1", "b"), ("c1", "c"), ("base", None)]:
        admit(s, ticket(name, adapter=adapter))
    # c waits for a slot, and the chats behind it wait their turn (its turn is not skipped).
    assert ids(s.poll(0.0).started) == ["a1", "b1"]
    admit(s, ticket("a2", at=0.5, adapter="a"))
    assert s.poll(0.5).started == []  # on a running adapter, but behind c
    assert running_adapters(s) == {"a", "b"}
    s.release("a1", 1.0, completed=True)
    # a's slot is free: c's chat takes it; a's second chat now needs a slot of its own.
    assert ids(s.poll(1.0).started) == ["c1", "base"]
    assert running_adapters(s) == {"b", "c", None}
    s.release("b1", 2.0, completed=True)
    assert ids(s.poll(2.0).started) == ["a2"]
    assert s.slots.in_use() == 2


def test_a_chat_on_another_adapter_stops_the_bulk_that_holds_the_only_slot() -> None:
    s = slotted(1)
    for i in range(3):
        admit(s, ticket(f"bulk{i}", traffic_class=BULK, adapter="a", max_tokens=100))
    assert ids(s.poll(0.0).started) == ["bulk0", "bulk1", "bulk2"]
    admit(s, ticket("chat", at=1.0, adapter="b"))
    step = s.poll(1.0)
    assert step.started == []
    assert sorted(ids(step.preempted)) == ["bulk0", "bulk1", "bulk2"]  # at once, every one
    assert s.preempted_for[PreemptCause.ADAPTER_SLOT] == 3
    assert s.poll(1.0).preempted == []  # named once: its slot is being freed
    for i in range(3):
        s.generated(f"bulk{i}", 10, 1.0)
        s.requeue(f"bulk{i}", 1.0)
    assert ids(s.poll(1.0).started) == ["chat"]
    # The chat holds the slot: bulk on `a` waits, as bulk waits for chats today.
    assert s.poll(1.5).started == []
    s.release("chat", 2.0, completed=True)
    s.poll(2.0)
    s.poll(100.0)  # (past the bulk hold after the last chat)
    assert sorted(ids(s.running_tickets())) == ["bulk0", "bulk1", "bulk2"]


def test_bulk_takes_no_free_slot_while_a_chat_waits() -> None:
    s = core(config(budgets=OPEN), sequences=2, adapter_slots=2)
    admit(s, ticket("chat-a", adapter="a"))
    admit(s, ticket("chat-b", adapter="b"))
    assert ids(s.poll(0.0).started) == ["chat-a", "chat-b"]
    admit(s, ticket("chat-c", at=0.5, adapter="c"))  # waits for a seat (and a slot)
    admit(s, ticket("bulk", at=0.5, traffic_class=BULK, adapter="d"))
    s.release("chat-a", 1.0, completed=True)
    assert ids(s.poll(1.0).started) == ["chat-c"]  # not the bulk, though it came first to it
    s.release("chat-b", 2.0, completed=True)
    assert ids(s.poll(2.0).started) == ["bulk"]


def test_a_slot_a_chat_holds_is_not_taken_from_it_for_another_chat() -> None:
    s = slotted(1)
    admit(s, ticket("chat-a", adapter="a", max_tokens=100))
    admit(s, ticket("bulk-a", traffic_class=BULK, adapter="a", max_tokens=100))
    assert ids(s.poll(0.0).started) == ["chat-a", "bulk-a"]
    admit(s, ticket("chat-b", at=0.5, adapter="b"))
    assert s.poll(0.5).preempted == []  # a chat holds the slot: nothing to stop
    s.release("chat-a", 1.0, completed=True)
    # Now only bulk holds it: that stops for the waiting chat.
    assert ids(s.poll(1.0).preempted) == ["bulk-a"]


def test_bulk_that_could_not_resume_keeps_its_slot() -> None:
    s = slotted(1)
    admit(s, ticket("bulk", traffic_class=BULK, adapter="a", preemptible=False))
    s.poll(0.0)
    admit(s, ticket("chat", at=1.0, adapter="b"))
    assert s.poll(1.0).preempted == []
    s.release("bulk", 2.0, completed=True)
    assert ids(s.poll(2.0).started) == ["chat"]


def test_bulk_lines_take_turns_at_one_slot() -> None:
    s = slotted(1)
    for i in range(100):
        admit(s, ticket(f"a{i}", traffic_class=BULK, adapter="a", prompt=50, max_tokens=50))
        admit(s, ticket(f"c{i}", traffic_class=BULK, adapter="c", prompt=50, max_tokens=50))
    started: list[tuple[float, str]] = []
    dispatched: dict[str, float] = {}
    now = 0.0
    # Each request runs 3 s, so `a` always has one running: while c waits for the slot, `a`
    # goes on starting for a turn, then stops, ends, and c gets the slot for its turn.
    while len(started) < 160:
        for t in s.poll(now).started:
            started.append((now, t.adapter or ""))
            dispatched[t.request_id] = now
        assert len(running_adapters(s)) <= 1
        now += 1.0
        for t in s.running_tickets():
            if now - dispatched[t.request_id] >= 3.0:
                s.release(t.request_id, now, completed=True)
    turns = [
        (adapter, [at for at, _ in group])
        for adapter, group in itertools.groupby(started, key=lambda item: item[1])
    ]
    assert [adapter for adapter, _ in turns][:4] == ["a", "c", "a", "c"]
    for _, times in turns[:-1]:  # every whole turn lasts the turn, at least
        assert times[-1] - times[0] >= ADAPTER_TURN_S
    a = sum(adapter == "a" for _, adapter in started)
    longest = max(len(times) for _, times in turns)
    assert abs(a - (len(started) - a)) <= longest


def test_while_a_chat_waits_for_a_slot_bulk_starts_on_the_base_model_only() -> None:
    # Bulk keeps three of four seats while chats wait: room for two more beside `bulk-a`.
    floor = {**OPEN, "bulk_min_share": 0.75}
    s = core(config(budgets=floor), sequences=4, adapter_slots=1)
    admit(s, ticket("bulk-a", traffic_class=BULK, adapter="a", preemptible=False))
    assert ids(s.poll(0.0).started) == ["bulk-a"]
    admit(s, ticket("chat-b", at=1.0, adapter="b"))  # waits: `a`'s bulk cannot be stopped
    admit(s, ticket("more-a", at=1.0, traffic_class=BULK, adapter="a"))
    admit(s, ticket("base", at=1.0, traffic_class=BULK, tenant="other"))
    # More bulk on `a` would only hold the slot longer; the base model's takes none.
    assert ids(s.poll(1.0).started) == ["base"]
    s.release("bulk-a", 2.0, completed=True)
    assert ids(s.poll(2.0).started) == ["chat-b"]


def test_bulk_leaves_the_last_chats_slot_free_until_the_bulk_hold_ends() -> None:
    s = slotted(2)
    admit(s, ticket("chat-a", adapter="a"))
    admit(s, ticket("bulk-b", traffic_class=BULK, adapter="b", preemptible=False))
    assert ids(s.poll(0.0).started) == ["chat-a", "bulk-b"]
    admit(s, ticket("bulk-c", at=0.5, traffic_class=BULK, adapter="c", max_tokens=100))
    s.release("chat-a", 1.0, completed=True)
    # a's slot is free, but chats on `a` are still about: bulk on `c` would be stopped for
    # the next one.
    assert s.poll(1.0).started == []
    admit(s, ticket("chat-a2", at=1.5, adapter="a"))
    step = s.poll(1.5)
    assert ids(step.started) == ["chat-a2"]
    assert step.preempted == []
    s.release("chat-a2", 2.0, completed=True)
    s.poll(2.0)
    # After the hold, bulk takes the slot.
    assert ids(s.poll(100.0).started) == ["bulk-c"]


def test_bulk_on_the_chats_adapter_takes_its_slot_with_them() -> None:
    s = slotted(2)
    admit(s, ticket("chat-a", adapter="a"))
    admit(s, ticket("bulk-b", traffic_class=BULK, adapter="b", preemptible=False))
    s.poll(0.0)
    s.release("chat-a", 1.0, completed=True)
    admit(s, ticket("bulk-a", at=1.0, traffic_class=BULK, adapter="a"))
    # It shares the slot the chats' next one would take: nothing to stop for it.
    assert ids(s.poll(1.0).started) == ["bulk-a"]
