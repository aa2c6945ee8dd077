"""Preempting running bulk for a chat that waited too long, in virtual time."""

from __future__ import annotations

from dataclasses import replace

import pytest

from server.core.config import ConfigError, parse_config
from server.scheduler.core import SchedulerCore
from server.scheduler.types import PreemptCause

from .helpers import BULK, admit, config, core, ids, ticket

# No interactive reserve and no bulk floor: bulk may fill every sequence, and a chat can only
# start by preempting it. Four sequences, preemption after 500 ms.
FULL_OF_BULK = {
    "budgets": {
        "interactive_reserve_share": 0.0,
        "bulk_min_share": 0.0,
        "preempt_bulk_after_ms": 500,
    }
}


def busy_with_bulk(n: int = 4, **budgets: object) -> SchedulerCore:
    cfg = config(budgets={**FULL_OF_BULK["budgets"], **budgets})
    s = core(cfg, sequences=4)
    for i in range(n):
        admit(s, ticket(f"bulk{i}", at=0.25 * i, traffic_class=BULK, max_tokens=100))
        s.poll(0.25 * i)
    return s


def test_a_chat_preempts_the_latest_bulk_once_it_has_waited_the_threshold() -> None:
    s = busy_with_bulk()
    admit(s, ticket("chat", at=1.0))
    step = s.poll(1.0)
    assert step.started == []
    assert step.wake_at == 1.5
    assert s.poll(1.499).preempted == []
    victims = s.poll(1.5).preempted
    assert ids(victims) == ["bulk3"]  # most recently dispatched, and one is enough
    assert s.preempted_for[PreemptCause.WAITING_CHAT] == 1
    assert s.poll(1.5).preempted == []  # named once
    assert s.stage("bulk3") == "running"  # holds its budget until the shell requeues it
    s.generated("bulk3", 40, 1.5)
    continuation = s.requeue("bulk3", 1.5)
    assert continuation is not None
    assert (continuation.prompt_tokens, continuation.max_tokens) == (10 + 40, 60)
    assert (continuation.arrival, continuation.deadline) == (0.75, 1000.0)
    assert ids(s.poll(1.5).started) == ["chat"]
    assert s.stage("bulk3") == "queued"
    s.release("chat", 2.0, completed=True)
    assert ids(s.poll(2.0).started) == ["bulk3"]
    assert s.running_tickets()[-1].max_tokens == 60
    assert s.preemptions_total == 1


def test_bulk_that_could_not_resume_is_never_preempted() -> None:
    # bulk3, the cheapest to stop, is constrained (a grammar would restart on resuming): the
    # chat gets bulk2's seat instead, and bulk3 runs on.
    cfg = config(budgets=FULL_OF_BULK["budgets"])
    s = core(cfg, sequences=4)
    for i in range(4):
        admit(
            s,
            replace(
                ticket(f"bulk{i}", at=0.25 * i, traffic_class=BULK, max_tokens=100),
                preemptible=i != 3,
            ),
        )
        s.poll(0.25 * i)
    admit(s, ticket("chat", at=1.0))
    assert ids(s.poll(1.5).preempted) == ["bulk2"]


def test_just_enough_bulk_is_preempted_for_the_chat_to_fit() -> None:
    s = core(config(**FULL_OF_BULK), tokens=400, sequences=8)
    for i in range(3):  # each holds 110 tokens (10 prompt + 100 max_tokens): 70 stay free
        admit(s, ticket(f"bulk{i}", at=0.1 * i, traffic_class=BULK, max_tokens=100))
        s.poll(0.1 * i)
    admit(s, ticket("chat", at=1.0, prompt=50, max_tokens=200))  # needs 250
    assert s.poll(1.0).started == []
    assert ids(s.poll(1.5).preempted) == ["bulk2", "bulk1"]  # 70 + 110 + 110 >= 250


def test_preemption_never_cuts_bulk_below_its_minimum_share() -> None:
    s = busy_with_bulk(bulk_min_share=0.5)  # 2 of 4 sequences stay with bulk
    admit(s, ticket("chat1", at=1.0))
    admit(s, ticket("chat2", at=1.0))
    admit(s, ticket("chat3", at=1.0))
    assert ids(s.poll(1.5).preempted) == ["bulk3"]
    s.generated("bulk3", 1, 1.5)
    s.requeue("bulk3", 1.5)
    step = s.poll(1.5)
    assert ids(step.started) == ["chat1"]
    # chat2 is the head now, past its threshold too: stopping bulk2 leaves bulk two sequences.
    assert ids(step.preempted) == ["bulk2"]
    s.generated("bulk2", 1, 1.5)
    s.requeue("bulk2", 1.5)
    assert ids(s.poll(1.5).started) == ["chat2"]
    assert s.poll(2.5).preempted == []
    assert s.running_count(BULK) == 2


def test_no_preemption_when_the_chat_fits_or_no_bulk_runs() -> None:
    s = busy_with_bulk(n=3)
    admit(s, ticket("chat", at=1.0))
    assert ids(s.poll(1.0).started) == ["chat"]
    assert s.poll(5.0).preempted == []
    only_chats = core(config(**FULL_OF_BULK), sequences=1)
    admit(only_chats, ticket("a"))
    only_chats.poll(0.0)
    admit(only_chats, ticket("b"))
    assert only_chats.poll(0.0).wake_at == 1000.0  # b's deadline: nothing to preempt
    assert only_chats.poll(5.0).preempted == []


def test_preemption_can_be_switched_off() -> None:
    s = busy_with_bulk(preempt_bulk_after_ms=None)
    admit(s, ticket("chat", at=1.0))
    assert s.poll(1.0).wake_at == 1000.0  # the chat's deadline, no preemption time
    assert s.poll(100.0).preempted == []


def test_a_victim_that_finishes_before_it_is_requeued_simply_ends() -> None:
    s = busy_with_bulk()
    admit(s, ticket("chat", at=1.0))
    assert ids(s.poll(1.5).preempted) == ["bulk3"]
    s.generated("bulk3", 100, 1.51)
    assert s.release("bulk3", 1.51, completed=True) == "running"
    assert s.requeue("bulk3", 1.52) is None
    assert ids(s.poll(1.52).started) == ["chat"]


def test_a_continuation_still_expires_at_the_original_deadline() -> None:
    cfg = config(budgets=FULL_OF_BULK["budgets"])
    s = core(cfg, sequences=1)
    admit(s, ticket("bulk", traffic_class=BULK, max_tokens=100, deadline=3.0))
    s.poll(0.0)
    admit(s, ticket("chat", at=1.0, max_tokens=10))
    assert ids(s.poll(1.5).preempted) == ["bulk"]
    s.generated("bulk", 30, 1.5)
    s.requeue("bulk", 1.5)
    step = s.poll(1.5)
    assert ids(step.started) == ["chat"]
    assert step.wake_at == 3.0
    assert ids(s.poll(3.0).expired) == ["bulk"]
    s.release("chat", 3.1, completed=True)
    assert s.is_idle()


def test_requeue_refuses_a_request_with_nothing_left() -> None:
    s = busy_with_bulk()
    admit(s, ticket("chat", at=1.0))
    assert ids(s.poll(1.5).preempted) == ["bulk3"]
    s.generated("bulk3", 100, 1.5)  # its whole max_tokens: finished, not preempted
    with pytest.raises(ValueError):
        s.requeue("bulk3", 1.5)


def test_preempt_threshold_is_validated() -> None:
    assert parse_config({}).budgets.preempt_bulk_after_s == 0.5
    assert (
        parse_config({"budgets": {"preempt_bulk_after_ms": 0}}).budgets.preempt_bulk_after_s == 0.0
    )
    with pytest.raises(ConfigError):
        parse_config({"budgets": {"preempt_bulk_after_ms": -1}})
    with pytest.raises(ConfigError):
        parse_config({"budgets": {"preempt_bulk_after_ms": "soon"}})
