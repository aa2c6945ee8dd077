"""What every request model shares: the base model, its field types, the fields it ignores, and
one translation of pydantic's validation errors into Sluice's 400s (`param` names the field, as
OpenAI's does)."""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar, get_args, get_type_hints

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
)
from pydantic_core import ErrorDetails, PydanticCustomError, core_schema
from typing_extensions import is_typeddict

from server.core.errors import InvalidRequest, UnsupportedParameter

MAX_LOGPROBS = 20  # vLLM's default `max_logprobs`
MAX_CHOICES = 128  # OpenAI's limit on n

# A custom error type whose error is a 400 `unsupported_parameter` (well-formed, not served).
UNSUPPORTED = "unsupported"


class WireModel(BaseModel):
    """A JSON body: strict types (no "yes" for true, no 5.0 for 5). A field it does not declare
    is accepted and ignored, as vLLM's server accepts it (`ignored_fields` names it, to be
    logged and counted); a model that must refuse such fields sets `extra="forbid"` and says
    how in `unknown_field`."""

    model_config = ConfigDict(strict=True, extra="allow", frozen=True)
    # How an undeclared field is refused where the model forbids them; `{key}` is its name.
    unknown_field: ClassVar[str] = "unsupported parameter '{key}'"


TokenId = Annotated[int, Field(ge=0)]
Number = float  # strict: an integer is a number too, a boolean is not


@dataclass(frozen=True, slots=True)
class NoEffect:
    """On a field accepted whatever its value that changes nothing Sluice answers (metadata, a
    hint, a multimodal option on a text-only server): sent, it is an ignored field, as an
    undeclared one is. `why` says why it changes nothing (the table in
    docs/request-models.md)."""

    why: str

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        return {**handler(schema), "description": f"accepted and ignored: {self.why}"}


@dataclass(frozen=True, slots=True, eq=False)
class OnlyDefault:
    """On a field accepted at these values only (each also compared by type: `True` is not
    `1`), where it changes nothing: sent at one, it is an ignored field; another value is
    well-formed but not served, a 400 `unsupported_parameter` (`why`: the reason, if the
    message should say it). Equal to itself only: `typing` caches an `Annotated` by its
    arguments' equality, and `OnlyDefault(False)` must not become `OnlyDefault(0)`'s."""

    values: tuple[Any, ...]
    why: str | None

    def __init__(self, *values: Any, why: str | None = None) -> None:
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "why", why)

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> Any:
        return core_schema.no_info_before_validator_function(self._check, handler(source))

    def __get_pydantic_json_schema__(self, schema: Any, handler: GetJsonSchemaHandler) -> Any:
        values = list(self.values)
        return {"const": values[0]} if len(values) == 1 else {"enum": values}

    def _check(self, value: Any) -> Any:
        if value is None or any(type(value) is type(v) and value == v for v in self.values):
            return value
        because = f" ({self.why})" if self.why else ""
        raise PydanticCustomError(
            UNSUPPORTED,
            "{value} is not supported by this server{because}",
            {"value": repr(value), "because": because},
        )


@functools.cache
def _ignorable(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` that change nothing when sent (`NoEffect`, `OnlyDefault`)."""
    return frozenset(
        name for name, field in model.model_fields.items() if any(map(_no_effect, field.metadata))
    )


def _no_effect(meta: Any) -> bool:
    """Whether a field's metadata says it changes nothing when sent (null is not sent)."""
    if isinstance(meta, OnlyDefault):
        return any(value is not None for value in meta.values)
    return isinstance(meta, NoEffect)


def ignored_fields(body: BaseModel) -> tuple[str, ...]:
    """The fields of a validated body that it ignores, each named once by its path through
    models (`stream_options.x`), sorted: the undeclared ones, and those declared to change
    nothing. Fields sent as null are fields not sent. (Per request: set operations on what
    was sent, against what each model class declares, found once.)"""
    found: list[str] = []
    _ignored(body, "", found)
    return tuple(sorted(set(found))) if found else ()


def _ignored(body: BaseModel, where: str, found: list[str]) -> None:
    extra = body.__pydantic_extra__
    if extra:
        found.extend(where + key for key in extra)
    model, sent = type(body), body.model_fields_set
    for name in sent & _ignorable(model):
        if getattr(body, name) is not None:
            found.append(where + name)
    for name in sent & _holding_models(model):
        value = getattr(body, name)
        for item in value if isinstance(value, list) else (value,):
            if isinstance(item, BaseModel):
                _ignored(item, f"{where}{name}.", found)


@functools.cache
def _holding_models(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` that may hold models (themselves, or in a list or a union)."""
    return frozenset(
        name
        for name, field in model.model_fields.items()
        if name not in _ignorable(model) and any(_models_in(field.annotation))
    )


def ignorable_paths(model: type[BaseModel], where: str = "") -> frozenset[str]:
    """Every path `ignored_fields` can name for a body of `model` that is a declared field
    (those of the models within it too): the vocabulary of the ignored-field counts."""
    paths = {where + name for name in _ignorable(model)}
    for name, field in model.model_fields.items():
        if where + name not in paths:
            for inner in _models_in(field.annotation):
                paths |= ignorable_paths(inner, f"{where}{name}.")
    return frozenset(paths)


def _models_in(annotation: Any) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
    for arg in get_args(annotation):
        yield from _models_in(arg)


M = TypeVar("M", bound=WireModel)


def validated(model: type[M], body: Any) -> M:
    """`body` (decoded JSON) as `model`, or the InvalidRequest that names what is wrong."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _refusal(model, body, exc.errors(include_url=False)) from None


def _refusal(model: type[WireModel], body: Any, errors: list[ErrorDetails]) -> InvalidRequest:
    """The one error to answer for `errors`: an undeclared field a model forbids first, else
    every error of the first field that has one (a union's alternatives)."""
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        error = unknown[0]
        param, owner, _ = _locate(model, body, error["loc"])
        key = str(error["loc"][-1])
        message = getattr(owner, "unknown_field", WireModel.unknown_field).format(key=key)
        return UnsupportedParameter(message, param=param)
    first = errors[0]
    param, _, _ = _locate(model, body, first["loc"])
    same = [e for e in errors if _locate(model, body, e["loc"])[0] == param]
    if first["type"] == UNSUPPORTED:
        return UnsupportedParameter(f"'{param}': {first['msg']}", param=param)
    message = "; ".join(_message(model, body, e) for e in same)
    return InvalidRequest(message, param=param)


def _message(model: type[WireModel], body: Any, error: ErrorDetails) -> str:
    """`where: what (pydantic's error type)`: the type as vLLM's server (pydantic) names it."""
    _, _, where = _locate(model, body, error["loc"])
    kind, message = error["type"], error["msg"]
    if kind == "int_type" and isinstance(error["input"], float):
        kind, message = _bound_passed(model, error) or (kind, message)
    return f"'{where}': {message} ({kind})"


def _bound_passed(model: type[WireModel], error: ErrorDetails) -> tuple[str, str] | None:
    """An integer too large for JSON's numbers (orjson reads it as a float) past a field's
    bound: answered as pydantic answers for such an integer read exactly."""
    field = model.model_fields.get(str(error["loc"][0]))
    value = error["input"]
    for meta in _metadata(field.annotation if field else None):
        ge, le = getattr(meta, "ge", None), getattr(meta, "le", None)
        if ge is not None and value <= ge:
            return "greater_than_equal", f"Input should be greater than or equal to {ge}"
        if le is not None and value >= le:
            return "less_than_equal", f"Input should be less than or equal to {le}"
    return None


def _metadata(annotation: Any) -> list[Any]:
    found: list[Any] = []
    for meta in getattr(annotation, "__metadata__", ()):
        found += getattr(meta, "metadata", [meta])  # a FieldInfo's constraints, or one
    for arg in get_args(annotation):
        found += _metadata(arg)
    return found


def _fields(owner: Any) -> dict[str, Any]:
    """The fields of a model or a TypedDict, with their annotations."""
    if isinstance(owner, type) and issubclass(owner, BaseModel):
        return {name: field.annotation for name, field in owner.model_fields.items()}
    return get_type_hints(owner, include_extras=True)


def _locate(model: type[WireModel], body: Any, loc: tuple[int | str, ...]) -> tuple[str, Any, str]:
    """For an error at `loc`: the `param` (fields of models, and list indexes between them:
    `messages[0].role`), the model that holds the last field, and the whole location with
    keys and indexes (`logit_bias['hello']`). Union alternatives and pydantic's `[key]` in
    `loc` are skipped: a part is a field, a key or an index only where the input has it."""
    param = where = ""
    owner: Any = model  # the model or TypedDict `value` is (or is a list of); None: neither
    holder: Any = model
    value = body
    for part in loc:
        if isinstance(part, int) and isinstance(value, list) and 0 <= part < len(value):
            where += f"[{part}]"
            param += f"[{part}]" if owner is not None else ""
            value = value[part]
        elif (
            isinstance(part, str)
            and owner is not None
            and isinstance(value, Mapping)
            and (part in value or part in _fields(owner))
        ):
            param += f".{part}" if param else part
            where += f".{part}" if where else part
            holder, annotation = owner, _fields(owner).get(part)
            owner = _structure_in(annotation)
            value = value.get(part)
        elif isinstance(part, str) and isinstance(value, Mapping) and part in value:
            where += f"[{part!r}]"
            value = value[part]
    return param, holder, where


def _structure_in(annotation: Any) -> Any:
    """The model or TypedDict a field holds (itself, or in a list, an optional or an
    `Annotated`), if any."""
    if isinstance(annotation, type) and (
        issubclass(annotation, BaseModel) or is_typeddict(annotation)
    ):
        return annotation
    for arg in get_args(annotation):
        found = _structure_in(arg)
        if found is not None:
            return found
    return None
