"""Request fields as vLLM's server accepts them, over HTTP: the bodies vLLM's router sends are
answered; an undeclared field is answered, logged once and counted; a declared field Sluice
cannot serve is a 400 `unsupported_parameter` naming it, at any value that would change the
answer, and leaks nothing. (The models' own rules: tests/openai_wire/test_openai_models.py.)"""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from conftest import ROUTER_CHAT, ROUTER_COMPLETION, InProcessSluice
from pydantic import BaseModel

from server.openai_wire.chat import ChatCompletionRequest
from server.openai_wire.completion import CompletionRequest
from server.openai_wire.wire import OnlyDefault
from server.responses_api.wire import CreateResponse

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "hi", "max_tokens": 4}
RESPONSE = {"input": "hi", "max_output_tokens": 4}


def _post(server: InProcessSluice, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=30)


def test_the_routers_bodies_are_answered(sim_server: InProcessSluice) -> None:
    whole = _post(sim_server, "/v1/chat/completions", ROUTER_CHAT)
    assert whole.status_code == 200, whole.text
    assert whole.json()["choices"][0]["message"]["content"]
    with httpx.stream(
        "POST", sim_server.url + "/v1/chat/completions", json={**ROUTER_CHAT, "stream": True}
    ) as streamed:
        assert streamed.status_code == 200
        lines = [line for line in streamed.iter_lines() if line.startswith("data: {")]
    assert "".join(
        json.loads(line[6:])["choices"][0]["delta"].get("content") or "" for line in lines
    )
    completion = _post(sim_server, "/v1/completions", ROUTER_COMPLETION)
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["text"]
    # The router's fallback when a render is not found: the chat's prompt, tokenized.
    fallback = {"continue_final_message": False, "messages": ROUTER_CHAT["messages"]}
    tokenized = _post(sim_server, "/tokenize", fallback)
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json().keys() == {"count", "max_model_len", "tokens", "token_strs"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions/render", CHAT),
        ("/v1/completions/render", COMPLETION),
        ("/v1/responses/render", RESPONSE),
    ],
)
def test_a_render_echoes_logit_bias_keyed_by_token_id_strings(
    sim_server: InProcessSluice, path: str, body: dict[str, Any]
) -> None:
    """Found by the fuzzing (a busy run, 2026-12-07): pydantic makes `logit_bias`'s token ids
    ints, and the render's sampling echoed them as keys JSON cannot have (a 500). vLLM's
    server writes them as strings, as JSON has them."""
    reply = _post(sim_server, path, {**body, "logit_bias": {"5": 1.5}})
    assert reply.status_code == 200, reply.text
    rendered = reply.json()
    one = rendered[0] if isinstance(rendered, list) else rendered
    assert one["sampling_params"]["logit_bias"] == {"5": 1.5}


@pytest.mark.parametrize(
    ("path", "body", "api"),
    [
        ("/v1/chat/completions", CHAT, "chat"),
        ("/v1/completions", COMPLETION, "completions"),
        ("/v1/responses", RESPONSE, "responses"),
        ("/tokenize", {"prompt": "hi"}, "tokenizer"),
        ("/v1/messages", {**CHAT, "model": "sim"}, "messages"),
    ],
)
def test_an_undeclared_field_is_answered_logged_once_and_counted(
    sim_server: InProcessSluice, path: str, body: dict[str, Any], api: str
) -> None:
    field = f"sparkle_{uuid.uuid4().hex[:8]}"  # (each name is logged once a process)
    before = sim_server.metric("sluice_ignored_fields_total", api=api, field="other")
    for _ in range(2):
        reply = _post(sim_server, path, {**body, field: {"x": 1}})
        assert reply.status_code == 200, reply.text
    after = sim_server.metric("sluice_ignored_fields_total", api=api, field="other")
    assert after - before == 2
    logged = [line for line in sim_server.log().splitlines() if f"'{field}'" in line]
    assert len(logged) == 1 and "WARNING" in logged[0] and path in logged[0], logged


def test_a_field_declared_to_change_nothing_is_counted_by_its_name(
    sim_server: InProcessSluice,
) -> None:
    labels = {"api": "chat", "field": "session_id"}
    before = sim_server.metric("sluice_ignored_fields_total", **labels)
    reply = _post(sim_server, "/v1/chat/completions", {**CHAT, "session_id": "s-1"})
    assert reply.status_code == 200, reply.text
    assert sim_server.metric("sluice_ignored_fields_total", **labels) - before == 1
    typo = _post(sim_server, "/v1/chat/completions", {**CHAT, "temprature": 0.1})
    assert typo.status_code == 200  # as vLLM's server: ignored, and logged with a hint
    assert "did you mean 'temperature'?" in sim_server.log()


def _served_at_defaults(model: type[BaseModel]) -> list[tuple[str, Any]]:
    """Each field `model` serves at its defaults only (`OnlyDefault`), with a value that is
    none of them."""
    fields = []
    for name, field in model.model_fields.items():
        for meta in field.metadata:
            if isinstance(meta, OnlyDefault):
                fields.append((name, _another(meta.values[0])))
    return fields


def _another(default: Any) -> Any:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, str):
        return default + "x"
    if isinstance(default, list):
        return [1]
    if isinstance(default, dict):
        return {"k": 1}
    return 1  # (a default of null)


@pytest.mark.parametrize(
    ("path", "body", "field", "value"),
    [
        *[("/v1/chat/completions", CHAT, *f) for f in _served_at_defaults(ChatCompletionRequest)],
        *[("/v1/completions", COMPLETION, *f) for f in _served_at_defaults(CompletionRequest)],
        *[("/v1/responses", RESPONSE, *f) for f in _served_at_defaults(CreateResponse)],
    ],
)
def test_a_field_that_would_change_the_answer_is_refused_naming_it(
    sim_server: InProcessSluice, path: str, body: dict[str, Any], field: str, value: Any
) -> None:
    reply = _post(sim_server, path, {**body, field: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == field, error
    assert field in error["message"]
    assert sim_server.metric("sluice_running_requests") == 0
    assert sim_server.metric("sluice_queue_depth") == 0
    assert sim_server.metric("sluice_budget_in_use") == 0


def test_a_requests_cache_salt_is_served_within_its_tenants(sim_server: InProcessSluice) -> None:
    salted = _post(sim_server, "/v1/chat/completions", {**CHAT, "cache_salt": "user-7"})
    assert salted.status_code == 200, salted.text
    empty = _post(sim_server, "/v1/chat/completions", {**CHAT, "cache_salt": ""})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"
