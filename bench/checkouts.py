"""A server process of another checkout: `python -m server.cli serve` run with `cwd` and
`PYTHONPATH` at that checkout imports its `server` package, not the one the venv's editable
install points at. Used by token_cpu.py (`--root`, `--against`) and flood.py
(`--root-variant`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # this checkout


def served_from(root: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The subprocess arguments (`cwd`, `env`) that make a server import checkout `root`'s
    code: `env` (default: this process's) with `root` first on `PYTHONPATH`."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), env.get("PYTHONPATH"))))
    return {"cwd": root, "env": env}


def checkout(text: str) -> Path:
    """A path named on the command line as a checkout to serve, resolved; refused unless it
    holds a `server` package with a CLI."""
    root = Path(text).expanduser().resolve()
    if not (root / "server" / "cli.py").is_file():
        raise ValueError(f"{root} is not a Sluice checkout (no server/cli.py)")
    return root
