"""The flood benchmark's plan: a row served by another checkout (`--root-variant`) is one of
Sluice's rows, its server started in that checkout with it first on `PYTHONPATH`."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "flood", Path(__file__).parents[2] / "bench" / "flood.py"
)
assert _spec is not None and _spec.loader is not None
flood = importlib.util.module_from_spec(_spec)
sys.modules["flood"] = flood  # (its dataclasses look their module up there)
_spec.loader.exec_module(flood)


def a_checkout(root: Path) -> Path:
    (root / "server").mkdir(parents=True)
    (root / "server" / "cli.py").write_text("")
    return root


def test_a_root_variant_is_a_sluice_row_served_by_its_checkout(tmp_path: Path) -> None:
    before = a_checkout(tmp_path / "before")
    args = flood.parse_args(
        ["--systems", "idle,sluice", "--root-variant", f"before={before}", "--ladder", ""]
    )
    rows = {s.name: s for s in flood.plan(args)}
    assert list(rows) == ["idle", "sluice", "sluice[before]", "sluice[SLO in ms]", "idle (again)"]
    row = rows["sluice[before]"]
    assert (row.kind, row.sluice_config, row.root) == ("sluice", None, before)
    assert row.keeps_server
    assert rows["sluice"].root == flood.ROOT
    served = flood.served_from(row.root, {"PYTHONPATH": "/elsewhere"})
    assert served["cwd"] == before
    assert served["env"]["PYTHONPATH"] == f"{before}{os.pathsep}/elsewhere"


def test_a_root_variant_must_name_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        flood.parse_args(["--root-variant", f"before={tmp_path}"])
    with pytest.raises(SystemExit):
        flood.parse_args(["--root-variant", str(a_checkout(tmp_path / "unlabelled"))])
