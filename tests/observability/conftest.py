"""Real servers for the observability tests: Sluice on loopback (in this process), Prometheus
and Chromium (processes of their own).

Each test starts its own Sluice server (`sluice serve --engine sim ...`'s arguments, parser and
assembly, in a thread: `InProcessSluice`) on a loopback port, waits (bounded) for its start-up,
and stops it in `finally`. Tools that come from Debian packages
(prometheus, chromium) are skipped when missing on a developer machine and fail under CI,
where scripts/install-test-deps.sh installs them.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest
from conftest import InProcessSluice
from prometheus_client.parser import text_string_to_metric_families

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVER_READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0


def require_tool(name: str) -> str:
    """The path of executable `name`; skip the test without it, fail under CI."""
    path = shutil.which(name)
    if path is None:
        message = f"{name!r} is not installed (run scripts/install-test-deps.sh)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return path


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


@dataclass
class RunningSluice:
    base_url: str
    port: int
    log_path: Path

    def metrics_text(self) -> str:
        response = httpx.get(f"{self.base_url}/metrics", timeout=5.0)
        response.raise_for_status()
        return response.text

    def metric_sum(self, name: str, **labels: str) -> float:
        """Sum of the samples named `name` (e.g. `sluice_engine_aborts_total`) whose labels
        include `labels`; 0.0 when there are none yet."""
        total = 0.0
        for family in text_string_to_metric_families(self.metrics_text()):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    total += sample.value
        return total


@contextmanager
def run_sluice(
    log_dir: Path,
    *args: str,
    engine: str = "sim",
    env: Mapping[str, str] | None = None,
    name: str = "sluice",
) -> Iterator[RunningSluice]:
    """A Sluice server in this process (`InProcessSluice`) on a loopback port, which
    Prometheus and Chromium reach as they would another process's; ready when this yields."""
    log_path = log_dir / f"{name}.log"
    server = InProcessSluice(["--engine", engine, *args], log_path, dict(env or {}))
    try:
        server.wait_ready(SERVER_READY_TIMEOUT_S)
        yield RunningSluice(server.url, server.port, log_path)
    finally:
        server.stop()
