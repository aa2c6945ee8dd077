"""Keys stay secret, tenants stay apart: redacted logs, the WebSocket's bearer subprotocol
(from the `websockets` client; from Chromium in tests/observability), keys on every /v1
route, keys kept as digests, failed-attempt throttling, strict configuration, /metrics on its
own port, and every route that reads a tenant's resource walked as another tenant.

Real Sluice servers (sim engine) on loopback: in this process, but for the log's test (the
process's logging redacts) and the start that is refused (its exit status).
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
from conftest import (
    ROOT,
    InProcessSluice,
    SluiceProcess,
    loopback_listener,
    sim_sluice,
    uncalibrated_config,
)

from engine_adapters.sim import SimEngine
from server.api.app import build_app
from server.api.serving import build_stores
from server.core.config import SluiceConfig, key_digest
from server.observability.metrics import Metrics
from server.scheduler.runtime import SchedulerRuntime

ACME_KEY, GLOBEX_KEY, DIGEST_KEY = "sk-acme-7f3a9c", "sk-globex-41d2e8", "sk-hashed-90be77"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


ENV = {"SLUICE_API_KEYS": f"{GLOBEX_KEY}:globex"}


def tenants_args(root: Path) -> list[str]:
    """The sim engine, acme's key in the configuration and hashed's as a digest (globex's is
    in `ENV`)."""
    # No start-up calibration (~4 s): nothing here depends on the engine's measured speed.
    config = uncalibrated_config(
        root,
        "tenants:\n"
        f"  acme: {{api_keys: [{ACME_KEY}]}}\n"
        f"  hashed: {{api_key_sha256: [{key_digest(DIGEST_KEY)}]}}\n",
    )
    return ["--engine", "sim", "--config", str(config), "--log-level", "info"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    root = tmp_path_factory.mktemp("security")
    with InProcessSluice(tenants_args(root), root / "server.log", ENV, metrics_port=True) as server:
        yield server


@pytest.fixture(scope="module")
def process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SluiceProcess]:
    """The same server as `sluice serve` runs it: its logging is the process's."""
    root = tmp_path_factory.mktemp("security-process")
    with SluiceProcess(tenants_args(root), root / "server.log", ENV) as process:
        yield process


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.system  # `sluice serve` in a process of its own: its logging is the subject
async def test_keys_in_urls_and_headers_leave_no_trace_in_the_logs(
    process: SluiceProcess,
) -> None:
    ws_url = process.url.replace("http://", "ws://") + f"/v1/ws?api_key={ACME_KEY}"
    async with websockets.connect(ws_url) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "g", "request": CHAT}))
        while json.loads(await ws.recv())["type"] != "final":
            pass
    async with httpx.AsyncClient(base_url=process.url) as client:
        assert (await client.get(f"/v1/models?api_key={GLOBEX_KEY}")).status_code == 401
        assert (
            await client.post("/v1/chat/completions", json=CHAT, headers=bearer(GLOBEX_KEY))
        ).status_code == 200
    log = process.log_path.read_text()
    assert "WebSocket /v1/ws?api_key=[redacted]" in log  # uvicorn's line, redacted
    for key in (ACME_KEY, GLOBEX_KEY):
        assert key not in log


async def test_the_websocket_bearer_subprotocol_authenticates(server: InProcessSluice) -> None:
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


def test_every_v1_route_wants_a_key_and_digests_work(server: InProcessSluice) -> None:
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/v1/models", headers=bearer(ACME_KEY)).status_code == 200
    assert httpx.post(server.url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    # vLLM's render endpoints, as /tokenize: the caller's key first.
    for path, body in (
        ("/v1/chat/completions/render", CHAT),
        ("/v1/completions/render", {"prompt": "hi"}),
        ("/v1/responses/render", {"input": "hi"}),
    ):
        assert httpx.post(server.url + path, json=body).status_code == 401
        keyed = httpx.post(server.url + path, json=body, headers=bearer(ACME_KEY))
        assert keyed.status_code == 200, keyed.text
    hashed = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers=bearer(DIGEST_KEY))
    assert hashed.status_code == 200
    wrong = httpx.post(
        server.url + "/v1/chat/completions", json=CHAT, headers=bearer(DIGEST_KEY + "x")
    )
    assert wrong.status_code == 401
    for path in ("/health", "/ready"):  # the exceptions
        assert httpx.get(server.url + path).status_code == 200


def test_metrics_live_on_their_own_port(server: InProcessSluice) -> None:
    assert httpx.get(server.url + "/metrics").status_code == 404
    scraped = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert scraped.status_code == 200 and "sluice_requests_total" in scraped.text


def _routes_with_resources(tmp_path: Path) -> list[tuple[str, str]]:
    """(method, path) of every route of the app that names a tenant's resource (`{id}`)."""
    engine, metrics = SimEngine(), Metrics()
    stores = build_stores(engine, SluiceConfig(), metrics, tmp_path / "walk-data")
    app = build_app(
        engine,
        SchedulerRuntime(SluiceConfig(), engine, "sim", metrics),
        SluiceConfig(),
        "sim",
        metrics=metrics,
        stores=stores,
    )
    stores.responses.close()
    asyncio.run(stores.conversations.close())
    assert stores.batches is not None
    asyncio.run(stores.batches.close())
    return [
        (method, route.path)
        for route in app.routes
        if "{id}" in getattr(route, "path", "")
        for method in sorted(getattr(route, "methods", None) or {"GET"})
        if method != "HEAD"
    ]


def _generation(server: InProcessSluice, path: str) -> str:
    """A resumable stream of acme's; its id."""
    body = dict(CHAT) if path.startswith("/v1/chat") else {"prompt": "hi", "max_tokens": 4}
    made = httpx.post(
        server.url + path.split("/{id}")[0],
        json={**body, "stream": True},
        headers={**bearer(ACME_KEY), "Idempotency-Key": f"walk-{path}"},
    )
    return str(
        next(
            json.loads(line[6:])["id"]
            for line in made.text.splitlines()
            if line.startswith("data: {")
        )
    )


def _file(server: InProcessSluice, path: str) -> str:
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    made = httpx.post(
        server.url + "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", json.dumps(line).encode())},
        headers=bearer(ACME_KEY),
    )
    return str(made.json()["id"])


def _batch(server: InProcessSluice, path: str) -> str:
    made = httpx.post(
        server.url + "/v1/batches",
        json={
            "input_file_id": _file(server, path),
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
        headers=bearer(ACME_KEY),
    )
    return str(made.json()["id"])


def _response(server: InProcessSluice, path: str) -> str:
    """A background response of acme's (ended or not: a cancel answers it either way)."""
    made = httpx.post(
        server.url + "/v1/responses",
        json={"input": "hi", "max_output_tokens": 4, "background": True},
        headers=bearer(ACME_KEY),
    )
    return str(made.json()["id"])


ITEM_OF: dict[str, str] = {}  # a conversation's item, for the routes that name one


def _conversation(server: InProcessSluice, path: str) -> str:
    """A conversation of acme's, with an item (`ITEM_OF`)."""
    made = httpx.post(
        server.url + "/v1/conversations",
        json={"items": [{"role": "user", "content": "hi"}]},
        headers=bearer(ACME_KEY),
    ).json()["id"]
    items = httpx.get(f"{server.url}/v1/conversations/{made}/items", headers=bearer(ACME_KEY))
    ITEM_OF[made] = items.json()["data"][0]["id"]
    return str(made)


# The bodies of the routes with an id that take one (another tenant's is refused as unknown).
BODIES = {
    ("POST", "/v1/conversations/{id}"): {"metadata": {}},
    ("POST", "/v1/conversations/{id}/items"): {"items": [{"role": "user", "content": "hi"}]},
}

# How to make acme's resource behind each route with an id; a new such route must join here.
MAKERS = {
    "/v1/chat/completions/{id}/stream": _generation,
    "/v1/completions/{id}/stream": _generation,
    "/v1/files/{id}": _file,
    "/v1/files/{id}/content": _file,
    "/v1/batches/{id}": _batch,
    "/v1/batches/{id}/cancel": _batch,
    "/v1/responses/{id}": _response,
    "/v1/responses/{id}/cancel": _response,
    "/v1/conversations/{id}": _conversation,
    "/v1/conversations/{id}/items": _conversation,
    "/v1/conversations/{id}/items/{item_id}": _conversation,
}


def test_another_tenants_resources_are_not_found_on_every_route(
    server: InProcessSluice,
    tmp_path: Path,
) -> None:
    routes = _routes_with_resources(tmp_path)
    assert {path for _, path in routes} == set(MAKERS)
    for method, path in routes:
        public_id = MAKERS[path](server, path)
        within = path.replace("{item_id}", ITEM_OF.get(public_id, ""))
        url = server.url + within.replace("{id}", public_id)
        body = BODIES.get((method, path))
        as_other = httpx.request(method, url, json=body, headers=bearer(GLOBEX_KEY))
        unknown = httpx.request(
            method,
            server.url + within.replace("{id}", public_id[:-4] + "0000"),
            json=body,
            headers=bearer(GLOBEX_KEY),
        )
        assert as_other.status_code == unknown.status_code == 404, (method, path)
        assert as_other.json()["error"]["code"] == "not_found"
        assert as_other.json()["error"]["message"].replace(public_id, "X") == (
            unknown.json()["error"]["message"].replace(public_id[:-4] + "0000", "X")
        )
        # The owner finds it (a cancel may come after the small batch ended: 400, not 404).
        owner = httpx.request(method, url, json=body, headers=bearer(ACME_KEY))
        assert owner.status_code in (200, 400)
    # The WebSocket's resume, likewise.
    public_id = _generation(server, "/v1/chat/completions/{id}/stream")
    ws_url = server.url.replace("http://", "ws://") + "/v1/ws"
    asyncio.run(_resume_as(ws_url, GLOBEX_KEY, public_id, "not_found"))
    asyncio.run(_resume_as(ws_url, ACME_KEY, public_id, "final"))


async def _resume_as(url: str, key: str, public_id: str, expected: str) -> None:
    async with websockets.connect(url, additional_headers=bearer(key)) as ws:
        await ws.send(json.dumps({"type": "resume", "id": "r", "generation": public_id}))
        while (message := json.loads(await ws.recv()))["type"] == "delta":
            pass
        assert (
            message["error"]["code"] if message["type"] == "error" else message["type"]
        ) == expected


def test_failed_attempts_from_one_address_are_throttled(tmp_path: Path) -> None:
    # A server of its own (the address it throttles is every test's).
    with sim_sluice(tmp_path, keys={ACME_KEY: "acme"}) as process:
        statuses = [
            httpx.get(process.url + "/v1/models", headers=bearer(f"sk-guess-{i}")).status_code
            for i in range(12)
        ]
        assert statuses[:10] == [401] * 10 and statuses[10:] == [429, 429]
        # Now even the right key gets the same 429: nothing tells which keys exist.
        throttled = httpx.get(process.url + "/v1/models", headers=bearer(ACME_KEY))
        assert throttled.status_code == 429 and int(throttled.headers["retry-after"]) >= 1
        assert throttled.json()["error"]["code"] == "too_many_failed_attempts"


@pytest.mark.system  # `sluice serve` run: its exit status is the subject
def test_a_misspelt_configuration_key_stops_the_start_naming_its_path(tmp_path: Path) -> None:
    config = tmp_path / "sluice.yaml"
    config.write_text("tenants:\n  acme: {api_keys: [k1], max_concurent: 1}\n")
    with loopback_listener() as listener:  # (where it would serve, had it started)
        started = subprocess.run(
            [
                sys.executable,
                "-m",
                "server.cli",
                "serve",
                "--engine",
                "sim",
                "--config",
                str(config),
                "--fd",
                str(listener.fileno()),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            pass_fds=(listener.fileno(),),
        )
    assert started.returncode == 2
    assert "tenants.acme.max_concurent: unknown key; did you mean max_concurrent?" in started.stderr
