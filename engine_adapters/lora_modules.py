"""LoRA adapters as a server's flags give them (vLLM's server's spelling), for any engine."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    """`adapters`: served from the start, name to path; `room`: the most served at once (these
    and those loaded at runtime; 0: none); `slots`: the most distinct ones one step runs."""

    adapters: dict[str, str]
    room: int
    slots: int


def plan_adapters(
    lora_modules: Sequence[str],
    *,
    enable_lora: bool = False,
    max_loras: int | None = None,
    max_cpu_loras: int | None = None,
) -> AdapterPlan:
    """As vLLM's flags mean them: `--max-loras` adapters in one step, `--max-cpu-loras` held
    in the engine at once (default: as many as `--max-loras`, and at least the modules; more
    may be served, the least recently used leaving the engine to make room); ValueError for
    flags that contradict each other."""
    adapters = parse_lora_modules(lora_modules)
    if not adapters and not enable_lora:
        return AdapterPlan(adapters, 0, 0)
    room = max_cpu_loras or max(max_loras or 1, len(adapters))
    slots = max_loras or room
    if slots > room:
        raise ValueError(f"--max-loras {slots} is more than --max-cpu-loras {room}")
    return AdapterPlan(adapters, room, slots)


def parse_lora_modules(items: Sequence[str]) -> dict[str, str]:
    """vLLM's `--lora-modules` forms, NAME=PATH or a JSON object with `name` and `path`, into
    name -> path (a name given twice is an error)."""
    modules: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = str(spec["name"]), str(spec["path"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f"LoRA module {item!r} is not JSON with 'name' and 'path'"
                ) from None
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"LoRA module {item!r} is not NAME=PATH")
        if name in modules:
            raise ValueError(f"LoRA module {name!r} is given twice")
        modules[name] = path
    return modules
