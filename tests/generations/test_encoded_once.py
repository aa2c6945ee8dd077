"""Each streamed delta is encoded once, into the wire format its client speaks: OpenAI's chunks
for the chat API alone; Anthropic's events, the Responses API's and Sluice's WebSocket
messages rendered from the run's typed events, with no OpenAI chunk made for them."""

from __future__ import annotations

import asyncio
import functools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
import websockets
from conftest import InProcessSluice

from server.anthropic.replies import MessageStream
from server.chat_api.chunks import ChunkEncoder
from server.responses_api.wire import ResponseBuilder
from server.websocket_api import routes as ws_routes

HELLO = [{"role": "user", "content": "Tell me about the sea."}]
TOKENS = 24


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """What each API's per-delta encoder rendered, counted, and the chunk encoders made (the
    in-process server runs this code)."""
    counted: Counter[str] = Counter()

    def count(name: str, owner: Any, attribute: str) -> None:
        original: Callable[..., Any] = getattr(owner, attribute)

        @functools.wraps(original)
        def counting(*args: Any, **kwargs: Any) -> Any:
            rendered = original(*args, **kwargs)
            if rendered or attribute == "__init__":
                counted[name] += 1
            return rendered

        monkeypatch.setattr(owner, attribute, counting)

    count("chunk encoders", ChunkEncoder, "__init__")
    count("chunk", ChunkEncoder, "text")
    count("chunk", ChunkEncoder, "delta")
    count("anthropic", MessageStream, "text")
    count("responses", ResponseBuilder, "text")
    count("ws", ws_routes, "ws_message")
    yield counted


def model(server: InProcessSluice) -> str:
    return str(httpx.get(server.url + "/v1/models").json()["data"][0]["id"])


def sse_data(server: InProcessSluice, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    return [orjson.loads(line[6:]) for line in lines if line != "data: [DONE]"]


def test_a_chat_stream_encodes_one_chunk_per_delta(
    sim_server: InProcessSluice, calls: Counter[str]
) -> None:
    body = {"model": model(sim_server), "messages": HELLO, "max_tokens": TOKENS, "stream": True}
    chunks = sse_data(sim_server, "/v1/chat/completions", body)
    texts = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert texts
    assert calls == {"chunk encoders": 1, "chunk": len(texts)}


# Anthropic's and the Responses API's SSE streams: (path, body, the delta events' type).
OWN_EVENTS = {
    "anthropic": (
        "/v1/messages",
        {"messages": HELLO, "max_tokens": TOKENS},
        "content_block_delta",
    ),
    "responses": (
        "/v1/responses",
        {"input": "Tell me about the sea.", "max_output_tokens": TOKENS, "store": False},
        "response.output_text.delta",
    ),
}


@pytest.mark.parametrize("api", OWN_EVENTS)
def test_a_stream_of_another_api_encodes_its_own_events_and_no_openai_chunk(
    sim_server: InProcessSluice, calls: Counter[str], api: str
) -> None:
    path, body, delta_type = OWN_EVENTS[api]
    events = sse_data(sim_server, path, {"model": model(sim_server), **body, "stream": True})
    deltas = [e for e in events if e["type"] == delta_type]
    assert deltas
    assert calls == {api: len(deltas)}


def test_a_websocket_stream_encodes_its_own_messages_and_no_openai_chunk(
    sim_server: InProcessSluice, calls: Counter[str]
) -> None:
    request = {"model": model(sim_server), "messages": HELLO, "max_tokens": TOKENS}

    async def stream() -> list[dict[str, Any]]:
        url = sim_server.url.replace("http", "ws") + "/v1/ws"
        received = []
        async with websockets.connect(url) as ws:
            await ws.send(orjson.dumps({"type": "generate", "id": "a", "request": request}))
            while True:
                message = orjson.loads(await ws.recv())
                received.append(message)
                if message["type"] in ("final", "error"):
                    return received

    messages = asyncio.run(stream())
    assert messages[-1]["type"] == "final"
    assert calls == {"ws": len(messages)}
