"""Bad input gets a clear OpenAI-shaped error and leaks nothing (sim engine: the real one adds
nothing to validation)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from conftest import SluiceProcess

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _post(server: SluiceProcess, path: str, **kwargs) -> httpx.Response:  # type: ignore[no-untyped-def]
    return httpx.post(server.url + path, timeout=10, **kwargs)


def _assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"messages": "hello"}, "invalid_request", "messages"),
        ({"messages": []}, "invalid_request", "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_request", "messages[0].role"),
        ({**CHAT, "max_tokens": "many"}, "invalid_request", "max_tokens"),
        ({**CHAT, "max_tokens": 0}, "invalid_request", "max_tokens"),
        ({**CHAT, "temperature": 9}, "invalid_request", "temperature"),
        ({**CHAT, "stream": "yes"}, "invalid_request", "stream"),
        ({**CHAT, "stop": [1, 2]}, "invalid_request", "stop"),
        ({**CHAT, "n": 2}, "unsupported_parameter", "n"),
        ({**CHAT, "logprobs": True}, "unsupported_parameter", "logprobs"),
        ({**CHAT, "tools": [{"type": "function"}]}, "unsupported_parameter", "tools"),
        ({**CHAT, "frobnicate": 1}, "unsupported_parameter", "frobnicate"),
        ({**CHAT, "stream_options": {"include_usage": True}}, "invalid_request", "stream_options"),
        ({**CHAT, "max_tokens": 100_000}, "context_length_exceeded", "max_tokens"),
    ],
)
def test_chat_body_errors(sim_server: SluiceProcess, body: dict, code: str, param: str) -> None:
    error = _assert_error(_post(sim_server, "/v1/chat/completions", json=body), 400, code)
    assert error["param"] == param


def test_transport_level_errors(sim_server: SluiceProcess) -> None:
    _assert_error(_post(sim_server, "/v1/chat/completions", content=b"{not json"),
                  400, "invalid_request")
    _assert_error(_post(sim_server, "/v1/chat/completions", content=b"[1, 2]"),
                  400, "invalid_request")
    _assert_error(_post(sim_server, "/v1/chat/completions", json={**CHAT, "model": "gpt-9"}),
                  404, "model_not_found")
    huge = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
    _assert_error(_post(sim_server, "/v1/chat/completions", json=huge), 413, "payload_too_large")
    _assert_error(_post(sim_server, "/v1/completions", json={"prompt": ["a", "b"]}),
                  400, "unsupported_parameter")
    _assert_error(httpx.get(sim_server.url + "/v1/chat/completions"), 405, "method_not_allowed")
    _assert_error(httpx.get(sim_server.url + "/v2/nothing"), 404, "not_found")


def test_a_request_id_is_echoed(sim_server: SluiceProcess) -> None:
    ok = _post(sim_server, "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"})
    assert ok.headers["x-request-id"] == "abc-123"
    assert ok.json()["id"] == "chatcmpl-abc-123"
    bad = _post(sim_server, "/v1/chat/completions", json={**CHAT, "n": 5})
    assert len(bad.headers["x-request-id"]) == 32


async def test_garbage_on_the_websocket_gets_errors_and_the_connection_survives(
    sim_server: SluiceProcess,
) -> None:
    url = sim_server.url.replace("http://", "ws://") + "/v1/ws"
    async with websockets.connect(url) as ws:
        garbage = [
            "not json",
            "[1,2,3]",
            json.dumps({"type": "generate"}),
            json.dumps({"type": "dance", "id": "a"}),
            json.dumps({"type": "cancel", "id": "never-started"}),
            json.dumps({"type": "generate", "id": "b", "request": {"messages": 5}}),
            json.dumps({"type": "generate", "id": "c", "request": {**CHAT, "model": "nope"}}),
        ]
        for raw in garbage:
            await ws.send(raw)
        errors = [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in garbage]
        assert [e["type"] for e in errors] == ["error"] * len(garbage)
        assert [e["id"] for e in errors] == [None, None, None, "a", "never-started", "b", "c"]
        assert errors[-1]["error"]["code"] == "model_not_found"
        # Still usable afterwards.
        await ws.send(json.dumps({"type": "generate", "id": "ok", "request": CHAT}))
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if message["type"] == "final":
                break
        assert message["id"] == "ok" and message["usage"]["completion_tokens"] == 4


def test_nothing_leaks_after_bad_input(sim_server: SluiceProcess) -> None:
    for body in ({**CHAT, "n": 2}, {**CHAT, "max_tokens": 100_000}, {"messages": 1}):
        _post(sim_server, "/v1/chat/completions", json=body)
    assert sim_server.metric("sluice_running_requests") == 0
    assert sim_server.metric("sluice_queue_depth") == 0
    assert sim_server.metric("sluice_budget_in_use") == 0
    assert sim_server.metric("sluice_engine_unfinished_requests") == 0
    assert sim_server.metric("sluice_requests_total", outcome="invalid") >= 3
