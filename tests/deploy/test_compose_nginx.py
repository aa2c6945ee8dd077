"""deploy/compose/nginx.conf as it runs: a real nginx with the compose file's configuration,
its upstreams pointed at two sim replicas (one Redis, tenants with keys) and a real vLLM router
in front of them on loopback, so that what the file routes where is tested, not read: a chat
goes through the router (which renders it on the replicas first), a Responses request keeps its
key (straight to a replica), and a WebSocket upgrade reaches a replica."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets
from conftest import InProcessSluice, require_tool, reserved_port, sim_fleet, wait_until

NGINX_CONF = Path(__file__).resolve().parents[2] / "deploy" / "compose" / "nginx.conf"
KEY = {"Authorization": "Bearer demo-key"}

pytestmark = pytest.mark.system  # nginx, the router and Redis


def local_conf(replicas: list[str], router: str, port: int, prefix: Path) -> str:
    """The compose file's nginx.conf with its hosts on loopback and its files under `prefix`
    (nginx as a user's process, in the foreground)."""
    conf = NGINX_CONF.read_text()
    for name, address in zip(("sluice-1", "sluice-2"), replicas, strict=True):
        conf = conf.replace(f"server {name}:8000", f"server {address}")
    conf = conf.replace("server router:8000", f"server {router}")
    conf = conf.replace("listen 80;", f"listen 127.0.0.1:{port};")
    files = "".join(
        f"  {name}_temp_path {prefix / name};\n"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = conf.replace("http {\n", f"http {{\n  access_log off;\n{files}", 1)
    return f"daemon off;\npid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'};\n{conf}"


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[InProcessSluice]]]:
    nginx = require_tool("nginx")
    root = tmp_path_factory.mktemp("compose-edge")
    with sim_fleet(root, "tenants:\n  demo: {api_keys: [demo-key]}\n") as (router, replicas):
        port = reserved_port()
        conf = root / "nginx.conf"
        addresses = [replica.url.removeprefix("http://") for replica in replicas]
        conf.write_text(local_conf(addresses, router.url.removeprefix("http://"), port, root))
        checked = subprocess.run(
            [nginx, "-t", "-c", str(conf), "-p", str(root)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert checked.returncode == 0, checked.stderr
        proc = subprocess.Popen(
            [nginx, "-c", str(conf), "-p", str(root)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            process_group=0,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: _answers(url + "/health"), 30, 0.1, "nginx answers")
            yield url, replicas
        finally:
            proc.terminate()
            proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _renders(replicas: list[InProcessSluice]) -> int:
    """The render calls the replicas answered: each is vLLM's router asking before it routes."""
    pattern = re.compile(r'"path":"/v1/chat/completions/render"')
    return sum(len(pattern.findall(replica.log_path.read_text())) for replica in replicas)


def test_a_chat_goes_through_the_router(edge: tuple[str, list[InProcessSluice]]) -> None:
    url, replicas = edge
    before = _renders(replicas)
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    answer = httpx.post(url + "/v1/chat/completions", json=body, headers=KEY, timeout=30)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
    wait_until(lambda: _renders(replicas) > before, 60, message="the router rendered it")


def test_a_response_keeps_its_key_past_the_router(edge: tuple[str, list[InProcessSluice]]) -> None:
    """The router would forward it without its Authorization (a 401): nginx sends it to a
    replica instead."""
    url, _ = edge
    body = {"model": "sim", "input": "hi", "max_output_tokens": 5}
    created = httpx.post(url + "/v1/responses", json=body, headers=KEY, timeout=30)
    assert created.status_code == 200, created.text
    found = httpx.get(f"{url}/v1/responses/{created.json()['id']}", headers=KEY, timeout=30)
    assert found.status_code == 200


async def test_a_websocket_reaches_a_replica(edge: tuple[str, list[InProcessSluice]]) -> None:
    url, _ = edge
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with websockets.connect(
        url.replace("http", "ws") + "/v1/ws", additional_headers=KEY
    ) as socket:
        await socket.send(json.dumps({"type": "generate", "id": "g1", "request": request}))
        kinds = []
        while "final" not in kinds:
            kinds.append(json.loads(await socket.recv())["type"])
    assert "delta" in kinds
