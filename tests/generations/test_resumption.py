"""Generations that outlive their connection: numbered events, resuming a stream, idempotent
retries, tenants kept apart, the grace period, and the WebSocket's one terminal message.

A real Sluice server on loopback, in this process, with the sim engine (slowed to ~20 ms a
step so that a client can leave mid-stream); the same contract on the real vLLM engine is in
`test_resumption_vllm.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import websockets
from conftest import InProcessSluice, parse_sse, sim_sluice, wait_at_zero, wait_until

KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
ACME = {"Authorization": "Bearer sk-acme"}
GLOBEX = {"Authorization": "Bearer sk-globex"}
# The grace period: long beside the moment between leaving and resuming in these tests, and
# waited out only by the grace period's own test, on a server of its own.
GRACE_SECONDS = 1
SHORT_GRACE_SECONDS = 0.2


def serve(root: Path, grace_seconds: float) -> InProcessSluice:
    # Steps of 10 ms: a 40-token answer streams for ~0.4 s, long enough for a client to leave
    # mid-stream and for a retry to attach while it runs.
    config = f"resume: {{grace_seconds: {grace_seconds}}}\n"
    return sim_sluice(root, "--sim-step-base-ms", "10", config=config, keys=KEYS)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    with serve(tmp_path_factory.mktemp("resumption"), GRACE_SECONDS) as server:
        yield server


@pytest.fixture
def short_grace_server(tmp_path: Path) -> Iterator[InProcessSluice]:
    with serve(tmp_path, SHORT_GRACE_SECONDS) as server:
        yield server


def chat(max_tokens: int = 40, seed: int = 7, **extra: object) -> dict:
    return {
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": max_tokens,
        "seed": seed,
        "stream": True,
        **extra,
    }


def text_of(events: list[tuple[int, str]]) -> str:
    parts = []
    for _, data in events:
        if data == "[DONE]":
            continue
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


def stream(
    server: InProcessSluice,
    body: dict,
    headers: dict,
    *,
    leave_after: int | None = None,
    each_event: Callable[[], None] | None = None,
) -> tuple[httpx.Headers, list[tuple[int, str]]]:
    """POST a streamed request; read it all, or leave after `leave_after` events; `each_event`
    is called after each event read, but the one it leaves after (`HeldSteps.step`: a step a
    read event)."""
    lines: list[str] = []
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            lines.append(line)
            if leave_after is not None and len(parse_sse(lines)) >= leave_after:
                break
            if each_event is not None and line.startswith("data: "):
                each_event()
        return response.headers, parse_sse(lines)


def resume(
    server: InProcessSluice, public_id: str, headers: dict, **params: object
) -> tuple[int, list[tuple[int, str]]]:
    with httpx.stream(
        "GET",
        f"{server.url}/v1/chat/completions/{public_id}/stream",
        headers=headers,
        params=params,
        timeout=30,
    ) as response:
        lines = list(response.iter_lines())
        return response.status_code, parse_sse(lines) if response.status_code == 200 else lines


def generation_id(events: list[tuple[int, str]]) -> str:
    return str(json.loads(events[0][1])["id"])


def test_a_resumable_streams_events_are_numbered_from_one_done_included(
    server: InProcessSluice,
) -> None:
    _, events = stream(server, chat(8), {**ACME, "Idempotency-Key": "numbered"})
    assert [event_id for event_id, _ in events] == list(range(1, len(events) + 1))
    assert events[-1][1] == "[DONE]"
    # A plain stream (nothing to resume) is as OpenAI's: `data:` lines alone.
    _, plain = stream(server, chat(8), ACME)
    assert {event_id for event_id, _ in plain} == {None}
    assert [data for _, data in plain][-1] == "[DONE]" and len(plain) == len(events)


def test_a_stream_resumed_after_a_disconnect_is_the_uninterrupted_one(
    server: InProcessSluice,
) -> None:
    # The uninterrupted stream is read meanwhile, in a thread (the two share engine steps).
    with ThreadPoolExecutor(1) as uninterrupted:
        reading = uninterrupted.submit(stream, server, chat(), ACME)
        _, head = stream(server, chat(), {**ACME, "Idempotency-Key": "story-1"}, leave_after=5)
        public_id = generation_id(head)
        status, tail = resume(server, public_id, {**ACME, "Last-Event-ID": str(head[-1][0])})
        _, whole = reading.result()
    assert public_id.startswith("chatcmpl-")
    assert status == 200
    # Each event once, in order: the text that waited for the reader may come merged into
    # one chunk, under the number of the last event it holds.
    ids = [i for i, _ in tail]
    assert ids == sorted(set(ids)) and ids[0] > 5 and tail[-1][1] == "[DONE]"
    assert text_of(head + tail) == text_of(whole)
    # `starting_after` says the same; with neither, the stream starts from the first event.
    _, again = resume(server, public_id, ACME, starting_after=head[-1][0])
    assert text_of(again) == text_of(tail) and again[-1] == tail[-1]
    _, from_start = resume(server, public_id, ACME)
    assert text_of(from_start) == text_of(head + tail) and from_start[-1] == tail[-1]
    # Resuming after any number a reader was sent continues exactly there.
    middle = ids[len(ids) // 2]
    _, rest = resume(server, public_id, ACME, starting_after=middle)
    assert text_of([e for e in tail if e[0] <= middle] + rest) == text_of(tail)
    # The request sent again with its key and the last event id resumes as the GET does (a
    # router forwards a POST's headers, not a GET's).
    retry_headers = {**ACME, "Idempotency-Key": "story-1", "Last-Event-ID": str(head[-1][0])}
    replayed, retried = stream(server, chat(), retry_headers)
    assert replayed["idempotent-replayed"] == "true"
    assert text_of(retried) == text_of(tail) and retried[-1] == tail[-1]
    assert retried[0][0] > head[-1][0]


def test_an_idempotent_retry_attaches_while_running_and_replays_after_the_end(
    server: InProcessSluice,
) -> None:
    requests_before = server.metric("sluice_requests_total")
    headers = {**ACME, "Idempotency-Key": "retry-streamed"}
    # The engine held, a step for each event read: it runs when the retry attaches.
    with server.held_steps() as steps:
        _, first = stream(server, chat(), headers, leave_after=3, each_event=steps.step)
        replayed_headers, attached = stream(server, chat(), headers, each_event=steps.step)
    assert replayed_headers["idempotent-replayed"] == "true"
    # (what waited for the reader may come merged, under the number of its last event)
    assert text_of(attached).startswith(text_of(first)) and attached[-1][1] == "[DONE]"
    _, after_end = stream(server, chat(), headers)
    assert text_of(after_end) == text_of(attached) and after_end[-1] == attached[-1]
    # Whole responses: the same body, once generated.
    body = {**chat(12), "stream": False}
    whole_headers = {**ACME, "Idempotency-Key": "retry-whole"}
    one = httpx.post(server.url + "/v1/chat/completions", json=body, headers=whole_headers)
    two = httpx.post(server.url + "/v1/chat/completions", json=body, headers=whole_headers)
    assert one.status_code == two.status_code == 200
    assert "idempotent-replayed" not in one.headers
    assert two.headers["idempotent-replayed"] == "true"
    assert one.json()["id"] == two.json()["id"]
    assert one.json()["choices"] == two.json()["choices"]
    wait_until(lambda: server.metric("sluice_running_requests") == 0, 60)
    assert server.metric("sluice_requests_total") - requests_before == 2  # two generations


def test_a_changed_body_under_the_same_key_is_refused(server: InProcessSluice) -> None:
    headers = {**ACME, "Idempotency-Key": "changed"}
    stream(server, chat(4), headers)
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat(5), headers=headers)
    assert reply.status_code == 422
    assert reply.json()["error"]["code"] == "idempotency_key_reused"
    too_long = httpx.post(
        server.url + "/v1/chat/completions",
        json=chat(4),
        headers={**ACME, "Idempotency-Key": "k" * 256},
    )
    assert too_long.status_code == 400


async def test_concurrent_duplicates_reach_the_engine_once(server: InProcessSluice) -> None:
    requests_before = server.metric("sluice_requests_total")
    body = {**chat(16), "stream": False}
    headers = {**ACME, "Idempotency-Key": "stampede"}
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=body, headers=headers) for _ in range(8))
        )
    assert {reply.status_code for reply in replies} == {200}
    assert len({reply.json()["id"] for reply in replies}) == 1
    assert sorted(reply.headers.get("idempotent-replayed", "") for reply in replies) == [
        "",
        *["true"] * 7,
    ]
    assert server.metric("sluice_requests_total") - requests_before == 1


def test_tenants_with_the_same_key_stay_apart(server: InProcessSluice) -> None:
    _, acme = stream(server, chat(6, seed=1), {**ACME, "Idempotency-Key": "shared"})
    # The same key from another tenant is another generation (no 422, no replay).
    globex_headers, globex = stream(
        server, chat(6, seed=2), {**GLOBEX, "Idempotency-Key": "shared"}
    )
    assert "idempotent-replayed" not in globex_headers
    assert generation_id(acme) != generation_id(globex)
    # Another tenant's generation is not found, exactly as an unknown one.
    status, lines = resume(server, generation_id(acme), GLOBEX)
    unknown_status, unknown_lines = resume(server, "chatcmpl-" + "0" * 32, GLOBEX)
    assert status == unknown_status == 404
    assert json.loads("".join(lines))["error"]["code"] == "not_found"
    assert json.loads("".join(lines))["error"]["message"].replace(
        generation_id(acme), "X"
    ) == json.loads("".join(unknown_lines))["error"]["message"].replace("chatcmpl-" + "0" * 32, "X")
    # A stream that was not sent with a key cannot be resumed.
    _, plain = stream(server, chat(4), ACME)
    assert resume(server, generation_id(plain), ACME)[0] == 404


def test_a_resumable_generation_left_unread_ends_after_the_grace_period(
    short_grace_server: InProcessSluice,
) -> None:
    server = short_grace_server
    aborts_before = server.metric("sluice_engine_aborts_total")
    _, head = stream(
        server,
        chat(1000),
        {**ACME, "Idempotency-Key": "abandoned", "X-Request-Timeout-Ms": "600000"},
        leave_after=3,
    )
    # It keeps running without a reader, until the grace period has passed.
    wait_until(
        lambda: server.metric("sluice_engine_aborts_total") > aborts_before,
        SHORT_GRACE_SECONDS + 10,
        message="the abandoned generation is aborted",
    )
    status, tail = resume(server, generation_id(head), {**ACME, "Last-Event-ID": "3"})
    assert status == 200
    error = json.loads(tail[-2][1])["error"]
    assert error["code"] == "cancelled" and tail[-1][1] == "[DONE]"


async def test_a_websocket_generation_resumes_on_another_connection(
    server: InProcessSluice,
) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/ws?api_key=sk-acme"
    request = {k: v for k, v in chat().items() if k != "stream"}

    async def uninterrupted() -> list[dict]:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "generate", "id": "whole", "request": request}))
            return await _read_until_final(ws, "whole")

    # The uninterrupted generation is read meanwhile (the two share engine steps).
    reading = asyncio.create_task(uninterrupted())
    async with websockets.connect(url) as ws:
        await ws.send(
            json.dumps(
                {"type": "generate", "id": "a", "request": request, "idempotency_key": "ws-story"}
            )
        )
        head = [json.loads(await ws.recv()) for _ in range(4)]
    assert all(m["type"] == "delta" for m in head)
    public_id, last_seq = head[0]["generation"], head[-1]["seq"]
    async with websockets.connect(url) as ws:
        await ws.send(
            json.dumps({"type": "resume", "id": "b", "generation": public_id, "after": last_seq})
        )
        tail = await _read_until_final(ws, "b")
        await ws.send(json.dumps({"type": "resume", "id": "c", "generation": "chatcmpl-nope"}))
        missing = json.loads(await ws.recv())
    whole = await reading
    seqs = [m["seq"] for m in head + tail]
    assert seqs == sorted(set(seqs))
    assert "".join(m.get("text", "") for m in head + tail) == "".join(
        m.get("text", "") for m in whole
    )
    assert tail[-1]["type"] == "final" and tail[-1]["usage"] == whole[-1]["usage"]
    assert missing["type"] == "error" and missing["error"]["code"] == "not_found"


async def _read_until_final(ws: websockets.ClientConnection, gen_id: str) -> list[dict]:
    messages = []
    while True:
        message = json.loads(await asyncio.wait_for(ws.recv(), 30))
        assert message["id"] == gen_id and message["type"] in ("delta", "final"), message
        messages.append(message)
        if message["type"] == "final":
            return messages


async def race_generates_and_cancels(url: str, max_tokens: int, pairs: int = 1000) -> None:
    """`pairs` generate+cancel pairs on one WebSocket, the cancel sent at once (two in three)
    or once the generation streams: every id gets exactly one final or error, and nothing
    comes for any of them afterwards."""
    terminal: dict[str, list[str]] = {}
    request = {"messages": [{"role": "user", "content": "race"}], "max_tokens": max_tokens}
    async with websockets.connect(url, max_size=None) as ws:

        async def send_pairs() -> None:
            for i in range(pairs):
                await ws.send(json.dumps({"type": "generate", "id": f"g{i}", "request": request}))
                if i % 3:
                    await ws.send(json.dumps({"type": "cancel", "id": f"g{i}"}))

        sending = asyncio.create_task(send_pairs())
        while sum(len(v) for v in terminal.values()) < pairs:
            message = json.loads(await asyncio.wait_for(ws.recv(), 120))
            if message["type"] == "delta":
                if int(message["id"][1:]) % 3 == 0:  # the rest: cancelled once it streams
                    await ws.send(json.dumps({"type": "cancel", "id": message["id"]}))
                continue
            terminal.setdefault(message["id"], []).append(message["type"])
        await sending
        await ws.send(json.dumps({"type": "generate", "id": "last", "request": request}))
        assert (await _read_until_final(ws, "last"))[-1]["type"] == "final"
    assert sorted(terminal) == sorted(f"g{i}" for i in range(pairs))
    assert all(len(kinds) == 1 for kinds in terminal.values())


async def test_generate_then_cancel_races_end_each_generation_once(
    server: InProcessSluice,
) -> None:
    await race_generates_and_cancels(
        server.url.replace("http://", "ws://") + "/v1/ws?api_key=sk-acme", max_tokens=6
    )
    wait_at_zero(server, "sluice_running_requests", "sluice_queue_depth", timeout=10)


def test_nothing_is_left_once_readers_are_gone(server: InProcessSluice) -> None:
    wait_at_zero(server, "sluice_running_requests", "sluice_engine_unfinished_requests", timeout=10)
    assert server.metric("sluice_budget_in_use") == 0
