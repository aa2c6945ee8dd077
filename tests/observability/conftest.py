"""Real servers for the observability tests: Sluice on loopback (in this process), Prometheus
and Chromium (processes of their own).

Each test starts its own Sluice server (`sluice serve --engine sim ...`'s arguments, parser and
assembly, in a thread: `InProcessSluice`) on a loopback port, waits (bounded) for its start-up,
and stops it in `finally`. Tools that come from Debian packages
(prometheus, chromium) are skipped when missing on a developer machine and fail under CI,
where scripts/install-test-deps.sh installs them.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import httpx
from conftest import InProcessSluice
from conftest import require_tool as require_tool  # (the observability tests' own import)

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0


def wait_until(
    condition: Callable[[], T | None], *, timeout_s: float, interval_s: float = 0.1, what: str
) -> T:
    """Poll `condition` until it returns something truthy; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while True:
        try:
            result = condition()
        except (httpx.HTTPError, OSError, ValueError, KeyError) as exc:
            result, last_error = None, exc
        if result:
            return result
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_error!r})" if last_error else ""
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}{detail}")
        time.sleep(interval_s)


def stop_process(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM, a bounded grace period, then SIGKILL."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace_s)


def log_tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "<no log>"


@contextmanager
def run_sluice(
    log_dir: Path,
    *args: str,
    engine: str = "sim",
    env: Mapping[str, str] | None = None,
    name: str = "sluice",
) -> Iterator[InProcessSluice]:
    """A Sluice server in this process on a loopback port, which Prometheus and Chromium reach
    as they would another process's; ready when this yields."""
    server = InProcessSluice(["--engine", engine, *args], log_dir / f"{name}.log", dict(env or {}))
    try:
        server.wait_ready(SERVER_READY_TIMEOUT_S)
        yield server
    finally:
        server.stop()
