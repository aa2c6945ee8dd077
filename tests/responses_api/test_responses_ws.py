"""OpenAI's Responses API over a WebSocket (`/v1/responses`): the official `openai` SDK's
`responses.connect()` and its lanes, and a `websockets` client for what the SDK does not send
(Sluice's `response.cancel` and `response.retrieve`, malformed messages, a dropped
connection).

A real Sluice server on loopback, in this process, on the sim engine (steps of ~10 ms, so
that a response runs long enough to be cancelled or left mid-stream)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import websockets
from conftest import InProcessSluice, sim_sluice, wait_until

pytestmark = pytest.mark.xdist_group("responses_ws")
KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
TERMINAL = {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
DEADLINE_S = 30.0
Event = dict[str, Any]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    """Its answers run to their max_output_tokens (the sim's model never stops by itself)."""
    root = tmp_path_factory.mktemp("responses_ws")
    with sim_sluice(root, "--sim-step-base-ms", "10", keys=KEYS) as server:
        yield server


def ws_url(server: InProcessSluice) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def connect(server: InProcessSluice, key: str = "sk-acme", **options: Any) -> Any:
    return websockets.connect(
        ws_url(server),
        additional_headers={"Authorization": f"Bearer {key}"},
        max_size=None,
        **options,
    )


def create(text: str = "tell me a story", **fields: Any) -> str:
    return json.dumps({"type": "response.create", "model": "sim", "input": text, **fields})


async def receive(ws: Any) -> Event:
    event: Event = json.loads(await asyncio.wait_for(ws.recv(), DEADLINE_S))
    return event


async def until_terminal(ws: Any) -> list[Event]:
    """One response's events (the connection carries no other), to its terminal one."""
    events = []
    while True:
        event = await receive(ws)
        events.append(event)
        if event["type"] in TERMINAL or event["type"] == "error":
            return events


def idle(server: InProcessSluice) -> bool:
    return (
        server.metric("sluice_running_requests") == 0
        and server.metric("sluice_queue_depth") == 0
        and server.metric("sluice_budget_in_use") == 0
        and server.metric("sluice_engine_unfinished_requests") == 0
    )


# The SDK's own close calls websockets' `connect()` in a way websockets deprecates.
@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")
def test_the_openai_sdk_streams_responses_on_lanes_at_once(server: InProcessSluice) -> None:
    """`client.responses.connect()` with the SDK's session: two lanes at once, each response's
    events numbered from 0 and carrying its lane, then a response on the default lane."""
    import openai
    from openai.lib.responses_websocket import (
        ResponsesWebSocketLimits,
        ResponsesWebSocketSession,
    )

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-acme", max_retries=0)
    mib = 1 << 20
    limits = ResponsesWebSocketLimits(
        max_lanes=4,
        max_events_per_lane=256,
        max_events=512,
        max_bytes_per_lane=16 * mib,
        max_bytes=32 * mib,
    )
    with (
        client.responses.connect() as connection,
        ResponsesWebSocketSession(connection, limits=limits) as session,
    ):
        lanes = [session.lane("a"), session.lane("b")]
        for lane in lanes:
            lane.send(
                {"type": "response.create", "model": "sim", "input": "hi", "max_output_tokens": 24}
            )
        finals = [lane.get_final_response(timeout=DEADLINE_S) for lane in lanes]
        session.default.send(
            {"type": "response.create", "model": "sim", "input": "hi", "max_output_tokens": 4}
        )
        events: list[Any] = []
        while not events or events[-1].type not in TERMINAL:
            events.append(session.default.recv(timeout=DEADLINE_S))
    assert len({f.id for f in finals}) == 2
    for final in finals:
        assert final.status == "incomplete" and final.output_text
        assert final.usage is not None and final.usage.output_tokens == 24
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert all(getattr(e, "stream_id", None) is None for e in events)


async def test_lanes_interleave_and_a_lane_keeps_its_order(server: InProcessSluice) -> None:
    """Two lanes' responses stream at the same time; two creates on one lane run one after
    the other. Every event names its response; each response's numbers run 0, 1, 2, …"""
    async with connect(server) as ws:
        await ws.send(create(max_output_tokens=30, stream_id="a"))
        await ws.send(create(max_output_tokens=30, stream_id="b"))
        await ws.send(create(max_output_tokens=5, stream_id="a"))
        events: list[Event] = []
        while sum(e["type"] in TERMINAL for e in events) < 3:
            events.append(await receive(ws))
    by_response: dict[str, list[Event]] = {}
    for event in events:
        by_response.setdefault(event["response_id"], []).append(event)
    assert len(by_response) == 3
    for stream in by_response.values():
        assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
        assert stream[-1]["type"] == "response.incomplete"
        assert len({e["stream_id"] for e in stream}) == 1
    order = [e["response_id"] for e in events]
    first_a, second_a = [r for r in by_response if by_response[r][0]["stream_id"] == "a"]
    b = next(r for r in by_response if by_response[r][0]["stream_id"] == "b")
    first_a_end = len(order) - 1 - order[::-1].index(first_a)
    # The lanes interleave: b begins before a's first response ends.
    assert order.index(b) < first_a_end
    # One lane in order: its second response begins after its first ended.
    assert order.index(second_a) > first_a_end


async def test_a_thousand_creates_and_cancels_each_end_once(server: InProcessSluice) -> None:
    """1,000 response.create / response.cancel pairs on one connection over 16 lanes: a third
    cancelled as soon as created, a third once it streams, a third after its end. Each gets
    exactly one terminal event, nothing comes after it, and the server is idle after."""
    pairs, lanes = 1000, 16
    terminal: dict[str, list[str]] = {}
    created: dict[str, int] = {}  # response id → pair number
    async with connect(server, compression=None) as ws:  # (the CPU for the server)
        for i in range(lanes):
            await ws.send(create(max_output_tokens=6, stream_id=f"lane{i}", metadata={"i": str(i)}))
        sent = lanes
        while len(terminal) < pairs:
            event = await receive(ws)
            assert event["type"] != "error", event
            response_id, kind = event["response_id"], event["type"]
            if kind == "response.created":
                i = created[response_id] = int(event["response"]["metadata"]["i"])
                if i % 3 == 0:
                    await ws.send(
                        json.dumps({"type": "response.cancel", "response_id": response_id})
                    )
            elif kind == "response.output_text.delta" and created[response_id] % 3 == 1:
                if event["sequence_number"] == 4:  # the first delta
                    await ws.send(
                        json.dumps({"type": "response.cancel", "response_id": response_id})
                    )
            elif kind in TERMINAL:
                terminal.setdefault(response_id, []).append(kind)
                if created[response_id] % 3 == 2:  # ended: its cancel changes nothing
                    await ws.send(
                        json.dumps({"type": "response.cancel", "response_id": response_id})
                    )
                if sent < pairs:
                    await ws.send(
                        create(
                            max_output_tokens=6,
                            stream_id=event["stream_id"],
                            metadata={"i": str(sent)},
                        )
                    )
                    sent += 1
        last = await send_and_read(ws, create(max_output_tokens=2))  # nothing stray before it
        assert [e["response_id"] for e in last] == [last[0]["response_id"]] * len(last)
        assert last[-1]["type"] == "response.incomplete"
    assert sorted(created.values()) == list(range(pairs))
    assert all(len(kinds) == 1 for kinds in terminal.values())
    cancelled = [kinds[0] for kinds in terminal.values()].count("response.cancelled")
    assert cancelled >= pairs // 6, cancelled  # (most of the first two thirds)
    wait_until(lambda: idle(server), 60, message="a response held the scheduler")


async def send_and_read(ws: Any, message: str) -> list[Event]:
    await ws.send(message)
    return await until_terminal(ws)


async def test_a_background_response_resumes_on_a_new_connection(server: InProcessSluice) -> None:
    """A background response read on one connection, the connection dropped mid-stream, read
    on from the last sequence number seen on another: every event once, in order, the same as
    a full replay. The engine held, a step for each event read: it runs when dropped."""
    with server.held_steps() as steps:
        async with connect(server) as ws:
            await ws.send(create(max_output_tokens=120, background=True, stream_id="bg"))
            seen: list[Event] = []
            while sum(e["type"] == "response.output_text.delta" for e in seen) < 8:
                seen.append(await receive(ws))
                steps.step()
            ws.transport.abort()  # dropped, not closed
        response_id = seen[0]["response_id"]
        assert seen[0]["response"]["background"] is True
        steps.run()
        async with connect(server) as ws:
            retrieve = {"type": "response.retrieve", "response_id": response_id}
            after = seen[-1]["sequence_number"]
            rest = await send_and_read(ws, json.dumps({**retrieve, "starting_after": after}))
            replayed = await send_and_read(ws, json.dumps(retrieve))
    assert rest[-1]["type"] in ("response.completed", "response.incomplete")
    assert [e["sequence_number"] for e in seen + rest] == list(range(len(seen) + len(rest)))
    assert [{k: v for k, v in e.items() if k != "stream_id"} for e in seen] + rest == replayed
    deltas = "".join(e["delta"] for e in replayed if e["type"] == "response.output_text.delta")
    assert deltas == rest[-1]["response"]["output"][0]["content"][0]["text"] != ""


async def test_a_dropped_connection_cancels_its_responses_but_background_ones(
    server: InProcessSluice,
) -> None:
    def cancelled() -> float:
        return server.metric("sluice_requests_total", outcome="cancelled")

    before = cancelled()
    async with connect(server) as ws:
        await ws.send(create(max_output_tokens=600, stream_id="fg"))
        await ws.send(create(max_output_tokens=60, background=True, stream_id="bg"))
        events: list[Event] = []
        while {e["stream_id"] for e in events if e["type"] == "response.output_text.delta"} != {
            "fg",
            "bg",
        }:
            events.append(await receive(ws))
        ws.transport.abort()
    wait_until(lambda: cancelled() == before + 1, DEADLINE_S, message="the response ran on")
    background = next(e["response_id"] for e in events if e["stream_id"] == "bg")
    async with connect(server) as ws:  # the background one ran on, to its end
        rest = await send_and_read(
            ws, json.dumps({"type": "response.retrieve", "response_id": background})
        )
    assert rest[-1]["type"] == "response.incomplete"
    assert rest[-1]["response"]["usage"]["output_tokens"] == 60
    assert cancelled() == before + 1


async def test_previous_response_id_continues_an_unstored_response_of_the_connection(
    server: InProcessSluice,
) -> None:
    """As OpenAI's WebSocket mode: a lane's last response, even with `store: false`,
    continues (on any lane, after another lane's response ended); another connection cannot
    find it."""
    async with connect(server) as ws:
        *_, first = await send_and_read(ws, create(max_output_tokens=8, store=False, stream_id="a"))
        first_id = first["response_id"]
        await send_and_read(ws, create(max_output_tokens=2, store=False, stream_id="b"))
        *_, second = await send_and_read(
            ws,
            create("and then?", max_output_tokens=8, previous_response_id=first_id, stream_id="c"),
        )
    assert second["type"] == "response.incomplete", second
    usage, earlier = second["response"]["usage"], first["response"]["usage"]
    assert usage["input_tokens"] >= earlier["input_tokens"] + earlier["output_tokens"]
    async with connect(server) as ws:
        refused = await send_and_read(ws, create(previous_response_id=first_id))
    assert refused == [
        {
            "type": "error",
            "status": 404,
            "error": {
                "message": f"Response with id '{first_id}' not found.",
                "type": "invalid_request_error",
                "param": "previous_response_id",
                "code": "not_found",
            },
        }
    ]


async def test_an_input_sent_again_is_read_from_the_cache(server: InProcessSluice) -> None:
    """The terminal event's usage counts the input tokens found in the engine's prefix cache
    (whole blocks of 128 tokens on the sim): none the first time, its blocks the second."""
    tag = uuid.uuid4().hex[:8]
    text = " ".join(f"w{tag}x{i}" for i in range(424))
    async with connect(server) as ws:
        hits = []
        for _ in range(2):
            await ws.send(create(text, max_output_tokens=2))
            usage = (await until_terminal(ws))[-1]["response"]["usage"]
            hits.append(usage["input_tokens_details"]["cached_tokens"])
    assert hits[0] == 0 and 3 * 128 <= hits[1] < usage["input_tokens"]


@pytest.mark.parametrize(
    ("message", "status", "code", "param"),
    [
        ("not json", 400, "invalid_request", None),
        ("[1, 2]", 400, "invalid_request", None),
        ('{"type": "response.steer"}', 400, "invalid_request", "type"),
        (create(priority=1), 400, "unsupported_parameter", "priority"),
        (create(max_output_tokens=0), 400, "invalid_request", "max_output_tokens"),
        (create(stream=False), 400, "invalid_request", "stream"),
        (create(stream_id="no spaces"), 400, "invalid_request", "stream_id"),
        ('{"type": "response.cancel"}', 400, "invalid_request", "response_id"),
        (
            '{"type": "response.cancel", "response_id": "resp_none"}',
            404,
            "not_found",
            "response_id",
        ),
        (
            '{"type": "response.retrieve", "response_id": "resp_none"}',
            404,
            "not_found",
            "response_id",
        ),
        (
            '{"type": "response.retrieve", "response_id": "r", "starting_after": -1}',
            400,
            "invalid_request",
            "starting_after",
        ),
    ],
)
async def test_a_bad_message_gets_an_error_and_the_connection_goes_on(
    server: InProcessSluice, message: str, status: int, code: str, param: str | None
) -> None:
    async with connect(server) as ws:
        await ws.send(message)
        error = await receive(ws)
        assert error["type"] == "error" and error["status"] == status, error
        assert error["error"]["code"] == code and error["error"]["param"] == param, error
        events = await send_and_read(ws, create(max_output_tokens=3, stream_id="after"))
    assert events[-1]["type"] == "response.incomplete"
    assert all(e["stream_id"] == "after" for e in events)


async def test_an_error_names_the_lane_of_the_message(server: InProcessSluice) -> None:
    async with connect(server) as ws:
        await ws.send(create(temperature=9, stream_id="lane-7"))
        error = await receive(ws)
        made = (await send_and_read(ws, create(max_output_tokens=2)))[-1]
        await ws.send(json.dumps({"type": "response.retrieve", "response_id": made["response_id"]}))
        unkept = await receive(ws)
    assert error["stream_id"] == "lane-7" and error["error"]["param"] == "temperature"
    assert unkept["status"] == 400 and "background" in unkept["error"]["message"]


async def test_the_key_is_checked_once_and_another_tenants_responses_are_not_found(
    server: InProcessSluice,
) -> None:
    async with connect(server, "sk-wrong") as ws:
        refused = await receive(ws)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await ws.recv()
    assert refused["type"] == "error" and refused["status"] == 401, refused
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    async with websockets.connect(
        ws_url(server), additional_headers={"X-Api-Key": "sk-acme"}
    ) as ws:
        made = await send_and_read(ws, create(max_output_tokens=2, background=True))
    response_id = made[-1]["response_id"]
    async with websockets.connect(
        ws_url(server),
        subprotocols=["sluice.bearer.sk-globex"],  # type: ignore[list-item]
    ) as ws:
        for kind in ("response.retrieve", "response.cancel"):
            await ws.send(json.dumps({"type": kind, "response_id": response_id}))
            assert (await receive(ws))["status"] == 404


def test_an_error_event_carries_the_status_and_retry_after_as_openais() -> None:
    from openai.types.responses.responses_server_event import ResponseWsError

    from server.core.errors import TenantQuotaExceeded
    from server.responses_api.ws_wire import error_event

    event = error_event(TenantQuotaExceeded("over the quota", retry_after=2.4), "lane")
    assert event == {
        "type": "error",
        "status": 429,
        "error": {
            "message": "over the quota",
            "type": "rate_limit_error",
            "param": None,
            "code": "tenant_quota_exceeded",
            "headers": {"Retry-After": "2"},
        },
        "stream_id": "lane",
    }
    assert ResponseWsError.model_validate(event).error.headers == {"Retry-After": "2"}
