"""LoRA adapters loaded and unloaded at runtime, as vLLM's server does it
(`/v1/load_lora_adapter`, `/v1/unload_lora_adapter`), by an admin key only, on the real engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import LORA_ADAPTERS, SluiceProcess, tenant_key

# The keyed server's tenants (tests/conftest.py): an admin, a user, and one limited to `narrow`,
# an adapter loaded later.
ADMIN, USER, LIMITED = (tenant_key(name) for name in ("ops", "user", "limited"))
BASE = "sluice-demo"


@pytest.fixture
def server(keyed_vllm_server: SluiceProcess) -> Iterator[SluiceProcess]:
    yield keyed_vllm_server
    # What a test loaded and left loaded (a failed one's) goes: the server's other tests
    # (tests/api/test_lora_adapters.py) list its models, the base and the adapters of its start.
    for name in set(served(keyed_vllm_server)) - {BASE, *LORA_ADAPTERS}:
        unload(keyed_vllm_server, name)


def post(
    server: SluiceProcess, path: str, body: dict[str, Any], key: str = ADMIN
) -> httpx.Response:
    return httpx.post(
        server.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120
    )


def load(server: SluiceProcess, name: str, path: Path | str) -> httpx.Response:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def unload(server: SluiceProcess, name: str) -> httpx.Response:
    return post(server, "/v1/unload_lora_adapter", {"lora_name": name})


def served(server: SluiceProcess) -> list[str]:
    reply = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {USER}"})
    return [card["id"] for card in reply.json()["data"]]


def chat(server: SluiceProcess, model: str, max_tokens: int = 16) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell me about schedulers."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return post(server, "/v1/chat/completions", body, USER)


def test_only_an_admin_key_loads_or_unloads(
    server: SluiceProcess, demo_adapters: dict[str, Path]
) -> None:
    path = demo_adapters["tenant-a"]
    for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        refused = post(server, route, {"lora_name": "x", "lora_path": str(path)}, USER)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "forbidden"
    assert "x" not in served(server)


def test_an_adapter_loaded_serves_until_unloaded_and_a_running_request_finishes(
    server: SluiceProcess, demo_adapters: dict[str, Path]
) -> None:
    base_text = chat(server, BASE).json()["choices"][0]["message"]["content"]
    loaded = load(server, "live", demo_adapters["tenant-a"])
    assert loaded.status_code == 200, loaded.text
    assert "live" in served(server)
    text = chat(server, "live").json()["choices"][0]["message"]["content"]
    assert text != base_text

    # A stream runs on it while it is unloaded (600 tokens: seconds, where the unloading is
    # milliseconds): the stream ends whole, new requests get the 404 meanwhile.
    body = {
        "model": "live",
        "messages": [{"role": "user", "content": "Tell me about schedulers."}],
        "max_tokens": 600,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {USER}"}
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert json.loads(first[len("data: ") :])["model"] == "live"
        assert unload(server, "live").status_code == 200
        assert "live" not in served(server)
        refused = chat(server, "live")
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
        rest = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert rest[-1]["usage"]["completion_tokens"] == 600

    # Its slot is free again: the same name loads anew and answers as before.
    assert load(server, "live", demo_adapters["tenant-a"]).status_code == 200
    assert chat(server, "live").json()["choices"][0]["message"]["content"] == text
    assert unload(server, "live").status_code == 200


def test_what_cannot_be_loaded_or_unloaded_says_why(
    server: SluiceProcess, demo_adapters: dict[str, Path], tmp_path: Path
) -> None:
    # As vLLM's server answers: no adapter at the path is a 404, one it cannot load a 500,
    # each with vLLM's reason.
    missing = load(server, "nowhere", tmp_path / "no-adapter")
    assert missing.status_code == 404, missing.text
    assert str(tmp_path / "no-adapter") in missing.json()["error"]["message"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("this is not json")
    unreadable = load(server, "broken", broken)
    assert unreadable.status_code == 500, unreadable.text
    assert unreadable.json()["error"]["code"] == "adapter_load_failed"
    assert "nowhere" not in served(server) and "broken" not in served(server)

    assert load(server, BASE, demo_adapters["tenant-a"]).status_code == 400  # the base's name
    assert load(server, "one", demo_adapters["tenant-a"]).status_code == 200
    again = load(server, "one", demo_adapters["tenant-b"])
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    unknown = unload(server, "never-loaded")
    assert unknown.status_code == 404, unknown.text
    assert unload(server, "one").status_code == 200


def test_more_adapters_than_the_engine_holds_are_served_least_recently_used_first(
    server: SluiceProcess, demo_adapters: dict[str, Path]
) -> None:
    """--max-cpu-loras 2 (vLLM's meaning): the engine holds two of the adapters served (the
    two of the server's start count too); a third loaded makes the least recently used one
    leave it, and a request for that one brings it back, answering as before (greedy, each
    adapter's own text)."""
    names = ("first", "second", "third")
    paths = [demo_adapters[t] for t in ("tenant-a", "tenant-b", "tenant-a")]
    texts = {}
    try:
        for name, path in zip(names, paths, strict=True):
            assert load(server, name, path).status_code == 200
            texts[name] = chat(server, name).json()["choices"][0]["message"]["content"]
        assert set(names) <= set(served(server))
        for name in names:  # `first` left the engine for `third`; it comes back
            reply = chat(server, name)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == texts[name]
        assert texts["first"] == texts["third"] != texts["second"]  # (the same files)
    finally:
        for name in names:
            unload(server, name)


def test_a_tenant_limited_to_an_adapter_gets_it_by_default_and_nothing_else(
    server: SluiceProcess, demo_adapters: dict[str, Path]
) -> None:
    headers = {"Authorization": f"Bearer {LIMITED}"}
    listed = httpx.get(server.url + "/v1/models", headers=headers).json()["data"]
    assert listed == []  # its one model is not served yet
    assert load(server, "narrow", demo_adapters["tenant-b"]).status_code == 200
    try:
        listed = httpx.get(server.url + "/v1/models", headers=headers).json()["data"]
        assert [card["id"] for card in listed] == ["narrow"]
        body = {
            "messages": [{"role": "user", "content": "Tell me about schedulers."}],
            "max_tokens": 16,
            "temperature": 0,
            "ignore_eos": True,
        }
        url = server.url + "/v1/chat/completions"
        mine = httpx.post(url, json=body, headers=headers, timeout=60).json()  # names no model
        assert mine["model"] == "narrow"
        assert mine["choices"] == chat(server, "narrow").json()["choices"]
        refused = httpx.post(url, json={**body, "model": BASE}, headers=headers, timeout=60)
        assert refused.status_code == 404, refused.text
        assert refused.json()["error"]["message"].endswith("this server serves 'narrow'")
    finally:
        assert unload(server, "narrow").status_code == 200
