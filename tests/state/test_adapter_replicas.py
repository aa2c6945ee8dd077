"""LoRA adapters loaded at runtime reach every replica that shares the state: two real Sluice
servers (sim engine, in this process) on one real `redis-server`; an adapter an admin loads on
one is served by the other within a sync, and by a replica that starts later; unloaded on
either, it leaves both; a replica's own `--lora-modules` adapter is never another's to unload.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import InProcessSluice, RedisProcess, all_ready, metric_sum, sim_sluice, wait_until

from server.state.adapters import SYNC_S

pytestmark = [pytest.mark.system, pytest.mark.xdist_group("adapter-replicas")]

ADMIN, USER = "sk-ops", "sk-user"
TENANTS = "tenants: {ops: {api_keys: [sk-ops], admin: true}, user: {api_keys: [sk-user]}}\n"


def replica(root: Path, redis: RedisProcess, name: str, *own: str) -> InProcessSluice:
    return sim_sluice(
        root,
        "--enable-lora", "--max-loras", "4", *(["--lora-modules", *own] if own else []),
        "--state-url", redis.url,
        config=TENANTS,
        log=f"{name}.log",
    )  # fmt: skip


@pytest.fixture
def replicas(session_redis: RedisProcess, tmp_path: Path) -> Iterator[list[InProcessSluice]]:
    started = [
        replica(tmp_path, session_redis, "a", "own-a=adapters/own-a"),
        replica(tmp_path, session_redis, "b"),
    ]
    with all_ready(started) as servers:
        yield servers


def post(server: InProcessSluice, path: str, body: dict[str, str]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=30)


def served(server: InProcessSluice) -> list[str]:
    reply = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {USER}"})
    return [card["id"] for card in reply.json()["data"]]


def answers(server: InProcessSluice, model: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {USER}"}
    return httpx.post(
        server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30
    ).status_code


def test_an_adapter_loaded_on_one_replica_is_served_by_every_one(
    replicas: list[InProcessSluice], session_redis: RedisProcess, tmp_path: Path
) -> None:
    a, b = replicas
    loaded = post(a, "/v1/load_lora_adapter", {"lora_name": "support", "lora_path": "/x"})
    assert loaded.status_code == 200, loaded.text
    wait_until(lambda: "support" in served(b), 10 * SYNC_S, message=b.log())
    assert answers(b, "support") == 200
    # Each replica's scheduler was told of it, and exports the targets its chats are judged by.
    for server in (a, b):
        scrape = httpx.get(server.url + "/metrics").text
        assert metric_sum(scrape, "sluice_slo_target_seconds", model="support", target="itl") > 0
    with replica(tmp_path, session_redis, "c") as later:  # served from its start
        assert "support" in served(later)
        # Unloaded on another replica than the one it was loaded on: it leaves every one.
        assert post(b, "/v1/unload_lora_adapter", {"lora_name": "support"}).status_code == 200
        for server in (a, later):
            wait_until(lambda s=server: "support" not in served(s), 10 * SYNC_S)
        assert answers(a, "support") == 404
        # A replica's own adapter (its --lora-modules) is its alone, and no unload elsewhere
        # takes it: on b it is not served, so b's unload is a 404, and a keeps it.
        assert "own-a" not in served(b)
        assert post(b, "/v1/unload_lora_adapter", {"lora_name": "own-a"}).status_code == 404
        assert "own-a" in served(a)
