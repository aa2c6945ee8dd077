"""Every HTTP request leaves exactly one access-log line (server/api/access.py): requests no
route serves and requests that made no generation timeline get the middleware's line, with
the method, the route's template or the redacted path, the status and the duration;
generation requests keep their timeline's line alone."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from conftest import AccessLines, InProcessSluice, wait_until

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(autouse=True)
def every_line(access_lines: AccessLines) -> AccessLines:
    """Every test here reads the access log."""
    return access_lines


def _settled_lines(server: InProcessSluice, handler: AccessLines, **fields: object) -> list[dict]:
    """The lines with `fields`, once one is written and a later request's line is too (so
    a second line for the same request would have been written by then)."""
    wait_until(lambda: handler.where(**fields), 60, message=f"no access line {fields}")
    fence = f"fence-{uuid.uuid4().hex}"
    httpx.get(server.url + "/health", headers={"X-Request-Id": fence}, timeout=10)
    wait_until(lambda: handler.where(request_id=fence), 60, message="no fence line")
    return handler.where(**fields)


def test_an_unknown_route_is_answered_in_openai_shape_and_logged_once(
    sim_server: InProcessSluice, access_lines: AccessLines
) -> None:
    before = sim_server.metric("sluice_unmatched_requests_total", method="POST", status="404")
    path = f"/v1/nope-{uuid.uuid4().hex}"
    response = httpx.post(
        sim_server.url + path + "?api_key=sk-not-in-logs", json={"input": "hi"}, timeout=10
    )
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    [line] = _settled_lines(sim_server, access_lines, path=path)
    assert line["api"] == "http"
    assert (line["method"], line["status"], line["outcome"]) == ("POST", 404, "invalid")
    assert 0 <= line["duration_s"] < 10
    assert not any("sk-not-in-logs" in json.dumps(line) for line in access_lines.lines)
    after = sim_server.metric("sluice_unmatched_requests_total", method="POST", status="404")
    assert after == before + 1


def test_a_method_a_route_lacks_is_logged_with_the_routes_template(
    sim_server: InProcessSluice, access_lines: AccessLines
) -> None:
    before = sim_server.metric("sluice_unmatched_requests_total", method="PUT", status="405")
    request_id = uuid.uuid4().hex
    response = httpx.put(
        sim_server.url + "/v1/chat/completions", headers={"X-Request-Id": request_id}, timeout=10
    )
    assert response.status_code == 405
    [line] = _settled_lines(sim_server, access_lines, request_id=request_id)
    assert (line["method"], line["path"], line["status"]) == ("PUT", "/v1/chat/completions", 405)
    after = sim_server.metric("sluice_unmatched_requests_total", method="PUT", status="405")
    assert after == before + 1


def test_secrets_in_a_path_are_redacted_and_a_long_path_truncated(
    sim_server: InProcessSluice, access_lines: AccessLines
) -> None:
    secret, long = uuid.uuid4().hex, uuid.uuid4().hex
    for request_id, path in ((secret, "/v1/x;api_key=sk-in-the-path"), (long, "/" + "a" * 500)):
        httpx.get(sim_server.url + path, headers={"X-Request-Id": request_id}, timeout=10)
    [line] = _settled_lines(sim_server, access_lines, request_id=secret)
    assert line["path"] == "/v1/x;api_key=[redacted]"
    assert not any("sk-in-the-path" in json.dumps(line) for line in access_lines.lines)
    [line] = _settled_lines(sim_server, access_lines, request_id=long)
    assert line["path"] == "/" + "a" * 198 + "…"


def test_routes_without_a_timeline_log_their_template_once(
    sim_server: InProcessSluice, access_lines: AccessLines
) -> None:
    """/v1/models, a /tokenize body refused before any timeline, a resume of an unknown
    generation (404 of a route that matched: not counted as unmatched)."""
    before = sim_server.metric("sluice_unmatched_requests_total", status="404")
    ids = [uuid.uuid4().hex for _ in range(3)]
    assert httpx.get(
        sim_server.url + "/v1/models", headers={"X-Request-Id": ids[0]}, timeout=10
    ).is_success
    refused = httpx.post(
        sim_server.url + "/tokenize",
        content=b"{not json",
        headers={"X-Request-Id": ids[1], "Content-Type": "application/json"},
        timeout=10,
    )
    assert refused.status_code == 400
    missing = httpx.get(
        sim_server.url + f"/v1/chat/completions/chatcmpl-{ids[2]}/stream",
        headers={"X-Request-Id": ids[2]},
        timeout=10,
    )
    assert missing.status_code == 404
    expected = [
        ("GET", "/v1/models", 200, "completed"),
        ("POST", "/tokenize", 400, "invalid"),
        ("GET", "/v1/chat/completions/{id}/stream", 404, "invalid"),
    ]
    for request_id, want in zip(ids, expected, strict=True):
        [line] = _settled_lines(sim_server, access_lines, request_id=request_id)
        assert (line["method"], line["path"], line["status"], line["outcome"]) == want
    assert sim_server.metric("sluice_unmatched_requests_total", status="404") == before


def test_a_generation_request_keeps_its_timelines_line_alone(
    sim_server: InProcessSluice, access_lines: AccessLines
) -> None:
    completed, refused = uuid.uuid4().hex, uuid.uuid4().hex
    assert httpx.post(
        sim_server.url + "/v1/chat/completions",
        json=CHAT,
        headers={"X-Request-Id": completed},
        timeout=10,
    ).is_success
    malformed = httpx.post(
        sim_server.url + "/v1/completions",
        content=b"{not json",
        headers={"X-Request-Id": refused, "Content-Type": "application/json"},
        timeout=10,
    )
    assert malformed.status_code == 400

    [line] = _settled_lines(sim_server, access_lines, request_id=completed)
    assert (line["api"], line["outcome"], line["status"]) == ("chat", "completed", 200)
    [line] = _settled_lines(sim_server, access_lines, request_id=refused)
    assert (line["api"], line["outcome"], line["status"]) == ("completions", "invalid", 400)


def test_an_idempotent_replay_leaves_a_line_of_its_own(
    sim_server: InProcessSluice, access_lines: AccessLines
) -> None:
    """The replay's timeline is never finished (the first request's run answers it): the
    middleware logs it, and the first request keeps its timeline's line."""
    key, first, replay = (uuid.uuid4().hex for _ in range(3))
    for request_id in (first, replay):
        response = httpx.post(
            sim_server.url + "/v1/chat/completions",
            json=CHAT,
            headers={"X-Request-Id": request_id, "Idempotency-Key": key},
            timeout=10,
        )
        assert response.is_success
    [line] = _settled_lines(sim_server, access_lines, request_id=first)
    assert (line["api"], line["outcome"]) == ("chat", "completed")
    [line] = _settled_lines(sim_server, access_lines, request_id=replay)
    assert (line["api"], line["method"], line["path"], line["status"]) == (
        "http",
        "POST",
        "/v1/chat/completions",
        200,
    )


def test_a_websocket_connection_leaves_a_line_accepted_or_refused(
    sim_server: InProcessSluice, access_lines: AccessLines
) -> None:
    """An accepted connection's line (101) is written when it closes; a handshake to a path no
    route serves is refused (403) and logged with the path as sent."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    base = sim_server.url.replace("http://", "ws://")
    accepted = uuid.uuid4().hex
    with connect(base + "/v1/ws", additional_headers={"X-Request-Id": accepted}) as ws:
        ws.ping().wait(10)
    [line] = _settled_lines(sim_server, access_lines, request_id=accepted)
    assert (line["method"], line["path"], line["status"]) == ("GET", "/v1/ws", 101)

    path, refused = f"/v1/nope-{uuid.uuid4().hex}", uuid.uuid4().hex
    with pytest.raises(InvalidStatus) as handshake:
        connect(base + path, additional_headers={"X-Request-Id": refused})
    assert handshake.value.response.status_code == 403
    [line] = _settled_lines(sim_server, access_lines, request_id=refused)
    assert (line["method"], line["path"], line["status"]) == ("GET", path, 403)
