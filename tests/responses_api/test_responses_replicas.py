"""The Responses API's stored responses shared by replicas through a real `redis-server`: two
real Sluice servers (sim engine, in this process) on one Redis, called with the official
`openai` SDK: a response made on one is retrieved and continued (`previous_response_id`) on
the other, and is none of another tenant's there; the Redis store's bounds; and a response
kept on its replica while Redis does not answer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from conftest import InProcessSluice, RedisProcess, all_ready, wait_until
from test_responses_api import DEADLINE_S, check_bounds, serve
from test_responses_ws import TERMINAL

from server.core.config import StateConfig
from server.observability.metrics import Metrics
from server.state.backend import RedisState
from server.state.responses import RedisResponses

if TYPE_CHECKING:
    import openai

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("responses")]


def replica(root: Path, redis: RedisProcess, name: str) -> InProcessSluice:
    return serve(root, "--state-url", redis.url, log=f"{name}.log")


@pytest.fixture(scope="module")
def replicas(
    session_redis: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[InProcessSluice]]:
    root = tmp_path_factory.mktemp("response-replicas")
    with all_ready([replica(root, session_redis, name) for name in ("a", "b")]) as servers:
        yield servers


def client_of(server: InProcessSluice, key: str = "sk-acme") -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def test_a_response_made_on_one_replica_is_found_and_continued_on_another(
    replicas: list[InProcessSluice],
) -> None:
    import openai

    a, b = (client_of(server) for server in replicas)
    made = a.responses.create(model="sim", input="tell me a story", max_output_tokens=16)
    assert b.responses.retrieve(made.id).model_dump() == made.model_dump()
    after = b.responses.create(
        model="sim", input="and then?", previous_response_id=made.id, max_output_tokens=16
    )
    assert made.usage is not None and after.usage is not None
    assert after.usage.input_tokens >= made.usage.input_tokens + made.usage.output_tokens
    assert a.responses.retrieve(after.id).output_text == after.output_text  # and back
    globex = client_of(replicas[1], "sk-globex")
    with pytest.raises(openai.NotFoundError) as refused:
        globex.responses.retrieve(made.id)
    assert refused.value.body["code"] == "not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        globex.responses.create(model="sim", input="and then?", previous_response_id=made.id)


def test_an_ended_background_response_streams_again_on_another_replica(
    replicas: list[InProcessSluice],
) -> None:
    a, b = (client_of(server) for server in replicas)
    made = a.responses.create(model="sim", input="a story", max_output_tokens=24, background=True)
    with a.responses.retrieve(made.id, stream=True) as stream:
        events = list(stream)
    assert events[-1].type in ("response.completed", "response.incomplete")
    wait_until(
        lambda: b.responses.retrieve(made.id).status == events[-1].response.status,
        DEADLINE_S,
        message="the ended response reached the other replica",
    )
    rest = list(b.responses.retrieve(made.id, stream=True, starting_after=3))
    assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[4:]]


def test_a_running_background_response_streams_on_another_replica(
    replicas: list[InProcessSluice],
) -> None:
    """Made on A, its events streamed on B from A's shared log while A runs it: B leaves
    mid-generation and resumes after the last event it had, every event once, in order."""
    a, b = (client_of(server) for server in replicas)
    made = a.responses.create(
        model="sim", input="tell me a story", max_output_tokens=120, background=True
    )  # (1.2 s at 10 ms a step: it runs on well after B's client leaves at its 8th event)
    seen = []
    with b.responses.retrieve(made.id, stream=True) as first:
        for event in first:
            seen.append(event)
            if event.type == "response.output_text.delta" and len(seen) >= 8:
                break
    rest = list(b.responses.retrieve(made.id, stream=True, starting_after=seen[-1].sequence_number))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))
    final = rest[-1]
    assert final.type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    assert deltas == final.response.output_text
    # A, which runs it, reads its own log: B may see the end in the shared log first, while
    # A's record still shows the response in progress. Once both show it ended, it is the same.
    for server, client in zip(("A", "B"), (a, b), strict=True):
        wait_until(
            lambda client=client: (
                client.responses.retrieve(made.id).status == final.response.status
            ),
            DEADLINE_S,
            message=f"the ended response reached replica {server}",
        )
    assert a.responses.retrieve(made.id).output_text == final.response.output_text
    assert b.responses.retrieve(made.id).output_text == final.response.output_text


async def test_the_redis_store_keeps_responses_for_their_retention_within_each_tenants_bytes(
    tmp_path: Path,
) -> None:
    now = [1_000.0]
    with RedisProcess(tmp_path) as redis:  # (its own: the bound counts every response there)
        state = RedisState(StateConfig(url=redis.url), Metrics())
        store = RedisResponses(state, retention_seconds=10, max_bytes=2_000, clock=lambda: now[0])
        await store.start()
        try:
            await check_bounds(store, now)
        finally:
            await state.stop()


def test_a_response_is_kept_on_its_replica_while_redis_is_down(tmp_path: Path) -> None:
    with RedisProcess(tmp_path) as redis:
        with replica(tmp_path, redis, "alone") as server:
            client = client_of(server)
            redis.stop()
            made = client.responses.create(model="sim", input="hello", max_output_tokens=8)
            assert "is kept on this replica alone" in server.log()
            assert client.responses.retrieve(made.id).output_text == made.output_text
            redis.start()
            wait_until(
                lambda: server.metric("sluice_state_backend_up") == 1,
                DEADLINE_S,
                message="Redis answers again",
            )
            assert client.responses.retrieve(made.id).output_text == made.output_text


def test_the_websocket_streams_responses_another_replica_made(
    replicas: list[InProcessSluice],
) -> None:
    """Over B's `/v1/responses` WebSocket, `response.retrieve` of background responses A made:
    one that ended (its events as stored, after a sequence number) and one A still runs
    (followed from A's shared log, every event once, to its end)."""
    import asyncio
    import json

    import websockets

    a = client_of(replicas[0])
    ended = a.responses.create(model="sim", input="a story", max_output_tokens=24, background=True)
    with a.responses.retrieve(ended.id, stream=True) as stream:
        stored = list(stream)
    wait_until(
        lambda: (
            client_of(replicas[1]).responses.retrieve(ended.id).status == stored[-1].response.status
        ),
        DEADLINE_S,
        message="the ended response reached the other replica",
    )
    running = a.responses.create(
        model="sim", input="tell me a story", max_output_tokens=120, background=True
    )

    async def retrieve(ws: Any, response_id: str, **fields: Any) -> list[dict[str, Any]]:
        await ws.send(
            json.dumps({"type": "response.retrieve", "response_id": response_id, **fields})
        )
        events = []
        while not events or events[-1]["type"] not in TERMINAL:
            events.append(json.loads(await asyncio.wait_for(ws.recv(), DEADLINE_S)))
            assert events[-1]["type"] != "error", events[-1]
        return events

    async def over_b() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        url = replicas[1].url.replace("http://", "ws://") + "/v1/responses"
        headers = {"Authorization": "Bearer sk-acme"}
        async with websockets.connect(url, additional_headers=headers, max_size=None) as ws:
            return await retrieve(ws, ended.id, starting_after=3), await retrieve(ws, running.id)

    rest, followed = asyncio.run(over_b())
    assert [(e["sequence_number"], e["type"]) for e in rest] == [
        (e.sequence_number, e.type) for e in stored[4:]
    ]
    assert {e["response_id"] for e in rest + followed} == {ended.id, running.id}
    assert [e["sequence_number"] for e in followed] == list(range(len(followed)))
    deltas = "".join(e["delta"] for e in followed if e["type"] == "response.output_text.delta")
    assert deltas == followed[-1]["response"]["output"][0]["content"][0]["text"] != ""
