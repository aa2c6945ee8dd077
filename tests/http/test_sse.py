"""Sluice's SSE responder under a real uvicorn server on loopback, in this process: keep-alive
pings while the content waits (a comment, or the API's own event), a clean end, and a client
that leaves mid-stream stopping the content at once. Ordering assertions only: the ping
interval sets how fast the test runs, never what it asserts."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.routing import Route

from server.http.send_guard import SendGuard
from server.http.sse import PING, SSEResponse

EVENT_PING = b'event: ping\ndata: {"type": "ping"}\n\n'


@asynccontextmanager
async def serving(
    content: Callable[[], AsyncIterator[bytes]],
    ping: Callable[[], bytes] | None = None,
    made: list[SSEResponse] | None = None,  # each response, as it is made
) -> AsyncIterator[tuple[int, uvicorn.Server]]:
    guard = SendGuard(timeout=30.0)

    async def stream(request: Request) -> SSEResponse:
        response = SSEResponse(content(), guard, ping_seconds=0.02, ping=ping)
        if made is not None:
            made.append(response)
        return response

    app = Starlette(routes=[Route("/stream", stream)])
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None))  # records reach caplog
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        for _ in range(1000):
            if server.started:
                break
            await asyncio.sleep(0.01)  # polling interval, not a stand-in for a condition
        assert server.started
        yield int(listener.getsockname()[1]), server
    finally:
        server.should_exit = True
        await task
        listener.close()


async def open_stream(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """The response's head, read; the body is the reader's."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stream HTTP/1.1\r\nHost: test\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    return reader, writer, head


async def test_pings_keep_a_waiting_stream_alive_then_it_ends_cleanly() -> None:
    pinged = asyncio.Event()

    async def content() -> AsyncIterator[bytes]:
        await pinged.wait()  # nothing to send until the client has seen pings
        yield b"data: done\n\n"

    async with serving(content) as (port, _):
        reader, writer, head = await open_stream(port)
        assert b"content-type: text/event-stream; charset=utf-8" in head
        assert b"transfer-encoding: chunked" in head
        body = b""
        while body.count(PING) < 2:
            body += await asyncio.wait_for(reader.read(4096), 10)
        pinged.set()
        while not body.endswith(b"0\r\n\r\n"):  # the chunked body's end: more_body False
            body += await asyncio.wait_for(reader.read(4096), 10)
        assert body.index(PING) < body.index(b"data: done")
        writer.close()


async def test_an_apis_own_ping_event_replaces_the_comment() -> None:
    pinged = asyncio.Event()

    async def content() -> AsyncIterator[bytes]:
        await pinged.wait()
        yield b"data: done\n\n"

    async with serving(content, ping=lambda: EVENT_PING) as (port, _):
        reader, writer, _ = await open_stream(port)
        body = b""
        while EVENT_PING not in body:
            body += await asyncio.wait_for(reader.read(4096), 10)
        assert PING not in body
        pinged.set()
        while not body.endswith(b"0\r\n\r\n"):
            body += await asyncio.wait_for(reader.read(4096), 10)
        writer.close()


async def test_a_final_write_ends_the_body_in_the_same_write(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A run's reader writes its last events with `final` (GenerationRun.written): the chunk
    # and the body's end go out as one, and nothing is sent after them.
    made: list[SSEResponse] = []

    async def content() -> AsyncIterator[bytes]:
        await made[0].write(b"data: first\n\n")
        await made[0].write(b"data: last\n\n", final=True)
        return
        yield  # (an async generator that yields nothing itself)

    async with serving(content, made=made) as (port, _):
        reader, writer, _ = await open_stream(port)
        body = b""
        while not body.endswith(b"0\r\n\r\n"):
            body += await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
    assert body.endswith(b"data: last\n\n\r\n0\r\n\r\n") and body.count(b"0\r\n\r\n") == 1
    assert "Exception in ASGI application" not in caplog.text


async def test_a_client_that_leaves_stops_the_content_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started, stopped = asyncio.Event(), asyncio.Event()

    async def content() -> AsyncIterator[bytes]:
        try:
            while True:  # endless: only the client's leaving ends it
                started.set()
                yield b"data: tok\n\n"
                await asyncio.sleep(0)
        finally:
            stopped.set()

    async with serving(content) as (port, server):
        reader, writer, _ = await open_stream(port)
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.wait_for(reader.read(4096), 10)
        writer.close()
        await asyncio.wait_for(stopped.wait(), 10)
        # The request's task ended without an error, and the connection with it.
        for _ in range(500):
            if not server.server_state.connections:
                break
            await asyncio.sleep(0.01)  # polling interval, not a stand-in for a condition
        assert not server.server_state.connections
    assert "Exception in ASGI application" not in caplog.text
