"""The request models (server/openai): what a refusal names, and the OpenAPI document they
generate. The routes' answers to bad input are in test_bad_input.py."""

from __future__ import annotations

import pytest

from server.api.routes import api_document
from server.core.errors import InvalidRequest, UnsupportedParameter
from server.openai.requests import REQUEST_MODELS, parse_request

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _refused(body: dict, kind: str = "chat") -> InvalidRequest:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(body, kind)
    return refused.value


def test_an_unknown_field_is_named_with_the_closest_known_one() -> None:
    error = _refused({**CHAT, "temprature": 0.5})
    assert isinstance(error, UnsupportedParameter) and error.param == "temprature"
    assert "did you mean 'temperature'?" in error.message


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
        ({**CHAT, "stream": True, "stream_options": {"x": 1}}, "stream_options.x", "'x'"),
        ({**CHAT, "kv_transfer_params": {"do_remote_decode": True}}, None, "KV connector"),
    ],
)
def test_a_refusal_names_where_the_error_is(body: dict, param: str | None, named: str) -> None:
    error = _refused(body)
    assert error.param == (param or "kv_transfer_params.do_remote_decode")
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


def test_the_document_holds_each_models_own_schema() -> None:
    schemas = api_document(frozenset({"core"}))["components"]["schemas"]
    for kind, model in REQUEST_MODELS.items():
        assert schemas[model.__name__]["properties"].keys() == model.model_fields.keys(), kind
    batched = schemas["BatchedChatCompletionRequest"]["properties"]
    assert "stream" not in batched and batched["messages"]["items"]["type"] == "array"
