"""A client that stops reading (socket open, nothing consumed) is dropped after the send
timeout, and its engine request is aborted: a stalled reader does not hold the engine."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from conftest import FAST_SIM, InProcessSluice, loopback_listener, sim_sluice, wait_until

pytestmark = pytest.mark.service


@pytest.fixture
def impatient_server(tmp_path: Path):  # type: ignore[no-untyped-def]
    # The connections it accepts inherit the listener's send buffer: fixed at 16 KiB (Linux
    # doubles it), not grown by the kernel up to 4 MiB, so a reader that stops makes the
    # server's sends block after kilobytes rather than after megabytes of generated text.
    listener = loopback_listener()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 * 1024)
    # A fast engine and a long answer: the socket buffers must fill before a send blocks.
    # Uncalibrated: a stalled reader is dropped whatever the engine's measured speed.
    with sim_sluice(
        tmp_path,
        "--send-timeout-seconds", "0.2", "--sim-max-model-len", "65536", *FAST_SIM,
        listener=listener,
    ) as server:  # fmt: skip
        yield server


def test_a_client_that_stops_reading_is_dropped(impatient_server: InProcessSluice) -> None:
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "talk"}],
            "max_tokens": 60000,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", impatient_server.port))
    try:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\n"
            b"Content-Type: application/json\r\nX-Request-Timeout-Ms: 36000000\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        # Read nothing more. The server's buffers fill, its sends block, and the send guard
        # drops the stream while our socket is still open.
        wait_until(
            lambda: impatient_server.metric("sluice_cancellations_total", stage="running") == 1,
            30,
            message="the stalled stream was dropped",
        )
        assert impatient_server.metric("sluice_engine_unfinished_requests") == 0
        generated = impatient_server.metric("sluice_generated_tokens_total")
        assert 0 < generated < 60000
    finally:
        sock.close()


async def test_a_websocket_client_that_stops_reading_is_dropped(
    impatient_server: InProcessSluice,
) -> None:
    import websockets

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", impatient_server.port))
    url = impatient_server.url.replace("http://", "ws://") + "/v1/ws"
    # max_queue=1: the client library stops reading the socket once one message waits unread.
    async with websockets.connect(url, sock=sock, max_queue=1) as ws:
        # Sixteen long answers: when the writer falls behind, the engine's tokens are merged
        # into fewer, larger deltas, so only the text's total size (~360 KB an answer) fills
        # the socket buffers and the two libraries' own (some 250 KB in all).
        for i in range(16):
            await ws.send(
                json.dumps(
                    {
                        "type": "generate",
                        "id": f"long{i}",
                        "timeout_ms": 36_000_000,
                        "request": {
                            "messages": [{"role": "user", "content": "talk"}],
                            "max_tokens": 60000,
                            "ignore_eos": True,
                        },
                    }
                )
            )
        # Read nothing. The writer's sends block, the send guard cancels them, and the
        # connection's generations are cancelled with it.
        wait_until(
            lambda: impatient_server.metric("sluice_cancellations_total", stage="running") >= 1,
            30,
            message="the stalled websocket was dropped",
        )
        wait_until(
            lambda: impatient_server.metric("sluice_engine_unfinished_requests") == 0,
            10,
            message="its engine requests aborted",
        )
        assert "websocket client stopped reading" in impatient_server.log()
        # Leave without a closing handshake: either side's close frame would queue behind the
        # data this client never read, and wait out websockets' close_timeout (10 s).
        ws.transport.abort()
