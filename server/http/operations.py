"""The pieces of an OpenAPI operation that every API declares its endpoints' with: bodies as
models' schemas, the error answers, parameters, and the common operation shapes.

Every body is a model's schema (`Schema`), which the document lifts into `components`: a
request body is its request model's; a reply is the model its API's own SDK declares
(`openai.types`, `anthropic.types`: the wire formats as their makers maintain them; Sluice's
replies add fields, such as `timings`, that clients ignore), or Sluice's own
(`server.openai_wire.models`) for what no SDK describes. The SDKs are imported when the
document is first built, not when the server starts. The schemas describe what is well-formed;
what the engine then accepts (a tool choice needing a parser, logprobs on an engine without
them) is answered with a 400 naming the field, as everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode

from server.openai_wire.error_body import ErrorBody

Operation = dict[str, Any]  # an OpenAPI operation (its endpoint names its method and path)


@dataclass(frozen=True, slots=True)
class Schema:
    """A model's JSON Schema in a body: the document replaces it with its `$ref`."""

    model: type[BaseModel]
    mode: JsonSchemaMode = "serialization"


def request(model: type[BaseModel]) -> Schema:
    return Schema(model, "validation")


STR = {"type": "string"}
SSE = {"text/event-stream": {"schema": STR}}
SEQUENCE = {"type": "integer", "minimum": 0, "maximum": 10**18 - 1}


def json_content(schema: Any) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def list_of(item: Schema) -> dict[str, Any]:
    """An OpenAI list object of `item`s."""
    return {
        "type": "object",
        "required": ["object", "data"],
        "properties": {
            "object": {"const": "list"},
            "data": {"type": "array", "items": item},
            "has_more": {"type": "boolean"},
            "first_id": {"type": ["string", "null"]},
            "last_id": {"type": ["string", "null"]},
        },
    }


def errors(body: type[BaseModel] = ErrorBody) -> dict[str, Any]:
    return {
        status: {"description": description, "content": json_content(Schema(body))}
        for status, description in (
            ("400", "bad input, named in `param`"),
            ("401", "a missing or unknown key"),
            ("404", "an unknown model or object"),
            ("413", "a body over --max-body-bytes"),
            ("422", "an idempotency key sent again with another body"),
            ("429", "over a quota or the queue's bound (Retry-After)"),
            ("503", "the engine is unavailable (Retry-After)"),
            ("504", "the deadline passed while queued"),
        )
    }


def param(name: str, where: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    """A parameter: required in the path, optional elsewhere."""
    spec = {"name": name, "in": where, "required": where == "path", "schema": schema}
    return {**spec, "description": description} if description else spec


IDEMPOTENCY_KEY = param(
    "Idempotency-Key",
    "header",
    {"type": "string", "minLength": 1, "maxLength": 255},
    "makes the generation resumable; the same key and body answer with it again "
    "(Idempotent-Replayed: true), another body gets 422",
)


def reply(description: str, body: Any, *, stream: bool = False) -> dict[str, Any]:
    return {
        "description": description,
        "content": {**json_content(body), **(SSE if stream else {})},
    }


def generation(
    summary: str, body: Any, answer: Any, *, idempotent: bool = True, stream: bool = True
) -> Operation:
    return {
        "summary": summary,
        "parameters": [IDEMPOTENCY_KEY] if idempotent else [],
        "requestBody": {"required": True, "content": json_content(body)},
        "responses": {
            "200": reply(
                "a whole response, or with `stream` an SSE stream" if stream else "a response",
                answer,
                stream=stream,
            ),
            **errors(),
        },
    }


def get(summary: str, answer: Any) -> Operation:
    return {"summary": summary, "responses": {"200": reply(summary, answer)}}


def post(summary: str, body: Any, answer: Any) -> Operation:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": json_content(body)},
        "responses": {"200": reply(summary, answer), **errors()},
    }


def with_id(
    operation: Callable[[], Operation], name: str, **within: str
) -> Callable[[], Operation]:
    """`operation` on a path naming one of the tenant's objects (`{id}`: `name`), and objects
    within it (`within`: each path parameter's description, `item_id="an item id"`)."""

    def build() -> Operation:
        spec = operation()
        ids = [param("id", "path", STR, name)]
        ids += [param(key, "path", STR, description) for key, description in within.items()]
        return {
            **spec,
            "parameters": [*ids, *spec.get("parameters", [])],
            "responses": {**spec["responses"], **errors()},
        }

    return build


def query(model: type[BaseModel]) -> list[dict[str, Any]]:
    """A query string's parameters, one per field of the model that reads it (a field that
    may be null is left out of the string instead)."""
    properties = model.model_json_schema()["properties"]
    made = []
    for name, field in model.model_fields.items():
        schema = {k: v for k, v in properties[name].items() if k != "title" and v is not None}
        alternatives = [a for a in schema.pop("anyOf", ()) if a != {"type": "null"}]
        if alternatives:
            schema = {**schema, **alternatives[0]}
        made.append(param(name, "query", schema, field.description or ""))
    return made
