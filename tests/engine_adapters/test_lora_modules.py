"""`--lora-modules` as vLLM's server takes them (NAME=PATH or a JSON object), and what
`--max-loras` and `--max-cpu-loras` make of them."""

from __future__ import annotations

import pytest

from engine_adapters.lora_modules import parse_lora_modules, plan_adapters


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


@pytest.mark.parametrize(
    ("modules", "flags", "room", "slots"),
    [
        ([], {}, 0, 0),  # no adapters
        ([], {"enable_lora": True}, 1, 1),  # loaded at runtime only
        (["a=/a", "b=/b", "c=/c"], {}, 3, 3),  # as many as given, all in one step
        (["a=/a", "b=/b", "c=/c"], {"max_loras": 2}, 3, 2),  # held: at least those given
        (["a=/a", "b=/b", "c=/c"], {"max_cpu_loras": 2}, 2, 2),  # held: fewer (LRU)
        (["a=/a"], {"max_loras": 2, "max_cpu_loras": 4}, 4, 2),
    ],
)
def test_flags_mean_what_vllms_do(
    modules: list[str], flags: dict[str, object], room: int, slots: int
) -> None:
    plan = plan_adapters(modules, **flags)  # type: ignore[arg-type]
    assert (plan.room, plan.slots) == (room, slots)


def test_more_adapters_in_one_step_than_the_engine_holds_is_refused() -> None:
    with pytest.raises(ValueError, match="--max-loras 3 is more than --max-cpu-loras 2"):
        plan_adapters(["a=/a"], max_loras=3, max_cpu_loras=2)
