"""Conversations shared by replicas through a real `redis-server` (`--state-url`): two real
Sluice servers (sim engine, in this process) on the session's Redis, called with the official
`openai` SDK: a conversation made on one is read, continued and held on the other, and is none
of another tenant's there; a background response on a conversation, followed on the other
replica and handed over to it when its own stops, holds the conversation there past its
lease and adds its items once, at its end."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from conftest import (
    InProcessSluice,
    RedisProcess,
    SluiceProcess,
    all_ready,
    api_keys_env,
    uncalibrated_config,
    wait_until,
)
from test_conversations_api import DEADLINE_S, KEYS, client_of, held, listed, refusal, serve, texts

if TYPE_CHECKING:
    import openai

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("conversations")]


ENV = api_keys_env(KEYS)


def replica_args(root: Path, redis: RedisProcess, config: str = "") -> list[str]:
    """A replica's arguments: the sim engine at ~10 ms a step, on `redis`."""
    return [
        "--engine",
        "sim",
        "--sim-step-base-ms",
        "10",
        "--config",
        str(uncalibrated_config(root, config)),
        "--state-url",
        redis.url,
    ]


@pytest.fixture(scope="module")
def replicas(
    session_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[InProcessSluice]]:
    root = tmp_path_factory.mktemp("conversation-replicas")
    started = [serve(root, "--state-url", session_redis.url, log=f"{name}.log") for name in "ab"]
    with all_ready(started) as servers:
        yield servers


def test_a_conversation_made_on_one_replica_is_continued_on_the_other(
    replicas: list[InProcessSluice],
) -> None:
    import openai

    a, b = (client_of(server) for server in replicas)
    made = a.conversations.create(metadata={"on": "a"}, items=[{"role": "user", "content": "hi"}])
    assert b.conversations.retrieve(made.id) == made
    answered = b.responses.create(
        model="sim", input="and?", conversation=made.id, max_output_tokens=4
    )
    assert texts(listed(a, made.id)) == [
        ("user", "hi"),
        ("user", "and?"),
        ("assistant", answered.output_text),
    ]
    # A response running on one replica holds the conversation on the other.
    with a.responses.create(
        model="sim", input="long", conversation=made.id, max_output_tokens=300, stream=True
    ) as stream:
        events = iter(stream)
        for event in events:
            if event.type == "response.output_text.delta":
                break
        assert held(b, made.id)
        body = refusal(
            lambda: b.responses.create(model="sim", input="x", conversation=made.id),
            openai.BadRequestError,
        )
        assert body["code"] == "conversation_locked"
        final = list(events)[-1].response
    assert not held(b, made.id)
    assert texts(listed(b, made.id))[3:] == [("user", "long"), ("assistant", final.output_text)]
    stranger: openai.OpenAI = client_of(replicas[1], "sk-globex")
    refusal(lambda: stranger.conversations.retrieve(made.id), openai.NotFoundError)
    refusal(lambda: stranger.conversations.items.list(made.id), openai.NotFoundError)
    assert b.conversations.delete(made.id).deleted
    refusal(lambda: a.conversations.retrieve(made.id), openai.NotFoundError)


def test_a_background_response_handed_over_at_shutdown_ends_on_the_other_replica(
    session_redis: RedisProcess, tmp_path: Path
) -> None:
    """Replica a (a process of its own, stopped as by Ctrl-C) runs a background response on a
    conversation; b follows its stream. a stops (no drain: its generations handed over at
    once), b continues the generation, renews the conversation's hold (a's lapses a lease after
    a let go of it), and at the end adds the response's items, once."""
    lease_s = 1.0
    args = replica_args(tmp_path, session_redis, f"state: {{lease_seconds: {lease_s}}}\n")
    a = SluiceProcess([*args, "--drain-seconds", "0"], tmp_path / "a.log", env=ENV)
    b = InProcessSluice(args, tmp_path / "b.log", env=ENV)
    try:
        a.wait_ready(60)
        b.wait_ready(60)
        on_a, on_b = client_of(a), client_of(b)
        made = on_a.conversations.create(items=[{"role": "user", "content": "before"}])
        story = on_a.responses.create(
            model="sim", input="a long story", conversation=made.id, background=True,
            max_output_tokens=1200,
        )  # fmt: skip
        events: list[Any] = []

        def follow() -> None:
            with on_b.responses.retrieve(story.id, stream=True) as stream:
                events.extend(stream)

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        wait_until(
            lambda: sum(e.type == "response.output_text.delta" for e in events) >= 5,
            DEADLINE_S,
            message="b to stream the response a runs",
        )
        assert a.stop() == 0
        stopped = time.monotonic()
        # Held all along, past a's last renewal by more than a lease: b renews it.
        while time.monotonic() - stopped < 2.5 * lease_s:
            assert held(on_b, made.id)
            time.sleep(0.1)
        assert reader.is_alive(), "the response ended too soon to show the hold renewed"
        reader.join(DEADLINE_S)
        assert not reader.is_alive()
        final = events[-1]
        assert final.type == "response.incomplete"
        assert final.response.usage is not None and final.response.usage.output_tokens == 1200
        assert not held(on_b, made.id)
        assert texts(listed(on_b, made.id)) == [
            ("user", "before"),
            ("user", "a long story"),
            ("assistant", final.response.output_text),
        ]
        assert on_b.responses.retrieve(story.id).status == "incomplete"
    finally:
        for server in (a, b):
            server.stop()
