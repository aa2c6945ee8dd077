"""OpenAI's Conversations API (`/v1/conversations`), called with the official `openai` SDK as a
user would: every `client.conversations.*` and `client.conversations.items.*` call, responses
on a conversation (whole, streamed, in the background, cancelled, left by their client), a
second response while one runs, tenants, and bad input refused in OpenAI's shape, changing
nothing.

A real Sluice server on loopback, in this process, on the sim engine (steps of ~10 ms, so that
a response runs long enough to be caught mid-way)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from conftest import AccessLines, InProcessSluice, sim_sluice, wait_until

if TYPE_CHECKING:
    import openai

pytestmark = [pytest.mark.service, pytest.mark.xdist_group("conversations")]
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
DEADLINE_S = 30.0


def serve(root: Path, *more: str, config: str = "", log: str = "server.log") -> InProcessSluice:
    """A sim server with `KEYS`, at ~10 ms a step."""
    return sim_sluice(root, "--sim-step-base-ms", "10", *more, config=config, keys=KEYS, log=log)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    with serve(tmp_path_factory.mktemp("conversations")) as server:
        yield server


@pytest.fixture(scope="module")
def bounded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    """Bounds small enough to reach: 2 conversations, 6 items, 400 bytes an item."""
    bounds = "conversations: {max_conversations: 2, max_items: 6, max_item_bytes: 400}\n"
    with serve(tmp_path_factory.mktemp("bounded"), config=bounds) as server:
        yield server


def client_of(server: InProcessSluice, key: str = "sk-acme") -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture
def client(server: InProcessSluice) -> openai.OpenAI:
    return client_of(server)


def listed(client: openai.OpenAI, conversation: str) -> list[dict[str, Any]]:
    """The conversation's items, oldest first, as the SDK reads them."""
    items = client.conversations.items.list(conversation, order="asc", limit=100)
    return [item.model_dump(exclude_none=True) for item in items]


def texts(items: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(role, text) of each message item."""
    return [
        (item["role"], "".join(part["text"] for part in item["content"]))
        for item in items
        if item["type"] == "message"
    ]


def refusal(call: Any, error: type[Exception]) -> dict[str, Any]:
    """The error body `call` is refused with."""
    with pytest.raises(error) as refused:
        call()
    body = refused.value.body  # type: ignore[attr-defined]
    assert isinstance(body, dict)
    return body


def held(client: openai.OpenAI, conversation: str) -> bool:
    """Whether a response holds the conversation (a probe that changes nothing: deleting an
    item it does not have is refused while held, else a 404)."""
    import openai

    try:
        client.conversations.items.delete("msg_none", conversation_id=conversation)
    except openai.BadRequestError as refused:
        assert refused.code == "conversation_locked"
        return True
    except openai.NotFoundError:
        return False
    raise AssertionError("deleting no item succeeded")


def test_a_conversation_is_made_read_updated_and_deleted(client: openai.OpenAI) -> None:
    import openai

    made = client.conversations.create(
        metadata={"topic": "boats"},
        items=[{"type": "message", "role": "user", "content": "Hello!"}],
    )
    assert made.id.startswith("conv_") and made.object == "conversation"
    assert made.metadata == {"topic": "boats"} and made.created_at > 0
    assert client.conversations.retrieve(made.id) == made
    updated = client.conversations.update(made.id, metadata={"topic": "trains"})
    assert updated.metadata == {"topic": "trains"} and updated.id == made.id
    assert client.conversations.retrieve(made.id).metadata == {"topic": "trains"}
    deleted = client.conversations.delete(made.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (made.id, "conversation.deleted", True)
    for call in (
        lambda: client.conversations.retrieve(made.id),
        lambda: client.conversations.items.list(made.id),
        lambda: client.conversations.delete(made.id),
    ):
        assert refusal(call, openai.NotFoundError)["code"] == "not_found"
    empty = client.conversations.create()
    assert empty.metadata == {} and listed(client, empty.id) == []


def test_items_are_added_listed_in_pages_read_and_deleted(client: openai.OpenAI) -> None:
    import openai

    made = client.conversations.create(
        items=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "input_text", "text": "one"}]},
        ]
    )
    added = client.conversations.items.create(
        made.id,
        items=[
            {"role": "assistant", "content": "two"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "three"},
        ],
    )
    assert [item.type for item in added.data] == [
        "message",
        "function_call",
        "function_call_output",
    ]
    assert added.first_id == added.data[0].id and added.last_id == added.data[-1].id
    items = listed(client, made.id)
    assert [item["id"] for item in items[2:]] == [item.id for item in added.data]
    assert len({item["id"] for item in items}) == 5  # each an id of its own
    assert texts(items) == [("system", "be brief"), ("user", "one"), ("assistant", "two")]
    assert items[0]["content"] == [{"type": "input_text", "text": "be brief"}]
    assert items[2]["content"] == [{"type": "output_text", "text": "two", "annotations": []}]
    assert items[3] == {
        "type": "function_call",
        "id": items[3]["id"],
        "status": "completed",
        "call_id": "c1",
        "name": "f",
        "arguments": "{}",
    }
    # Newest first by default; pages of 2 (the SDK follows `after`), either way.
    newest = client.conversations.items.list(made.id, limit=2)
    assert [item.id for item in newest.data] == [items[4]["id"], items[3]["id"]]
    assert newest.has_more is True
    paged = [item.id for item in client.conversations.items.list(made.id, limit=2, order="asc")]
    assert paged == [item["id"] for item in items]
    backwards = [item.id for item in client.conversations.items.list(made.id, limit=2)]
    assert backwards == paged[::-1]
    one = client.conversations.items.retrieve(items[1]["id"], conversation_id=made.id)
    assert one.model_dump(exclude_none=True) == items[1]
    after = client.conversations.items.delete(items[1]["id"], conversation_id=made.id)
    assert after.id == made.id and after.object == "conversation"
    assert [item["id"] for item in listed(client, made.id)] == paged[:1] + paged[2:]
    refused = refusal(
        lambda: client.conversations.items.retrieve(items[1]["id"], conversation_id=made.id),
        openai.NotFoundError,
    )
    assert refused["param"] == "item_id"


def test_a_response_on_a_conversation_sees_its_items_and_adds_its_own(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    made = client.conversations.create(items=[{"role": "user", "content": "my name is Ada"}])
    first = client.responses.create(
        model="sim", input="what is my name?", conversation=made.id, max_output_tokens=6
    )
    assert first.conversation is not None and first.conversation.id == made.id
    items = listed(client, made.id)
    assert texts(items) == [
        ("user", "my name is Ada"),
        ("user", "what is my name?"),
        ("assistant", first.output_text),
    ]
    assert items[-1]["id"] == first.output[0].id  # the output item, as the response has it
    assert first.status == "incomplete"  # (6 tokens: cut short, and added all the same)

    # The second turn, streamed: its prompt is the conversation's items, then its input.
    stream = client.responses.create(
        model="sim",
        input=[{"role": "user", "content": "and again?"}],
        conversation={"id": made.id},
        max_output_tokens=6,
        stream=True,
    )
    final = list(stream)[-1].response
    assert final.conversation is not None and final.conversation.id == made.id
    explicit = [
        *({key: value for key, value in item.items() if key != "id"} for item in items),
        {"role": "user", "content": "and again?"},
    ]
    rendered = httpx.post(
        server.url + "/v1/responses/render",
        json={"model": "sim", "input": explicit},
        headers={"Authorization": "Bearer sk-acme"},
        timeout=10,
    ).json()
    alone = httpx.post(
        server.url + "/v1/responses/render",
        json={"model": "sim", "input": "and again?"},
        headers={"Authorization": "Bearer sk-acme"},
        timeout=10,
    ).json()
    assert final.usage is not None
    assert final.usage.input_tokens == len(rendered["token_ids"]) > len(alone["token_ids"])
    assert first.usage is not None and final.usage.input_tokens > first.usage.input_tokens
    assert texts(listed(client, made.id))[3:] == [
        ("user", "and again?"),
        ("assistant", final.output_text),
    ]


def test_a_background_response_adds_its_items_when_it_ends(client: openai.OpenAI) -> None:
    made = client.conversations.create()
    started = client.responses.create(
        model="sim", input="a story", conversation=made.id, background=True, max_output_tokens=20
    )
    assert started.conversation is not None and started.conversation.id == made.id
    wait_until(
        lambda: client.responses.retrieve(started.id).status not in ("queued", "in_progress"),
        DEADLINE_S,
        message="the background response did not end",
    )
    found = client.responses.retrieve(started.id)
    # Ended as the client sees it: its items are in the conversation.
    assert texts(listed(client, made.id)) == [("user", "a story"), ("assistant", found.output_text)]


def test_a_cancelled_or_failed_response_adds_nothing_and_lets_go(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    made = client.conversations.create(items=[{"role": "user", "content": "before"}])
    started = client.responses.create(
        model="sim", input="a story", conversation=made.id, background=True, max_output_tokens=600
    )
    assert held(client, made.id)
    assert client.responses.cancel(started.id).status == "cancelled"
    assert not held(client, made.id)
    # A stream its client leaves is cancelled: nothing added either.
    with client.responses.create(
        model="sim", input="leave", conversation=made.id, max_output_tokens=600, stream=True
    ) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    wait_until(lambda: not held(client, made.id), DEADLINE_S, message="still held")
    # A response refused before it ran (over the context: 400) holds nothing either.
    too_long = " ".join(["word"] * 3000)
    import openai

    refusal(
        lambda: client.responses.create(model="sim", input=too_long, conversation=made.id),
        openai.BadRequestError,
    )
    assert not held(client, made.id)
    assert texts(listed(client, made.id)) == [("user", "before")]


def test_a_second_response_while_one_runs_is_refused_and_nothing_interleaves(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    import openai

    made = client.conversations.create(items=[{"role": "user", "content": "start"}])
    # The engine held: a step for each event read, the first response runs until the end.
    with (
        server.held_steps() as steps,
        client.responses.create(
            model="sim", input="first", conversation=made.id, max_output_tokens=300, stream=True
        ) as stream,
    ):
        events = iter(stream)
        for event in events:
            if event.type == "response.output_text.delta":
                break
            steps.step()
        for call in (
            lambda: client.responses.create(model="sim", input="second", conversation=made.id),
            lambda: client.conversations.items.create(
                made.id, items=[{"role": "user", "content": "x"}]
            ),
            lambda: client.conversations.items.delete("msg_none", conversation_id=made.id),
        ):
            body = refusal(call, openai.BadRequestError)
            assert (body["code"], body["param"], body["type"]) == (
                "conversation_locked",
                "conversation",
                "invalid_request_error",
            )
        # Reading and the metadata are not held.
        assert client.conversations.update(made.id, metadata={"k": "v"}).metadata == {"k": "v"}
        steps.run()
        final = [event for event in events][-1].response
    items = listed(client, made.id)
    assert texts(items) == [("user", "start"), ("user", "first"), ("assistant", final.output_text)]
    client.responses.create(model="sim", input="third", conversation=made.id, max_output_tokens=3)
    assert [role for role, _ in texts(listed(client, made.id))] == [
        "user", "user", "assistant", "user", "assistant",
    ]  # fmt: skip


def test_conversation_with_previous_response_id_is_openais_400(client: openai.OpenAI) -> None:
    import openai

    made = client.conversations.create()
    earlier = client.responses.create(model="sim", input="hi", max_output_tokens=2)
    body = refusal(
        lambda: client.responses.create(
            model="sim", input="hi", conversation=made.id, previous_response_id=earlier.id
        ),
        openai.BadRequestError,
    )
    assert body["code"] == "mutually_exclusive_parameters"
    assert body["message"] == (
        "Mutually exclusive parameters. Ensure you are only providing one of: "
        "'previous_response_id' or 'conversation'."
    )
    assert listed(client, made.id) == []
    unknown = refusal(
        lambda: client.responses.create(model="sim", input="hi", conversation="conv_none"),
        openai.NotFoundError,
    )
    assert unknown["param"] == "conversation"


def test_another_tenants_conversation_is_none_of_its_own(server: InProcessSluice) -> None:
    import openai

    acme, globex = client_of(server), client_of(server, "sk-globex")
    made = acme.conversations.create(metadata={"a": "b"}, items=[{"role": "user", "content": "x"}])
    item = listed(acme, made.id)[0]["id"]
    for call in (
        lambda: globex.conversations.retrieve(made.id),
        lambda: globex.conversations.update(made.id, metadata={"stolen": "yes"}),
        lambda: globex.conversations.items.list(made.id),
        lambda: globex.conversations.items.create(
            made.id, items=[{"role": "user", "content": "y"}]
        ),
        lambda: globex.conversations.items.retrieve(item, conversation_id=made.id),
        lambda: globex.conversations.items.delete(item, conversation_id=made.id),
        lambda: globex.responses.create(model="sim", input="y", conversation=made.id),
        lambda: globex.conversations.delete(made.id),
    ):
        assert refusal(call, openai.NotFoundError)["code"] == "not_found"
    assert acme.conversations.retrieve(made.id).metadata == {"a": "b"}
    assert [i["id"] for i in listed(acme, made.id)] == [item]
    bad_key = client_of(server, "sk-nobody")
    refusal(lambda: bad_key.conversations.create(), openai.AuthenticationError)


def test_bad_input_is_refused_in_openais_shape_and_changes_nothing(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    made = client.conversations.create(items=[{"role": "user", "content": "kept"}])
    url = f"{server.url}/v1/conversations/{made.id}"
    headers = {"Authorization": "Bearer sk-acme"}

    def refused(method: str, path: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        response = httpx.request(method, url + path, headers=headers, timeout=10, **kwargs)
        return response.status_code, response.json()["error"]

    one = {"role": "user", "content": "x"}
    for method, path, kwargs, param in (
        ("POST", "/items", {"json": {"items": [{"type": "web_search_call"}]}}, "items[0]"),
        (
            "POST",
            "/items",
            {"json": {"items": [{"role": "robot", "content": "x"}]}},
            "items[0].role",
        ),
        ("POST", "/items", {"json": {"items": [one] * 21}}, "items"),
        ("POST", "/items", {"json": {"items": []}}, "items"),
        ("GET", "/items?limit=0", {}, "limit"),
        ("GET", "/items?limit=101", {}, "limit"),
        ("GET", "/items?limit=many", {}, "limit"),
        ("GET", "/items?order=sideways", {}, "order"),
        ("GET", "/items?include=file_search_call.results", {}, "include"),
        ("POST", "", {"json": {}}, "metadata"),
        ("POST", "", {"json": {"metadata": {"k": "v" * 513}}}, "metadata"),
        ("POST", "", {"json": {"metadata": {"k" * 65: "v"}}}, "metadata"),
        ("POST", "", {"json": {"metadata": {str(i): "v" for i in range(17)}}}, "metadata"),
        ("POST", "", {"content": b"not json"}, None),
    ):
        status, error = refused(method, path, **kwargs)
        assert status == 400 and error["type"] == "invalid_request_error", (path, error)
        assert error["param"] == param, (path, kwargs, error)
    status, error = refused("GET", "/items?after=msg_none")
    assert (status, error["code"], error["param"]) == (404, "not_found", "after")
    wrong = httpx.post(
        server.url + "/v1/conversations",
        json={"items": [{"type": "message", "role": "user", "content": 5}]},
        headers=headers,
        timeout=10,
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "items[0].content"
    assert texts(listed(client, made.id)) == [("user", "kept")]  # all of it changed nothing
    assert client.conversations.retrieve(made.id).metadata == {}
    # The SDK's `include` (`include[]=`) and logprobs included where asked for.
    listing = client.conversations.items.list(made.id, include=["message.output_text.logprobs"])
    assert [item.id for item in listing.data] == [listed(client, made.id)[0]["id"]]


def test_each_bound_is_a_clear_4xx_that_changes_nothing(bounded: InProcessSluice) -> None:
    import openai

    client = client_of(bounded)
    one = {"role": "user", "content": "x"}
    first = client.conversations.create(items=[one] * 4)
    second = client.conversations.create()
    body = refusal(lambda: client.conversations.create(), openai.BadRequestError)
    assert body["code"] == "storage_limit_exceeded"
    assert "conversations.max_conversations" in body["message"]
    body = refusal(
        lambda: client.conversations.items.create(second.id, items=[one] * 3),
        openai.BadRequestError,
    )
    assert body["code"] == "storage_limit_exceeded" and body["param"] == "items"
    assert "conversations.max_items" in body["message"]
    big = {"role": "user", "content": "y" * 500}
    body = refusal(
        lambda: client.conversations.items.create(second.id, items=[one, big]),
        openai.APIStatusError,
    )
    assert (body["code"], body["param"]) == ("payload_too_large", "items[1]")
    assert "conversations.max_item_bytes" in body["message"]
    # A response's input is checked at its start: past the bound, it does not run.
    body = refusal(
        lambda: client.responses.create(
            model="sim", input=[one, one, one], conversation=second.id, max_output_tokens=2
        ),
        openai.BadRequestError,
    )
    assert body["code"] == "storage_limit_exceeded"
    assert len(listed(client, first.id)) == 4 and listed(client, second.id) == []
    assert not held(client, second.id)
    # Room made, each fits again; another tenant's bounds are its own.
    client.conversations.delete(first.id)
    client.conversations.items.create(second.id, items=[one] * 6)
    client_of(bounded, "sk-globex").conversations.create(items=[one] * 6)


def test_a_conversations_items_render_as_the_responses_input() -> None:
    """The items a conversation holds read back as the input they were made from."""
    from server.openai_wire.items import chat_messages, read_items
    from server.responses_api.wire import CreateResponse

    request = CreateResponse.model_validate(
        {
            "input": [
                {"role": "developer", "content": "rules"},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "hm"}],
                },
                {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "done"},
            ]
        }
    )
    held_items = json.loads(json.dumps([item.listed() for item in request.items]))
    assert chat_messages(read_items(held_items)) == request.messages()


def test_the_access_log_and_metrics_name_the_operations(
    server: InProcessSluice, client: openai.OpenAI, access_lines: AccessLines
) -> None:
    made = client.conversations.create(safety_identifier="user-1")  # (ignored: counted)
    client.conversations.items.list(made.id)
    client.responses.create(model="sim", input="hi", conversation=made.id, max_output_tokens=2)
    wait_until(
        lambda: access_lines.where(path="/v1/conversations/{id}/items", status=200),
        DEADLINE_S,
        message="no access line for the listing",
    )
    assert access_lines.where(method="POST", path="/v1/conversations", status=200)
    assert not any(made.id in json.dumps(line) for line in access_lines.lines)  # ids: templates
    assert wait_until_line(access_lines, api="responses", status=200)
    ignored = server.metric(
        "sluice_ignored_fields_total", api="conversations", field="safety_identifier"
    )
    assert ignored >= 1


def wait_until_line(access_lines: AccessLines, **fields: object) -> list[dict[str, Any]]:
    wait_until(lambda: access_lines.where(**fields), DEADLINE_S, message=f"no line {fields}")
    return access_lines.where(**fields)


def test_conversations_outlive_a_restart(tmp_path: Path) -> None:
    """Under --data-dir (SQLite), two lifetimes of a server: the second finds the first's
    conversation, its items and its metadata, and continues it."""
    data = ["--data-dir", str(tmp_path / "data")]
    with sim_sluice(tmp_path, *data) as first:
        client = client_of(first)
        made = client.conversations.create(metadata={"a": "b"})
        client.responses.create(model="sim", input="hi", conversation=made.id, max_output_tokens=3)
        before = listed(client, made.id)
    with sim_sluice(tmp_path, *data) as second:
        client = client_of(second)
        assert client.conversations.retrieve(made.id).metadata == {"a": "b"}
        assert listed(client, made.id) == before and len(before) == 2
        client.responses.create(model="sim", input="on", conversation=made.id, max_output_tokens=3)
        assert listed(client, made.id)[:2] == before and len(listed(client, made.id)) == 4


TERMINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}


async def test_responses_on_a_conversation_over_the_websocket(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    """Over the Responses WebSocket as over HTTP: a lane's responses run one after another,
    each seeing the one before; two lanes at once on one conversation, the second is refused;
    a dropped connection adds nothing and lets go."""
    import websockets

    made = client.conversations.create()
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    headers = {"Authorization": "Bearer sk-acme"}

    def create(text: str, tokens: int, **more: Any) -> str:
        return json.dumps(
            {
                "type": "response.create",
                "model": "sim",
                "input": text,
                "conversation": made.id,
                "max_output_tokens": tokens,
                **more,
            }
        )

    async def ends(ws: Any, count: int) -> list[dict[str, Any]]:
        """The next `count` terminal or error events."""
        found: list[dict[str, Any]] = []
        while len(found) < count:
            event = json.loads(await asyncio.wait_for(ws.recv(), DEADLINE_S))
            if event["type"] in TERMINAL or event["type"] == "error":
                found.append(event)
        return found

    async with websockets.connect(url, additional_headers=headers) as ws:
        await ws.send(create("one", 4))
        await ws.send(create("two", 4))  # (the default lane: after "one" has ended)
        first, second = await ends(ws, 2)
        assert [first["type"], second["type"]] == ["response.incomplete"] * 2
        outputs = [
            event["response"]["output"][0]["content"][0]["text"] for event in (first, second)
        ]
        assert texts(listed(client, made.id)) == [
            ("user", "one"),
            ("assistant", outputs[0]),
            ("user", "two"),
            ("assistant", outputs[1]),
        ]
        assert (
            second["response"]["usage"]["input_tokens"] > first["response"]["usage"]["input_tokens"]
        )
        # The engine held, neither can end before the other is answered.
        with server.held_steps() as steps:
            await ws.send(create("x", 300, stream_id="x"))
            await ws.send(create("y", 300, stream_id="y"))
            ended = await ends(ws, 1)
            steps.run()
            ended += await ends(ws, 1)
        refused = [event for event in ended if event["type"] == "error"]
        assert len(refused) == 1 and refused[0]["error"]["code"] == "conversation_locked"
        assert refused[0]["status"] == 400
    assert len(listed(client, made.id)) == 6
    with server.held_steps() as steps:  # a step for each event read: it runs when dropped
        async with websockets.connect(url, additional_headers=headers) as ws:
            await ws.send(create("dropped", 600))
            while json.loads(await ws.recv())["type"] != "response.output_text.delta":
                steps.step()
        wait_until(lambda: not held(client, made.id), DEADLINE_S, message="still held")
    assert len(listed(client, made.id)) == 6
