"""Keys stay secret, tenants stay apart: redacted logs, the WebSocket's bearer subprotocol
(from the `websockets` client and from Chromium), keys on every /v1 route, keys kept as
digests, failed-attempt throttling, strict configuration, /metrics on its own port, and every
route that reads a tenant's resource walked as another tenant.

Real Sluice processes (sim engine) on loopback.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from engine_adapters.sim import SimEngine
from server.app import build_app
from server.config import SluiceConfig, key_digest
from server.scheduler.runtime import SchedulerRuntime
from tests.conftest import ROOT, SluiceProcess, free_port

ACME_KEY, GLOBEX_KEY, DIGEST_KEY = "sk-acme-7f3a9c", "sk-globex-41d2e8", "sk-hashed-90be77"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceProcess]:
    root = tmp_path_factory.mktemp("security")
    config = root / "sluice.yaml"
    config.write_text(
        "tenants:\n"
        f"  acme: {{api_keys: [{ACME_KEY}]}}\n"
        f"  hashed: {{api_key_sha256: [{key_digest(DIGEST_KEY)}]}}\n")
    metrics_port = free_port()
    process = SluiceProcess(
        ["--engine", "sim", "--config", str(config), "--log-level", "info",
         "--metrics-port", str(metrics_port)],
        root / "server.log", env={"SLUICE_API_KEYS": f"{GLOBEX_KEY}:globex"})
    process.metrics_port = metrics_port  # type: ignore[attr-defined]
    try:
        process.wait_ready(60)
        yield process
    finally:
        process.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_keys_in_urls_and_headers_leave_no_trace_in_the_logs(
    server: SluiceProcess,
) -> None:
    ws_url = server.url.replace("http://", "ws://") + f"/v1/ws?api_key={ACME_KEY}"
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "g", "request": CHAT}))
        while json.loads(await ws.recv())["type"] != "final":
            pass
    async with httpx.AsyncClient(base_url=server.url) as client:
        assert (await client.get(f"/v1/models?api_key={GLOBEX_KEY}")).status_code == 401
        assert (await client.post("/v1/chat/completions", json=CHAT,
                                  headers=bearer(GLOBEX_KEY))).status_code == 200
    log = server.log_path.read_text()
    assert "WebSocket /v1/ws?api_key=[redacted]" in log  # uvicorn's line, redacted
    for key in (ACME_KEY, GLOBEX_KEY):
        assert key not in log


async def test_the_websocket_bearer_subprotocol_authenticates(server: SluiceProcess) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/ws"
    protocol = f"sluice.bearer.{ACME_KEY}"
    async with websockets.connect(url, subprotocols=[protocol]) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == protocol  # echoed, as browsers require
        await ws.send(json.dumps({"type": "generate", "id": "g", "request": CHAT}))
        while (message := json.loads(await ws.recv()))["type"] == "delta":
            pass
        assert message["type"] == "final"
    async with websockets.connect(url, subprotocols=["sluice.bearer.wrong"]) as ws:  # type: ignore[list-item]
        refused = json.loads(await ws.recv())
        assert refused["error"]["code"] == "invalid_api_key"


@pytest.mark.browser
def test_chromium_authenticates_with_the_bearer_subprotocol(server: SluiceProcess) -> None:
    from tests.observability.conftest import require_tool
    from tests.observability.test_chat_page_browser import CHROMIUM_FLAGS, _sync_playwright

    chromium = require_tool("chromium")
    with _sync_playwright()() as playwright:  # type: ignore[operator]
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            result = page.evaluate("""([url, key, request]) => new Promise((resolve) => {
                const ws = new WebSocket(url, ["sluice.bearer." + key]);
                ws.onopen = () => ws.send(JSON.stringify(
                    {type: "generate", id: "b", request: request}));
                ws.onmessage = (event) => {
                    const message = JSON.parse(event.data);
                    if (message.type !== "delta") {
                        resolve({protocol: ws.protocol, type: message.type});
                        ws.close();
                    }
                };
                ws.onerror = () => resolve({protocol: null, type: "socket error"});
            })""", [server.url.replace("http://", "ws://") + "/v1/ws", ACME_KEY, CHAT])
        finally:
            browser.close()
    assert result == {"protocol": f"sluice.bearer.{ACME_KEY}", "type": "final"}


def test_every_v1_route_wants_a_key_and_digests_work(server: SluiceProcess) -> None:
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=bearer(ACME_KEY)).status_code == 200
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    hashed = httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                        headers=bearer(DIGEST_KEY))
    assert hashed.status_code == 200
    wrong = httpx.post(server.url + "/v1/chat/completions", json=CHAT,
                       headers=bearer(DIGEST_KEY + "x"))
    assert wrong.status_code == 401
    for path in ("/health", "/ready"):  # the exceptions
        assert httpx.get(server.url + path).status_code == 200


def test_metrics_live_on_their_own_port(server: SluiceProcess) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 404
    scraped = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics")  # type: ignore[attr-defined]
    assert scraped.status_code == 200 and "sluice_requests_total" in scraped.text


def _routes_with_resources() -> list[str]:
    """Every route of the app that names one of a tenant's resources (`{id}`)."""
    engine = SimEngine()
    app = build_app(engine, SchedulerRuntime(SluiceConfig(), engine, "sim"), SluiceConfig(),
                    "sim")
    return [route.path for route in app.routes if "{id}" in getattr(route, "path", "")]


def test_another_tenants_resources_are_not_found_on_every_route(server: SluiceProcess) -> None:
    routes = _routes_with_resources()
    assert len(routes) >= 2
    for path in routes:
        kind_body = (dict(CHAT) if path.startswith("/v1/chat") else
                     {"prompt": "hi", "max_tokens": 4})
        endpoint = path.split("/{id}")[0]
        made = httpx.post(server.url + endpoint, json={**kind_body, "stream": True},
                          headers={**bearer(ACME_KEY), "Idempotency-Key": f"walk-{path}"})
        public_id = next(json.loads(line[6:])["id"] for line in made.text.splitlines()
                         if line.startswith("data: {"))
        url = server.url + path.replace("{id}", public_id)
        assert httpx.get(url, headers=bearer(ACME_KEY)).status_code == 200
        as_other = httpx.get(url, headers=bearer(GLOBEX_KEY))
        unknown = httpx.get(server.url + path.replace("{id}", public_id[:-4] + "0000"),
                            headers=bearer(GLOBEX_KEY))
        assert as_other.status_code == unknown.status_code == 404
        assert as_other.json()["error"]["code"] == "not_found"
    # The WebSocket's resume, likewise.
    ws_url = server.url.replace("http://", "ws://") + "/v1/ws"
    asyncio.run(_resume_as(ws_url, GLOBEX_KEY, public_id, "not_found"))
    asyncio.run(_resume_as(ws_url, ACME_KEY, public_id, "final"))


async def _resume_as(url: str, key: str, public_id: str, expected: str) -> None:
    async with websockets.connect(url, additional_headers=bearer(key)) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "r", "generation": public_id}))
        while (message := json.loads(await ws.recv()))["type"] == "delta":
            pass
        assert (message["error"]["code"] if message["type"] == "error"
                else message["type"]) == expected


def test_failed_attempts_from_one_address_are_throttled(tmp_path: Path) -> None:
    process = SluiceProcess(["--engine", "sim"], tmp_path / "server.log",
                            env={"SLUICE_API_KEYS": f"{ACME_KEY}:acme"})
    try:
        process.wait_ready(60)
        statuses = [httpx.get(process.url + "/v1/models", headers=bearer(f"sk-guess-{i}"))
                    .status_code for i in range(12)]
        assert statuses[:10] == [401] * 10 and statuses[10:] == [429, 429]
        # Now even the right key gets the same 429: nothing tells which keys exist.
        throttled = httpx.get(process.url + "/v1/models", headers=bearer(ACME_KEY))
        assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) >= 1
        assert throttled.json()["error"]["code"] == "too_many_failed_attempts"
    finally:
        process.stop()


def test_a_misspelt_configuration_key_stops_the_start_naming_its_path(tmp_path: Path) -> None:
    config = tmp_path / "sluice.yaml"
    config.write_text("tenants:\n  acme: {api_keys: [k1], max_concurent: 1}\n")
    started = subprocess.run(
        [sys.executable, "-m", "server.cli", "serve", "--engine", "sim", "--config",
         str(config), "--port", str(free_port())],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert started.returncode == 2
    assert ("tenants.acme.max_concurent: unknown key; did you mean max_concurrent?"
            in started.stderr)
