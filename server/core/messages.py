"""Validation errors in the configuration's terms: `path: what is wrong`.

`tenants.acme.max_concurent: unknown key; did you mean max_concurrent?`,
`budgets.max_running_seqs: expected a whole number, got 'many'`: the path as the file spells
it, and the value refused.
"""

from __future__ import annotations

import difflib
import types
import typing
from typing import Annotated, Any

from pydantic import BaseModel
from pydantic_core import ErrorDetails

_WHOLE = {"int_parsing", "int_type", "int_from_float"}
_NUMBER = {"float_parsing", "float_type", "not_a_number"}


def describe(error: ErrorDetails, model: type[BaseModel]) -> str:
    """One validation error as `path: what is wrong`, in the file's terms."""
    loc = [str(part) for part in error["loc"] if part != "[key]"]
    path = ".".join(loc)
    kind, value = error["type"], error.get("input")
    if kind == "extra_forbidden":
        return f"{path}: unknown key{_hint(loc[-1], _keys_at(model, loc[:-1]))}"
    if kind == "value_error":
        message = str(error["ctx"]["error"]) if "ctx" in error else error["msg"]
    elif kind in _WHOLE:
        message = f"expected a whole number, got {value!r}"
    elif kind in _NUMBER:
        message = f"expected a number, got {value!r}"
    elif kind in {"model_type", "dict_type"}:
        message = f"expected a mapping, got {value!r}"
    elif kind == "missing":
        message = "required"
    elif kind == "too_short":
        message = "must not be empty"
    else:
        message = f"{error['msg'].replace('Input should be', 'must be')}, got {value!r}"
    return f"{path}: {message}" if path else message


def _hint(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    if close:
        return f"; did you mean {close[0]}?"
    return f"; expected one of: {', '.join(sorted(allowed))}" if allowed else ""


def _keys_at(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The keys a mapping at `loc` may hold (following fields, and skipping dict keys)."""
    current: Any = model
    parts = list(loc)
    while True:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            if not parts:
                return list(current.model_fields)
            field = current.model_fields.get(parts.pop(0))
            if field is None:
                return []
            current = field.annotation
        elif typing.get_origin(current) is dict:
            if not parts:
                return []
            parts.pop(0)
            current = typing.get_args(current)[1]
        else:
            return []


def _unwrap(annotation: Any) -> Any:
    """`X | None` and `Annotated[X, ...]` -> X."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = args[0]
        else:
            return annotation
