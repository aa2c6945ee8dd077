"""The flood benchmark's report over runs in a row: the steady frontier, the fixed cap an
operator could have chosen ahead, against each run's frontier, chosen in hindsight."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

_spec = importlib.util.spec_from_file_location(
    "flood", Path(__file__).parents[2] / "bench" / "flood.py"
)
assert _spec is not None and _spec.loader is not None
flood = importlib.util.module_from_spec(_spec)
sys.modules["flood"] = flood  # (its dataclasses look their module up there)
_spec.loader.exec_module(flood)


def rung(cap: int, within: float, bulk: float) -> dict[str, Any]:
    return {
        "system": f"sluice[cap {cap}]",
        "ladder": cap,
        "within_slo": within,
        "bulk_tokens_per_s": bulk,
    }


def adaptive(within: float, bulk: float) -> dict[str, Any]:
    return {"system": "sluice", "ladder": None, "within_slo": within, "bulk_tokens_per_s": bulk}


def test_the_steady_frontier_is_the_rung_that_kept_the_share_in_every_run() -> None:
    # Cap 18 is each run's frontier where it passes, and fails run 2; cap 15 passes every run.
    runs: list[dict[str, Any]] = [
        {
            "run": 1,
            "rows": [
                rung(12, 1.0, 4000),
                rung(15, 0.97, 4600),
                rung(18, 0.96, 5200),
                adaptive(0.98, 4800),
            ],
        },
        {
            "run": 2,
            "rows": [
                rung(12, 1.0, 3900),
                rung(15, 0.96, 4400),
                rung(18, 0.90, 5000),
                adaptive(0.97, 4400),
            ],
        },
    ]
    assert flood.steady(runs, 0.95) == "sluice[cap 15]"
    assert [run["steady_frontier"] for run in runs] == ["sluice[cap 15]"] * 2
    ratios = [run["rows"][-1]["bulk_vs_steady"] for run in runs]
    assert ratios == [round(4800 / 4600, 3), 1.0]
    table = flood.format_repeats(runs)
    assert "Steady frontier: sluice[cap 15]" in table
    assert "1.043x steady" in table and "1.000x steady" in table


def test_no_steady_frontier_when_no_rung_kept_the_share_in_every_run() -> None:
    runs: list[dict[str, Any]] = [
        {"run": 1, "rows": [rung(12, 0.94, 4000), adaptive(0.98, 4800)]},
        {"run": 2, "rows": [rung(12, 0.96, 3900), adaptive(0.97, 4400)]},
    ]
    assert flood.steady(runs, 0.95) is None
    assert "bulk_vs_steady" not in runs[0]["rows"][1]
    assert "Steady frontier: none" in flood.format_repeats(runs)
