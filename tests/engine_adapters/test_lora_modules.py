"""`--lora-modules` as vLLM's server takes them: NAME=PATH or a JSON object."""

from __future__ import annotations

import pytest

from engine_adapters.lora_modules import parse_lora_modules


def test_both_forms_name_to_path() -> None:
    given = ["a=/adapters/a", '{"name": "b", "path": "/adapters/b", "base_model_name": "x"}']
    assert parse_lora_modules(given) == {"a": "/adapters/a", "b": "/adapters/b"}


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("a", "is not NAME=PATH"),
        ("=/adapters/a", "is not NAME=PATH"),
        ('{"name": "a"}', "is not JSON with 'name' and 'path'"),
        ("{not json", "is not JSON with 'name' and 'path'"),
    ],
)
def test_a_malformed_module_says_why(item: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_lora_modules([item])


def test_a_name_given_twice_is_an_error() -> None:
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_modules(["a=/x", "a=/y"])
