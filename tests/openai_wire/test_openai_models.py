"""The request models (server/openai_wire): what a refusal names, and the OpenAPI document they
generate. The routes' answers to bad input are in test_bad_input.py."""

from __future__ import annotations

import pytest

from server.api.routes import api_document
from server.core.errors import InvalidRequest, UnsupportedParameter
from server.openai_wire.requests import REQUEST_MODELS, parse_request

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _refused(body: dict, kind: str = "chat") -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(body, kind)
    return refused.value


def test_an_undeclared_field_is_ignored_and_named_by_its_path() -> None:
    # As vLLM's server: accepted, and ignored (the route logs and counts `ignored`).
    parsed = parse_request(
        {**CHAT, "temprature": 0.5, "stream": True, "stream_options": {"x": 1}}, "chat"
    )
    assert parsed.ignored == ("stream_options.x", "temprature")
    assert "temperature" not in parsed.sampling


def test_a_field_declared_to_change_nothing_is_ignored_and_one_that_would_is_refused() -> None:
    router = {"no_stop_trim": False, "separate_reasoning": True, "return_hidden_states": False}
    parsed = parse_request({**CHAT, **router, "session_id": "s", "user": None}, "chat")
    assert parsed.ignored == ("return_hidden_states", "separate_reasoning", "session_id")
    for field, value in (("return_hidden_states", True), ("priority", 1), ("chat_template", "x")):
        error = _refused({**CHAT, field: value})
        assert isinstance(error, UnsupportedParameter) and error.param == field
    # SGLang's no_stop_trim is vLLM's include_stop_str_in_output.
    kept = parse_request({**CHAT, "no_stop_trim": True}, "chat")
    assert kept.sampling["include_stop_str_in_output"] is True and not kept.ignored


@pytest.mark.parametrize("value", [2, True, 1.0])
def test_a_parameter_served_at_its_default_only_compares_the_type_too(value: object) -> None:
    error = _refused({**CHAT, "best_of": value})
    assert isinstance(error, UnsupportedParameter) and error.param == "best_of"
    assert parse_request({**CHAT, "best_of": 1}, "chat").n == 1


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"messages": [{"role": ""}]}, "messages[0].role", "'messages[0].role'"),
        ({**CHAT, "logit_bias": {"x1": 1}}, "logit_bias", "'x1'"),
        ({**CHAT, "documents": [{"a": 1}]}, "documents", "documents[0]['a']"),
        (
            {**CHAT, "stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage",
            "bool_type",
        ),
        (
            {**CHAT, "kv_transfer_params": {"do_remote_decode": True}},
            "kv_transfer_params.do_remote_decode",
            "KV connector",
        ),
    ],
)
def test_a_refusal_names_where_the_error_is(body: dict, param: str, named: str) -> None:
    error = _refused(body)
    assert error.param == param
    assert named in error.message


def test_an_integer_past_64_bits_is_refused_with_pydantics_bound_names() -> None:
    # orjson reads such an integer as a float; vLLM's tests look for the bound's name.
    assert "(greater_than_equal)" in _refused({**CHAT, "seed": -(2.0**63) * 2}).message
    assert "(less_than_equal)" in _refused({**CHAT, "seed": 2.0**64}).message


def test_only_the_assistant_may_send_null_content_and_text_parts_only() -> None:
    assistant = {"role": "assistant", "content": None, "tool_calls": []}
    parsed = parse_request({"messages": [*CHAT["messages"], assistant]}, "chat")
    assert parsed.messages == [*CHAT["messages"], assistant]  # every field, as sent
    assert _refused({"messages": [{"role": "user", "content": None}]}).param == "messages[0]"
    image = {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    assert isinstance(_refused(image), UnsupportedParameter)


# The document's Anthropic schemas are the `anthropic` SDK's (~1.5 s to import): in the worker
# that imports it for its own tests.
@pytest.mark.xdist_group("anthropic")
def test_the_document_holds_each_models_own_schema() -> None:
    schemas = api_document(frozenset({"core"}))["components"]["schemas"]
    for kind, model in REQUEST_MODELS.items():
        assert schemas[model.__name__]["properties"].keys() == model.model_fields.keys(), kind
    batched = schemas["BatchedChatCompletionRequest"]["properties"]
    assert "stream" not in batched and batched["messages"]["items"]["type"] == "array"


def test_the_table_of_vllms_fields_names_every_field_served_at_its_default_or_ignored() -> None:
    from pathlib import Path

    from server.openai_wire.tokenizer import TokenizeChat
    from server.openai_wire.wire import NoEffect, OnlyDefault
    from server.responses_api.wire import CreateResponse

    page = (Path(__file__).parents[2] / "docs" / "request-models.md").read_text()
    table = page[page.index("## vLLM's fields") :]
    for model in (*REQUEST_MODELS.values(), CreateResponse, TokenizeChat):
        for name, field in model.model_fields.items():
            if any(isinstance(meta, NoEffect | OnlyDefault) for meta in field.metadata):
                assert f"`{name}" in table, f"{model.__name__}.{name}"
