"""`/openapi.json`, and schemathesis fuzzing every operation it lists: no input, well-formed or
not, gets a server error. Against the sim engine (a generation costs microseconds there)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from conftest import FAST_SIM, InProcessSluice, sim_sluice

from server.openai_wire.requests import REQUEST_MODELS

# schemathesis (and the hypothesis it loads, ~1 s) is imported by the tests that use it, not
# here: every pytest-xdist worker collects this module, and most never fuzz.
if TYPE_CHECKING:
    import schemathesis

pytestmark = pytest.mark.service
# The document's Anthropic schemas are the `anthropic` SDK's (~1.5 s to import): the tests that
# read it run in the worker that imports it for its own tests.
IN_ANTHROPICS_WORKER = pytest.mark.xdist_group("anthropic")


@pytest.fixture(scope="module")
def sim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    """A sim engine that answers fast: a step of ~0.05 ms and a context of 512 tokens. A
    well-formed chat that sets no `max_tokens` runs to the context's end, which at the
    defaults (2,048 tokens, ~2 ms a step) took seconds an example; the fuzzing is about what
    the inputs are, not how long the answers run (uncalibrated, likewise)."""
    with sim_sluice(
        tmp_path_factory.mktemp("openapi"), *FAST_SIM, "--sim-max-model-len", "512"
    ) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(sim_server: InProcessSluice) -> schemathesis.BaseSchema:
    import schemathesis

    return schemathesis.openapi.from_url(sim_server.url + "/openapi.json")


@IN_ANTHROPICS_WORKER
def test_the_document_lists_every_accepted_field(sim_server: InProcessSluice) -> None:
    document = httpx.get(sim_server.url + "/openapi.json", timeout=10).json()
    assert document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    for path, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "completion")):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        schema = schemas[body["schema"]["$ref"].removeprefix("#/components/schemas/")]
        assert set(schema["properties"]) == set(REQUEST_MODELS[kind].model_fields)
        assert schema["additionalProperties"] is True  # ignored, as vLLM's server does


@IN_ANTHROPICS_WORKER
def test_every_reply_has_a_schema_and_replies_match_theirs(sim_server: InProcessSluice) -> None:
    import jsonschema

    document = httpx.get(sim_server.url + "/openapi.json", timeout=10).json()
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            content = operation["responses"]["200"].get("content", {})
            assert content, f"{method} {path}: no content"
            for media, spec in content.items():
                assert spec["schema"] != {"type": "object"} or path == "/openapi.json", (
                    f"{method} {path} {media}: no schema"
                )

    def reply_matches(
        method: str, path: str, body: dict | None = None, template: str | None = None
    ) -> Any:
        reply = httpx.request(method, sim_server.url + path, json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        operation = document["paths"][template or path][method.lower()]
        content = operation["responses"]["200"]["content"]
        schema = {**content["application/json"]["schema"], "components": document["components"]}
        jsonschema.validate(reply.json(), schema, cls=jsonschema.Draft202012Validator)
        return reply.json()

    model = httpx.get(sim_server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    reply_matches("GET", "/v1/models")
    reply_matches("GET", "/health")
    reply_matches("GET", "/ready")
    reply_matches("GET", "/version")
    reply_matches("POST", "/v1/chat/completions", chat)
    reply_matches("POST", "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 3})
    reply_matches("POST", "/v1/messages", {**chat, "messages": chat["messages"]})
    reply_matches(
        "POST", "/v1/messages/count_tokens", {"model": model, "messages": chat["messages"]}
    )
    reply_matches("POST", "/v1/responses", {"model": model, "input": "hi", "max_output_tokens": 3})
    reply_matches("POST", "/tokenize", {"model": model, "prompt": "hi"})
    reply_matches("POST", "/detokenize", {"model": model, "tokens": [1, 2]})
    reply_matches("POST", "/v1/chat/completions/render", chat)
    reply_matches("POST", "/v1/completions/render", {"model": model, "prompt": ["a", "b"]})
    reply_matches("POST", "/v1/responses/render", {"model": model, "input": "hi"})
    hello = {"items": [{"role": "user", "content": "hi"}]}
    made = reply_matches("POST", "/v1/conversations", hello)
    one, items = f"/v1/conversations/{made['id']}", "/v1/conversations/{id}/items"
    reply_matches("GET", one, template="/v1/conversations/{id}")
    reply_matches("POST", one, {"metadata": {"a": "b"}}, "/v1/conversations/{id}")
    reply_matches("POST", one + "/items", hello, items)
    item = reply_matches("GET", one + "/items", template=items)["data"][0]["id"]
    an_item = "/v1/conversations/{id}/items/{item_id}"
    reply_matches("GET", f"{one}/items/{item}", template=an_item)
    reply_matches("DELETE", f"{one}/items/{item}", template=an_item)
    reply_matches("DELETE", one, template="/v1/conversations/{id}")


@IN_ANTHROPICS_WORKER
def test_the_adapter_operations_document_their_own_errors(sim_server: InProcessSluice) -> None:
    # vLLM's answers to a load (404: no adapter at the path; 500: one it cannot load) and an
    # unload (404), and the admin's 403, each an OpenAI error body.
    paths = httpx.get(sim_server.url + "/openapi.json", timeout=10).json()["paths"]
    for path, statuses in (
        ("/v1/load_lora_adapter", {"403", "404", "500"}),
        ("/v1/unload_lora_adapter", {"403", "404"}),
    ):
        responses = paths[path]["post"]["responses"]
        assert statuses <= set(responses), path
        for status in statuses:
            schema = responses[status]["content"]["application/json"]["schema"]
            assert schema == responses["400"]["content"]["application/json"]["schema"]


# The paths /openapi.json lists (schemathesis leaves out the document's own), each fuzzed
# with well-formed and with malformed input.
OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/invocations"),
    ("POST", "/v1/chat/completions/batch"),
    ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/v1/chat/completions/render"),
    ("POST", "/v1/completions/render"),
    ("POST", "/v1/responses/render"),
    ("GET", "/v1/models"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("GET", "/version"),
    ("GET", "/health"),
    ("GET", "/ready"),
    ("GET", "/v1/chat/completions/{id}/stream"),
    ("GET", "/v1/completions/{id}/stream"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files"),
    ("GET", "/v1/files/{id}"),
    ("DELETE", "/v1/files/{id}"),
    ("GET", "/v1/files/{id}/content"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches"),
    ("GET", "/v1/batches/{id}"),
    ("POST", "/v1/batches/{id}/cancel"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/responses/{id}"),
    ("POST", "/v1/responses/{id}/cancel"),
    ("POST", "/v1/conversations"),
    ("GET", "/v1/conversations/{id}"),
    ("POST", "/v1/conversations/{id}"),
    ("DELETE", "/v1/conversations/{id}"),
    ("POST", "/v1/conversations/{id}/items"),
    ("GET", "/v1/conversations/{id}/items"),
    ("GET", "/v1/conversations/{id}/items/{item_id}"),
    ("DELETE", "/v1/conversations/{id}/items/{item_id}"),
]

EXAMPLES = 25  # an operation and mode, in each run
# schemathesis's generation modes, by value (its enum, at collection, would import it).
MODES = ("positive", "negative")


@pytest.mark.slow  # the fuzzing's own check (it loads schemathesis: ~3 s): runs with the fuzzing
def test_the_fuzzed_operations_are_the_documented_ones(api_schema: schemathesis.BaseSchema) -> None:
    documented = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert documented == set(OPERATIONS)
    import schemathesis

    assert {mode.value for mode in schemathesis.GenerationMode} == set(MODES)


# EXAMPLES an operation and mode, drawn anew in each run (no database): the runs add up. At 40
# this module was the suite's largest item: 78 s of CPU on its own, now 52 s (2026-12-07, nearly
# all of it hypothesis building bodies from the schemas).
@pytest.mark.slow  # tens of seconds by design
@pytest.mark.parametrize(
    ("method", "path", "mode"),
    [
        (method, path, mode)
        for method, path in OPERATIONS
        for mode in MODES
        # Malformed input only where there is input that can be malformed: a body or a number.
        if (method == "POST" and "{id}" not in path)
        or path.endswith("/stream")
        or mode == "positive"
    ],
)
def test_no_input_gets_a_server_error(
    api_schema: schemathesis.BaseSchema,
    sim_server: InProcessSluice,
    method: str,
    path: str,
    mode: str,
) -> None:
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error

    # schemathesis's own pytest integration does not run on pytest 9: hypothesis drives it.
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(base_url=sim_server.url, checks=[not_a_server_error], timeout=30)

    fuzz()
