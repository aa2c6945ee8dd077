"""Conversations shared by replicas through a real `redis-server` (`--state-url`): two real
Sluice servers (sim engine, in this process) on the session's Redis, called with the official
`openai` SDK: a conversation made on one is read, continued and held on the other, and is none
of another tenant's there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from conftest import InProcessSluice, RedisProcess, uncalibrated_config
from test_conversations_api import KEYS, client_of, held, listed, refusal, texts

if TYPE_CHECKING:
    import openai

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("conversations")]


@pytest.fixture(scope="module")
def replicas(
    session_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[InProcessSluice]]:
    root = tmp_path_factory.mktemp("conversation-replicas")
    servers = [
        InProcessSluice(
            [
                "--engine",
                "sim",
                "--sim-step-base-ms",
                "10",
                "--config",
                str(uncalibrated_config(root)),
                "--state-url",
                session_redis.url,
            ],
            root / f"{name}.log",
            env={"SLUICE_API_KEYS": ",".join(f"{k}:{t}" for k, t in KEYS.items())},
        )
        for name in ("a", "b")
    ]
    try:
        for server in servers:
            server.wait_ready(60)
        yield servers
    finally:
        for server in servers:
            server.stop()


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
