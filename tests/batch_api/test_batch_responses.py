"""`/v1/responses` lines of the Batch API, with the official `openai` client as a user would
send them: each line a `POST /v1/responses` body, its output line's body the response object;
lines on one conversation run one after another in the file's order, each seeing the ones
before it; a line on a conversation another response holds waits for it; a line on a
conversation that does not exist is a 404 in the error file; `stream` and `background` fail the
batch at once. A real Sluice server on loopback, in this process, on the sim engine as fast as
it runs (a background response holds its conversation while the batch runs because the test
holds the engine's steps)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from conftest import FAST_SIM, InProcessSluice, sim_sluice, wait_until

if TYPE_CHECKING:
    import openai

pytestmark = pytest.mark.service
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    with sim_sluice(tmp_path_factory.mktemp("batch-responses"), *FAST_SIM) as server:
        yield server


@pytest.fixture
def client(server: InProcessSluice) -> openai.OpenAI:
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": "sim", "max_output_tokens": 4, **body},
    }


def run_batch(client: openai.OpenAI, lines: list[dict[str, Any]]) -> openai.types.Batch:
    """The batch of `lines`, made and in progress."""
    content = "".join(json.dumps(each) + "\n" for each in lines).encode()
    file = client.files.create(file=("responses.jsonl", content), purpose="batch")
    return client.batches.create(
        input_file_id=file.id, endpoint="/v1/responses", completion_window="24h"
    )


def ended(client: openai.OpenAI, batch_id: str) -> openai.types.Batch:
    found: list[openai.types.Batch] = []

    def done() -> bool:
        found[:] = [client.batches.retrieve(batch_id)]
        return found[0].status in ("completed", "failed", "expired", "cancelled")

    wait_until(done, DEADLINE_S, interval=0.1, message=f"batch {batch_id} to end")
    return found[0]


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """The output or error file's lines, by custom_id."""
    if file_id is None:
        return {}
    lines = [json.loads(text) for text in client.files.content(file_id).text.splitlines()]
    return {each["custom_id"]: each for each in lines}


def texts(client: openai.OpenAI, conversation: str) -> list[tuple[str, str]]:
    """(role, text) of the conversation's message items, oldest first."""
    items = client.conversations.items.list(conversation, order="asc", limit=100)
    return [
        (item.role, "".join(part.text for part in item.content))  # type: ignore[union-attr]
        for item in items
        if item.type == "message"
    ]


def test_lines_on_a_conversation_run_in_the_files_order_each_seeing_the_last(
    client: openai.OpenAI,
) -> None:
    first = client.conversations.create(items=[{"role": "system", "content": "Be brief."}])
    second = client.conversations.create()
    batch = run_batch(
        client,
        [
            line("a-1", input="first question", conversation=first.id),
            line("b-1", input="other question", conversation={"id": second.id}),
            line("a-2", input="second question", conversation=first.id),
            line("none", input="no conversation"),
            line("a-3", input="third question", conversation={"id": first.id}),
            line("missing", input="lost", conversation="conv_missing"),
        ],
    )
    assert batch.endpoint == "/v1/responses" and batch.request_counts.total == 6
    batch = ended(client, batch.id)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (5, 1)
    output = results(client, batch.output_file_id)
    assert sorted(output) == ["a-1", "a-2", "a-3", "b-1", "none"]
    bodies = {custom_id: each["response"]["body"] for custom_id, each in output.items()}
    for custom_id, body in bodies.items():
        assert output[custom_id]["response"]["status_code"] == 200
        assert body["object"] == "response" and body["status"] in ("completed", "incomplete")
        # Stored, as a response sent over HTTP is.
        assert client.responses.retrieve(body["id"]).output_text == output_text(body)
    assert bodies["a-1"]["conversation"] == {"id": first.id}
    assert bodies["none"]["conversation"] is None
    # Each turn saw the ones before it: its prompt holds them.
    usage = [bodies[f"a-{turn}"]["usage"] for turn in (1, 2, 3)]
    for before, after in itertools.pairwise(usage):
        assert after["input_tokens"] > before["input_tokens"] + before["output_tokens"]
    assert texts(client, first.id) == [
        ("system", "Be brief."),
        ("user", "first question"),
        ("assistant", output_text(bodies["a-1"])),
        ("user", "second question"),
        ("assistant", output_text(bodies["a-2"])),
        ("user", "third question"),
        ("assistant", output_text(bodies["a-3"])),
    ]
    assert texts(client, second.id) == [
        ("user", "other question"),
        ("assistant", output_text(bodies["b-1"])),
    ]
    [missing] = results(client, batch.error_file_id).values()
    assert missing["custom_id"] == "missing" and missing["response"]["status_code"] == 404
    assert missing["response"]["body"]["error"]["param"] == "conversation"


def output_text(body: dict[str, Any]) -> str:
    return "".join(
        part["text"]
        for item in body["output"]
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )


def test_a_line_waits_while_another_response_holds_its_conversation(
    server: InProcessSluice, client: openai.OpenAI
) -> None:
    made = client.conversations.create()
    locked = "sluice_batch_line_retries_total"
    refusals = server.metric(locked, code="conversation_locked")
    with server.held_steps() as steps:
        holding = client.responses.create(
            model="sim", input="a long story", conversation=made.id, background=True,
            max_output_tokens=400,
        )  # fmt: skip
        batch = run_batch(
            client,
            [line("waits", input="and then?", conversation=made.id), line("free", input="hi")],
        )
        # The free line's 4 tokens (`line`'s max_output_tokens), one a step once it is in the
        # engine beside the held response: the response is 396 tokens short of its end.
        wait_until(
            lambda: server.metric("sluice_engine_unfinished_requests") == 2,
            DEADLINE_S,
            message="the free line to reach the engine",
        )
        steps.step(4)
        # Refused for now while the background response runs; the batch's other line goes on.
        wait_until(
            lambda: (
                server.metric(locked, code="conversation_locked") > refusals
                and client.batches.retrieve(batch.id).request_counts.completed == 1
            ),
            DEADLINE_S,
            message="the line on the held conversation to be refused for now",
        )
        assert client.responses.retrieve(holding.id).status in ("queued", "in_progress")
    batch = ended(client, batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 0)
    story = client.responses.retrieve(holding.id)
    assert story.status == "incomplete"  # (cut by max_output_tokens: its items were added)
    waited = results(client, batch.output_file_id)["waits"]["response"]["body"]
    assert texts(client, made.id) == [
        ("user", "a long story"),
        ("assistant", story.output_text),
        ("user", "and then?"),
        ("assistant", output_text(waited)),
    ]


def test_streamed_or_background_lines_fail_the_batch_naming_them(
    client: openai.OpenAI,
) -> None:
    batch = run_batch(
        client,
        [
            line("ok", input="fine"),
            line("streamed", input="x", stream=True),
            line("background", input="x", background=True),
            line("bad", input=[{"type": "mystery"}]),
        ],
    )
    assert batch.status == "failed" and batch.errors is not None
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == [
        (2, "invalid_request", "body.stream"),
        (3, "invalid_request", "body.background"),
        (4, "invalid_request", "body.input[0]"),
    ]
