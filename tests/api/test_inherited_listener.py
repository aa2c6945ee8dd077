"""`sluice serve --fd N` (how `sluice fleet` and the tests start servers): the inherited
listener keeps its TCP family, so that each connection it accepts gets TCP_NODELAY, as with
--host/--port. Taken for a Unix socket (uvicorn's own `fd`), its connections went without,
and a response written in two sends waited 40 ms for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
import uvloop

from server.api.serving import inherited_listener


class Accepted(asyncio.Protocol):
    def __init__(self, transports: asyncio.Queue[asyncio.BaseTransport]) -> None:
        self.transports = transports

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transports.put_nowait(transport)


async def nodelay_of_an_accepted_connection(listener: socket.socket) -> int:
    transports: asyncio.Queue[asyncio.BaseTransport] = asyncio.Queue()
    server = await asyncio.get_running_loop().create_server(
        lambda: Accepted(transports), sock=listener
    )
    async with server:
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        transport = await transports.get()
        accepted = transport.get_extra_info("socket")
        nodelay = accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        await writer.wait_closed()
        transport.close()
    return int(nodelay)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_connections_on_an_inherited_listener_are_sent_without_delay(loop: str) -> None:
    bound = socket.create_server(("127.0.0.1", 0))
    inherited = os.dup(bound.fileno())  # as the child's copy of the parent's socket
    bound.close()
    listener = inherited_listener(inherited)
    assert listener.family == socket.AF_INET
    runner = asyncio.run if loop == "asyncio" else uvloop.run
    assert runner(nodelay_of_an_accepted_connection(listener)) != 0
