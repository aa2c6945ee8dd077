"""Shared fixtures: real Sluice servers (uvicorn on loopback), in this process or another.

`InProcessSluice` serves in a thread of the test process (in ~0.1 s), wherever the process
is not what a test is about; `SluiceProcess` is `sluice serve` in a subprocess, for signals,
kills, engine death, and vLLM (which spawns engine processes of its own). The vLLM-backed
server starts once per test session (engine start-up takes ~30 s on CPU).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Self, TypeVar

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from engine_adapters.protocol import EngineClient
    from engine_adapters.sim_gate import StepGate
    from server.api.serving import Serving
    from server.state.backend import RedisState

ROOT = Path(__file__).resolve().parents[1]


def share_httpx_default_ssl_context(package: str) -> None:
    """One SSL context for every client of `package` (httpx, or httpx2: the openai and
    anthropic SDKs' fork of it) the tests make.

    httpx builds a new default context, loading certifi's CA bundle (~20-30 ms), for every
    client it makes, and so for every `httpx.get(...)` and every SDK client: hundreds of times
    a run, each request plain HTTP to loopback, where no context is used. Here the default one
    (`verify=True`, no client certificate) is built once and shared, as `verify=<context>`
    shares one among clients; any other arguments still get a context of their own. Where the
    package has no `create_ssl_context` to share (another version), nothing changes."""
    import functools
    import importlib

    try:
        _config = importlib.import_module(f"{package}._config")
        default = importlib.import_module(f"{package}._transports.default")
    except ImportError:
        return
    create = getattr(_config, "create_ssl_context", None)
    if create is None or getattr(default, "create_ssl_context", None) is not create:
        return
    shared = functools.cache(create)

    def create_ssl_context(verify: object = True, cert: object = None, trust_env: bool = True):  # type: ignore[no-untyped-def]
        if verify is True and cert is None:
            return shared(True, None, trust_env)
        return create(verify, cert, trust_env)

    default.create_ssl_context = create_ssl_context


for _package in ("httpx", "httpx2"):
    share_httpx_default_ssl_context(_package)
READY_TIMEOUT_S = float(os.environ.get("SLUICE_TEST_READY_TIMEOUT", "240"))
# An in-process server (the sim engine, most often) is ready in ~0.1 s: this bounds a failure.
IN_PROCESS_READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


# Tool calls read by vLLM's pythonic parser (plain text: the demo tokenizer has no tool-call
# tokens), and JSON without free whitespace, which a random-weight model would emit forever.
VLLM_OUTPUT_FLAGS = [
    "--tool-call-parser",
    "pythonic",
    "--enable-auto-tool-choice",
    "--engine-arg",
    'structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": true}',
]


# The tool and structured-output tests' question and schema (on vLLM: its constrained output
# fills the schema, whatever the demo model's random weights would say).
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "sunny"],
    "additionalProperties": False,
}


# Fixtures that start the real vLLM engine: a test that uses one is marked `vllm`, so that
# `pytest -m "not vllm"` runs the pure and sim tests alone.
VLLM_FIXTURES = {
    "vllm_server",
    "keyed_vllm_server",
    "demo_model_dir",
    "demo_adapters",
}


# The session's servers on the real engine, and the xdist group of the tests that use each: the
# spare replica beside the session's server goes with it (the fleet tests use both).
SHARED_ENGINES = {
    "vllm_server": "vllm_server",
    "spare_replica": "vllm_server",
    "keyed_vllm_server": "keyed_vllm_server",
}
# The session's servers that a test ends (`ends_shared_server(<fixture>)`: it kills the server's
# process or its engine), in the order they end: the takeover test kills the spare replica and
# continues its generation on the session's server, whose engine the engine-death test then
# kills.
ENDED_IN_ORDER = ("spare_replica", "vllm_server")


# The tiers (docs/testing.md): `unit` runs no server; `service` serves an app in this process on
# loopback; `system` runs real processes (vLLM, a `sluice serve` whose process is the subject,
# Redis, Chromium, Prometheus). A module whose tests start processes says `system` itself; the
# rest is derived here.
SYSTEM_NEEDS = {"vllm", "browser", "prometheus"}
SERVICE_FIXTURES = {"sim_server"}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Markers from what a test uses, set as it is collected (pytest-xdist reads the groups in
    its own `pytest_collection_modifyitems`, which would otherwise run first)."""
    fixtures = set(getattr(item, "fixturenames", ()))
    if VLLM_FIXTURES & fixtures:
        item.add_marker(pytest.mark.vllm)
    # Under pytest-xdist (`--dist loadgroup`), the tests of each session server on the real
    # engine run in one worker, so that its engine starts once, not once per worker.
    group = next((group for name, group in SHARED_ENGINES.items() if name in fixtures), None)
    if group is not None:
        item.add_marker(pytest.mark.xdist_group(group))
    marked = {marker.name for marker in item.iter_markers()}
    if marked & {"unit", "service", "system"}:
        return
    if marked & SYSTEM_NEEDS:
        item.add_marker(pytest.mark.system)
    elif SERVICE_FIXTURES & fixtures:
        item.add_marker(pytest.mark.service)
    else:
        item.add_marker(pytest.mark.unit)


def loopback_listener() -> socket.socket:
    """A listening socket on a free loopback port, for a server process to inherit (`sluice
    serve --fd`): bound here, so no other process can take the port between its choice and
    its use, as one could with a number chosen first and bound later (tests run in parallel)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    return listener


def reserved_port() -> int:
    """A free loopback port's number, for a program that must bind it itself (Prometheus,
    `--metrics-port`); the one place a test picks a number.

    The port is left in TIME_WAIT (a connection to it, closed by its accepting side first),
    which keeps the kernel from handing it to another socket asking for any port (port 0)
    for a minute, while a server that binds it by number with SO_REUSEADDR (uvicorn's and Go's
    listeners do) can take it at once.
    """
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = listener.getsockname()
        with socket.create_connection(address) as client:
            accepted, _ = listener.accept()
            accepted.close()
            client.recv(1)  # the accepting side's FIN: it closed first, and holds TIME_WAIT
        return int(address[1])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that ends one of the session's servers (`ends_shared_server(<fixture>)`) runs
    after the tests that use it alive, whichever file comes first: the tests that end one go
    last, in `ENDED_IN_ORDER` (pytest-xdist keeps a group's tests together, in this order)."""

    def order(item: pytest.Item) -> int:
        ends = item.get_closest_marker("ends_shared_server")
        return 0 if ends is None else 1 + ENDED_IN_ORDER.index(ends.args[0])

    items.sort(key=order)


# How many of the collected tests use each of the session's servers, left to run here, and
# what stops each server that has started.
USES_LEFT = pytest.StashKey[Counter[str]]()
STOPS = pytest.StashKey[dict[str, Callable[[], object]]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Count the uses of the session's servers (`stop_after_last_use`), then freeze what
    collection imported (the server, uvicorn, the test modules: the test process's
    start-up), as `sluice serve` does its own once started: full collections during the tests
    then walk only what the tests made."""
    session.stash[USES_LEFT] = Counter(
        name
        for item in session.items
        for name in SHARED_ENGINES
        if name in getattr(item, "fixturenames", ())
    )
    session.stash[STOPS] = {}
    gc.collect()
    gc.freeze()


def stop_after_last_use(request: pytest.FixtureRequest, stop: Callable[[], object]) -> None:
    """`stop` the session's server that `request`'s fixture made once the last test that uses
    it is done here, not at the session's end: an idle engine still costs a few percent of a
    core, for the minutes the other tests run. The tests that use one run in one xdist worker
    (its group), which collects every test, so the count of them here is the count of its
    users."""
    request.session.stash[STOPS][request.fixturename] = stop


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        uses, stops = item.session.stash[USES_LEFT], item.session.stash[STOPS]
        for name in SHARED_ENGINES:
            if name in getattr(item, "fixturenames", ()):
                uses[name] -= 1
                if uses[name] <= 0 and name in stops:
                    stops.pop(name)()


# The sim engine as fast as it runs (steps of ~0.05 ms where its default model takes ~2 ms), for
# a server whose tests read whole answers and never catch a stream mid-way: they wait for no
# steps, and its tokens cost the same CPU.
FAST_SIM = ["--sim-step-base-ms", "0.05", "--sim-decode-ms-per-token", "0.001"]


def uncalibrated_config(directory: Path, more: str = "", name: str = "sluice.yaml") -> Path:
    """A configuration file (`more` is further YAML) for a server started without its engine
    calibration (`estimates.calibrate: false`): the probe costs ~4 s at the sim's default
    speed and seconds at 20-40 ms a step, and the scheduler starts from its priors and learns
    online. For tests whose subject does not depend on the engine's measured speed."""
    config = directory / name
    config.write_text("estimates: {calibrate: false}\n" + more)
    return config


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` (e.g. `sluice_requests_total`) in the exposition `text`
    whose labels include `labels`; 0.0 when there are none yet.

    Only the lines of `name`'s samples are parsed: a server's whole exposition (~1,000 lines
    once it has served a few APIs) took ~30 ms to parse, at each of the suite's metric reads."""
    own = "\n".join(line for line in text.splitlines() if line.startswith(name))
    return sum(
        sample.value
        for family in text_string_to_metric_families(own)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


class Served:
    """A server that starts as it is made, as a context manager: ready on entering (stopped if
    it never gets there), stopped on leaving. Subclasses wait for it (`wait_ready`, its default
    timeout theirs) and stop it (`stop`)."""

    def wait_ready(self) -> None:
        raise NotImplementedError

    def stop(self) -> object:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


ServedT = TypeVar("ServedT", bound=Served)
T = TypeVar("T")


@contextlib.contextmanager
def all_ready(servers: list[ServedT]) -> Iterator[list[ServedT]]:
    """`servers`, started together (each as it was made), ready together and stopped together,
    whichever of them failed to start."""
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


class ServiceProcess(Served):
    """A server in a subprocess of its own process group (stopped as a whole), its output in
    `log_path`: ready once GET `ready_path` answers 200, stopped by `stop_signal` (then SIGKILL
    after `stop_timeout`). Subclasses start `proc` and set `url`."""

    name = "server"
    ready_path = "/ready"
    stop_signal = signal.SIGINT
    stop_timeout = 30.0
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    _log: Any

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            # A server on a socket bound before it starts (`--fd`) has its connections queued
            # until it serves: one request waits for its answer, which comes as soon as the
            # server takes it (or a reset, when it exits). A 2 s timeout left each try queued
            # unanswered, and saw a ready server up to 2 s late.
            wait = httpx.Timeout(2.0, read=max(0.1, min(10.0, deadline - time.monotonic())))
            try:
                if httpx.get(self.url + self.ready_path, timeout=wait).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)  # polling interval for start-up, not a stand-in for a condition
        raise TimeoutError(f"{self.name} not ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, self.stop_signal)
            try:
                self.proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


class SluiceProcess(ServiceProcess):
    """`sluice serve` in a subprocess on a free loopback port, its output in a log file.

    It serves on a listening socket bound here and inherited (`--fd`): `listener` when given
    (a test that needs the socket's options set), else one of `loopback_listener()`. Its data
    directory is one of its own, unless the test names one (`--data-dir`) or asks for the
    default (`default_data_dir`: `$XDG_DATA_HOME/sluice`, the test's `env` setting it)."""

    kv_events: str | None = None  # where its engine publishes vLLM's KV events, if it does

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        listener: socket.socket | None = None,
        *,
        default_data_dir: bool = False,
    ) -> None:
        listener = listener or loopback_listener()
        self.port = int(listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        data_dir = (
            []
            if "--data-dir" in args or default_data_dir
            else ["--data-dir", str(log_path.parent / f"data-{self.port}")]
        )
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # Its own process group (stopped as a whole: vLLM's engine processes too), but not its
        # own session: Linux gives each session an autogroup, and the engine's busy processes in
        # a separate autogroup starved this test process for seconds at a time on 2 cores.
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "server.cli",
                "serve",
                "--fd",
                str(listener.fileno()),
                *data_dir,
                *args,
            ],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            process_group=0,
            pass_fds=(listener.fileno(),),
        )
        # The server's copy alone: once it exits, connecting is refused, not left queued.
        listener.close()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return metric_sum(httpx.get(self.url + "/metrics", timeout=5).text, name, **labels)


class InProcessSluice(Served):
    """`sluice serve` in a thread of this process, where the process is not what a test is
    about: the same arguments, parser and assembly as the command (`server.api.serving`), uvicorn
    on a loopback socket bound before it starts (`listener`, else one of `loopback_listener()`:
    no free-port race), an event loop of its own
    (the tests' sync clients would block one shared with the server) and a metrics registry
    of its own. Ready once its lifespan's start-up is done; the records its thread logs go to
    `log_path`. `metrics_port`: /metrics on a second socket (`--metrics-port`), not the API's.
    With `--engine sim`, `held_steps()` puts its engine's steps in the test's hand.
    """

    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        listener: socket.socket | None = None,
        *,
        metrics_port: bool = False,
    ) -> None:
        from server.cli import parse_serve

        self._socket = listener or loopback_listener()
        self.port = int(self._socket.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._metrics_socket = loopback_listener() if metrics_port else None
        self.metrics_port = (
            None if self._metrics_socket is None else int(self._metrics_socket.getsockname()[1])
        )
        data_dir = (
            []
            if "--data-dir" in args
            else ["--data-dir", str(log_path.parent / f"data-{self.port}")]
        )
        metrics_args = (
            [] if self.metrics_port is None else ["--metrics-port", str(self.metrics_port)]
        )
        where = ["--host", "127.0.0.1", "--port", str(self.port), *data_dir, *metrics_args]
        self.command = parse_serve([*where, *args])
        self.log_path = log_path
        self.returncode: int | None = None
        self._environ = {**os.environ, **(env or {})}
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._serving: Serving | None = None
        self._engine: EngineClient | None = None  # the assembled app's, once built
        self._thread = threading.Thread(target=self._run, name=f"sluice-{self.port}", daemon=True)
        self._log_handler = self._capture_log()
        self._thread.start()

    def _capture_log(self) -> logging.Handler:
        """What the server's thread logs, at its --log-level, into `log_path` (the levels of
        Sluice's and uvicorn's loggers are this test process's, lowered if need be)."""
        level = logging.getLevelName(self.command.options.log_level.upper())
        for name in ("sluice", "uvicorn"):
            named = logging.getLogger(name)
            if named.getEffectiveLevel() > level:
                named.setLevel(level)
        handler = logging.FileHandler(self.log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handler.setLevel(level)
        handler.addFilter(lambda record: record.thread == self._thread.ident)
        logging.getLogger().addHandler(handler)
        return handler

    def _run(self) -> None:
        from server.api.serving import loop_factory

        try:
            with asyncio.Runner(loop_factory=loop_factory()) as runner:
                self.returncode = runner.run(self._serve())
        except BaseException as exc:  # SystemExit too: a start-up that failed or was refused
            self._failure = exc
        finally:
            self._ready.set()

    async def _serve(self) -> int:
        from server.api.serving import Serving, assemble

        assembled = assemble(self.command, self._environ)
        serving = Serving(assembled, log_config=None, on_started=self._ready.set)
        self._loop, self._serving = asyncio.get_running_loop(), serving
        self._engine = assembled.app.services.engine
        metrics_sockets = None if self._metrics_socket is None else [self._metrics_socket]
        return await serving.run([self._socket], metrics_sockets)

    def wait_ready(self, timeout: float = IN_PROCESS_READY_TIMEOUT_S) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError(f"server not ready in {timeout}s:\n{self.log()}")
        if not self._thread.is_alive() or self._failure is not None:
            self._thread.join(STOP_TIMEOUT_S)
            raise RuntimeError(
                f"server stopped ({self.returncode}, {self._failure!r}):\n{self.log()}"
            ) from self._failure

    def log(self) -> str:
        self._log_handler.flush()
        return self.log_path.read_text(errors="replace")[-6000:]

    def metrics_text(self) -> str:
        """Its own /metrics (its own registry), from `--metrics-port` when it has one."""
        port = self.port if self.metrics_port is None else self.metrics_port
        response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        response.raise_for_status()
        return response.text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return metric_sum(self.metrics_text(), name, **labels)

    def on_loop(self, call: Callable[[], T]) -> T:
        """`call()` run on the server's event loop (from any other thread), its result once
        it has run."""
        loop = self._loop
        assert loop is not None, "the server is not started"
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                done.set_result(call())
            except BaseException as exc:
                done.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return done.result(STOP_TIMEOUT_S)

    def held_steps(self) -> HeldSteps:
        """Its sim engine's steps in the test's hand, from `with` on (`HeldSteps`)."""
        from engine_adapters.sim import SimEngine

        assert isinstance(self._engine, SimEngine), "held steps need --engine sim"
        return HeldSteps(self, self._engine.gate)

    def stop(self) -> int | None:
        """Stop as SIGINT stops the process (graceful, bounded); the exit status `serve` would
        have returned."""
        self._ready.wait(READY_TIMEOUT_S)
        loop, serving = self._loop, self._serving
        if self._thread.is_alive() and loop is not None and serving is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                loop.call_soon_threadsafe(serving.stop)
        self._thread.join(STOP_TIMEOUT_S)
        logging.getLogger().removeHandler(self._log_handler)
        self._log_handler.close()
        for sock in (self._socket, self._metrics_socket):
            if sock is not None:
                sock.close()
        if self._thread.is_alive():
            raise RuntimeError(f"in-process server did not stop in {STOP_TIMEOUT_S}s")
        return self.returncode


class HeldSteps:
    """An in-process server's sim engine held (its `StepGate`), for a test that needs "B
    happens while A still runs" to hold by an order, not by the time a long answer takes:
    `with server.held_steps() as steps:` holds it (no step begins; requests still arrive and
    are aborted); `steps.step(n)` lets n more begin, at once; `steps.run()` lets them all run
    back to back; the `with`'s end gives the engine back its pace. Each call has run on the
    server's loop when it returns.

    A test that reads a stream lets one step through for each event it reads (each step a
    token, each token an event): however busy the host, the generation is no further on than
    the test has read, and never stalls, since each event read lets the next token come."""

    def __init__(self, server: InProcessSluice, gate: StepGate) -> None:
        self._server, self._gate = server, gate

    def __enter__(self) -> Self:
        self._server.on_loop(self._gate.hold)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.on_loop(self._gate.open)

    def step(self, count: int = 1) -> None:
        self._server.on_loop(lambda: self._gate.step(count))

    def run(self) -> None:
        self._server.on_loop(lambda: self._gate.open(paced=False))


def api_keys_env(keys: dict[str, str]) -> dict[str, str]:
    """The environment that gives a server these API keys (`{key: tenant}`): SLUICE_API_KEYS,
    `key:tenant,...`."""
    return {"SLUICE_API_KEYS": ",".join(f"{key}:{tenant}" for key, tenant in keys.items())}


def sim_sluice(
    root: Path,
    *args: str,
    config: str = "",
    keys: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    log: str = "server.log",
    listener: socket.socket | None = None,
    metrics_port: bool = False,
) -> InProcessSluice:
    """The tests' usual server: the sim engine in this process, uncalibrated
    (`uncalibrated_config`, `config` its further YAML, in a file named after its `log`), with
    `args` (more flags), the API keys `keys` ({key: tenant}) and `env`, logging to `root / log`.
    Started, not yet ready: `with sim_sluice(...) as server:` waits for it, and stops it."""
    config_file = uncalibrated_config(root, config, name=f"{Path(log).stem}.yaml")
    environ = {**(env or {}), **(api_keys_env(keys) if keys else {})}
    return InProcessSluice(
        ["--engine", "sim", "--config", str(config_file), *args],
        root / log,
        env=environ,
        listener=listener,
        metrics_port=metrics_port,
    )


def parse_sse(lines: list[str]) -> list[tuple[int | None, str]]:
    """(id, data) per event of an SSE stream (id None: the event has none)."""
    events, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = int(line[4:])
        elif line.startswith("data: "):
            events.append((event_id, line[6:]))
            event_id = None
    return events


def wait_until(condition, timeout: float, interval: float = 0.05, message: str = "") -> None:  # type: ignore[no-untyped-def]
    """Poll `condition` until true, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met in {timeout}s: {message}")
        time.sleep(interval)


def wait_at_zero(
    server: InProcessSluice | SluiceProcess, *gauges: str, timeout: float, message: str = ""
) -> None:
    """Poll until each of the server's `gauges` reads 0, in order (what a test's requests held
    is let go: nothing running, queued, budgeted, left in the engine)."""
    wait_until(lambda: all(server.metric(gauge) == 0 for gauge in gauges), timeout, message=message)


def require_tool(name: str) -> str:
    """The path of executable `name` (a tool scripts/install-test-deps.sh installs); skip the
    test without it, fail under CI."""
    path = shutil.which(name)
    if path is None:
        missing(f"{name!r} is not installed (run scripts/install-test-deps.sh)")
    return path


def missing(message: str) -> NoReturn:
    """Something a test needs is not installed: skip the test, or fail it under CI (which
    installs everything)."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


class RedisProcess:
    """`redis-server` in memory only, on a unix socket (no port to choose, so none to race
    for); stopped and started again at the same path."""

    def __init__(self, directory: Path) -> None:
        binary = shutil.which("redis-server")
        assert binary, "redis-server is not installed: run scripts/install-test-deps.sh"
        self.binary, self.directory = binary, directory
        # A socket's path holds at most 107 bytes: a short directory of its own, not the test's.
        self._socket_dir = Path(tempfile.mkdtemp(prefix="redis-"))
        self.socket_path = self._socket_dir / "redis.sock"
        self.url = f"unix://{self.socket_path}?db=0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                "0",
                "--unixsocket",
                str(self.socket_path),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            process_group=0,
        )
        wait_until(self.answers, 60, message="redis-server answers")

    def answers(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as connection:
                connection.settimeout(0.5)
                connection.connect(str(self.socket_path))
                connection.sendall(b"PING\r\n")  # (an inline command: no client library)
                return connection.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.terminate()
        self.proc.wait(timeout=10)

    def close(self) -> None:
        """Stop it for good (if running), and remove its socket's directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        shutil.rmtree(self._socket_dir, ignore_errors=True)

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextlib.asynccontextmanager
async def redis_replicas(
    redis: RedisProcess, lease_seconds: float, count: int = 2
) -> AsyncIterator[list[RedisState]]:
    """The shared state of `count` replicas on `redis` (`RedisState`s, leases of
    `lease_seconds`), started, and stopped on leaving: a store's handles as replicas hold them."""
    from server.core.config import StateConfig
    from server.observability.metrics import Metrics
    from server.state.backend import RedisState

    config = StateConfig(url=redis.url, lease_seconds=lease_seconds)
    states = [RedisState(config, Metrics()) for _ in range(count)]
    try:
        for state in states:
            await state.start()
        yield states
    finally:
        for state in states:
            await state.stop()


class Clock:
    """A clock a test moves by hand (`now`, in seconds), for the parts that take one."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# The bodies vLLM's router (vllm-router 0.1.17) sends on: it re-serialises a client's chat and
# completion with SGLang's defaults (a client's `max_tokens: 5` and one user message here).
ROUTER_CHAT = {
    "messages": [{"role": "user", "content": "hello there"}],
    "stream": False,
    "max_tokens": 5,
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
    "include_reasoning": True,
}
ROUTER_COMPLETION = {
    "prompt": "hello there",
    "max_tokens": 5,
    "stream": False,
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


@contextlib.contextmanager
def sim_fleet(
    root: Path, more_config: str = "", *, replicas: int = 2
) -> Iterator[tuple[RouterProcess, list[InProcessSluice]]]:
    """Sim replicas in this process on one real Redis (uncalibrated, with `more_config`'s
    YAML: tenants, say), and vLLM's router (cache_aware) in front of them."""
    with RedisProcess(root) as redis:
        started = [
            sim_sluice(root, "--state-url", redis.url, config=more_config, log=f"replica-{i}.log")
            for i in range(replicas)
        ]
        with all_ready(started) as servers:
            workers = [server.url for server in servers]
            with RouterProcess(workers, root / "router.log") as router:
                yield router, servers


class AccessLines(logging.Handler):
    """The access logger's lines, as JSON, from the logger itself (whether it propagates to
    the root logger is another test's business)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(record.getMessage()))

    def where(self, **fields: object) -> list[dict[str, Any]]:
        """The lines so far whose fields hold these values."""
        return [
            line for line in list(self.lines) if all(line.get(k) == v for k, v in fields.items())
        ]


@pytest.fixture
def access_lines() -> Iterator[AccessLines]:
    """The access log's lines while the test runs (the servers in this process)."""
    from server.observability.access_log import ACCESS_LOGGER_NAME

    handler = AccessLines()
    access_logger = logging.getLogger(ACCESS_LOGGER_NAME)
    level = access_logger.level
    access_logger.setLevel(logging.INFO)
    access_logger.addHandler(handler)
    try:
        yield handler
    finally:
        access_logger.removeHandler(handler)
        access_logger.setLevel(level)


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from engine_adapters.demo_model import build_demo_model

    cache = Path(os.environ.get("SLUICE_CACHE_DIR", Path.home() / ".cache" / "sluice"))
    return build_demo_model(cache / "demo-model")


@pytest.fixture(scope="session")
def session_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """The vLLM server's shared state (a test may start more replicas on it)."""
    with RedisProcess(tmp_path_factory.mktemp("session-redis")) as server:
        yield server


def vllm_args(demo_model_dir: Path) -> list[str]:
    """A vLLM replica's arguments, as the session's server has them."""
    return [
        "--engine",
        "vllm",
        "--model",
        str(demo_model_dir),
        "--served-model-name",
        "sluice-demo",
        *VLLM_OUTPUT_FLAGS,
        "--engine-arg",
        "enable_prompt_embeds=true",
    ]


# The test servers' engines run vLLM's worker in the engine core's process
# (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: vLLM's layout for one worker, as on one GPU), not in a
# third process, which vLLM on CPU starts only to set OpenMP's environment before torch loads
# there; and on one OpenMP thread (`OMP_NUM_THREADS`), as vLLM sets that worker on 2 cores.
# Sluice sees the same engine core. Measured on the 2-core EPYC (2026-12-07), against the
# default: a start 35 s of CPU, now 25 s (one import of torch and vLLM fewer); an idle engine
# 0.75 s of CPU in 10 s, now 0.2 s (the core no longer polls the worker's queue); 1,280 greedy
# tokens 4.9-5.4 s of CPU, now 2.4-3.5 s. The terminal test keeps the product's processes.
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
}
# A vLLM server whose tests do not depend on the engine's measured speed starts without the
# probe (4 s on an idle host, 7-9 s beside other work): the scheduler starts from its priors
# and learns online. The session's server keeps it, as `sluice serve` runs.
UNCALIBRATED_VLLM_ENV = {**VLLM_ENV, "SLUICE_ESTIMATES__CALIBRATE": "false"}
# The model run as it is, not compiled (`enforce_eager`): vLLM compiles it at every start here
# (its compile cache fails to load: "'function' object has no attribute 'finalize_loading'"),
# 8 s of a start's CPU, and a compiled step saves ~1 ms of CPU a token after (2026-12-07, 1,280
# tokens: 2.4-3.5 s of CPU compiled, 4.1 s not). The preemption and engine-death tests' 4,000
# tokens, on a server of their own then, took 30.4 s of CPU compiled and 25.7 s not; the
# session's server's ~3,500 tokens cost its 66 tests 63 s either way, and it compiles, as
# `sluice serve` does.
EAGER = ["--engine-arg", "enforce_eager=true"]


def kv_events_args() -> tuple[list[str], str]:
    """A vLLM replica's `--kv-events-config` (vLLM's KV events on a reserved port, the empty
    topic vllm-router reads), and the endpoint a router subscribes to."""
    from server.fleet import kv_events_config

    port = reserved_port()
    return ["--kv-events-config", kv_events_config(port)], f"tcp://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def vllm_server(
    request: pytest.FixtureRequest,
    demo_model_dir: Path,
    session_redis: RedisProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SluiceProcess]:
    """Sluice on vLLM with the demo model, its resumable generations shared in Redis, its
    engine publishing vLLM's KV events (`kv_events`: where, for a router's kv_aware policy).
    Its last test kills its engine (tests/api/test_engine_death.py): it exits 8 s after
    (`--engine-death-exit-seconds`, which changes nothing while the engine lives)."""
    kv_args, kv_events = kv_events_args()
    death = ["--engine-death-exit-seconds", "8"]
    server = SluiceProcess(
        [*vllm_args(demo_model_dir), "--state-url", session_redis.url, *kv_args, *death],
        tmp_path_factory.mktemp("vllm") / "server.log",
        env=VLLM_ENV,
    )
    server.kv_events = kv_events
    if request.session.stash[USES_LEFT]["spare_replica"] > 0:
        # (its tests run here, in this group: its engine starts beside this one's, not after)
        request.getfixturevalue("spare_replica").launch()
    try:
        server.wait_ready()
        stop_after_last_use(request, server.stop)
        yield server
    finally:
        server.stop()


class SharedServer:
    """One of the session's servers, started on its first use: `get` for the tests that use it
    alive, `take` for the test that ends it (kills its process or its engine, and stops it),
    after which a `get` starts another. The test that takes it is marked
    `ends_shared_server(<fixture>)`, so that it runs after the others
    (`pytest_collection_modifyitems`)."""

    def __init__(self, start: Callable[[int], SluiceProcess]) -> None:
        self._start = start  # the server of start number N, not yet ready
        self._launched: SluiceProcess | None = None  # started, not yet waited for
        self.server: SluiceProcess | None = None
        self.started = 0

    def launch(self) -> None:
        """Start the server now, without waiting for it: the first `get` waits."""
        if self._launched is None and self.server is None:
            self._launched = self._start(self.started)
            self.started += 1

    def get(self) -> SluiceProcess:
        """The running server, started if there is none (or it exited: a failed test's)."""
        if self.server is not None and self.server.proc.poll() is not None:
            self.server.stop()
            self.server = None
        if self.server is None:
            self.launch()
            launched, self._launched = self._launched, None
            self.server = launched.__enter__()  # ready (stopped if it never gets there)
        return self.server

    def take(self) -> SluiceProcess:
        """The running server, for a test that ends it: the next `get` starts another."""
        server, self.server = self.get(), None
        return server

    def close(self) -> None:
        for server in (self.server, self._launched):
            if server is not None:
                server.stop()


# The spare replica's budgets, for the preemption test: room for two sequences and no
# interactive reserve, and no bulk cap, so that both bulk requests run at once whatever the
# engine's measured speed (with the cap, one CI run on a loaded machine saw the first end before
# the chat was even sent, as when the cap, its knee, admits one bulk sequence and the second
# waits for the first).
TWO_SEATS = """
budgets:
  max_running_seqs: 2
  interactive_reserve_share: 0.0
  bulk_min_share: 0.0
  preempt_bulk_after_ms: 100
slo:
  cap_bulk: false
"""


@pytest.fixture(scope="session")
def spare_replica(
    request: pytest.FixtureRequest,
    demo_model_dir: Path,
    session_redis: RedisProcess,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SharedServer]:
    """A second vLLM replica beside the session's server, on its Redis, publishing KV events,
    its claims lapsing 2 s after its last renewal, with room for two sequences (`TWO_SEATS`):
    the preemption test's server (tests/api/test_preemption.py), the fleet tests' second
    replica (tests/fleet/test_router_vllm.py: one request at a time, and a batch whose three
    lines take turns for the two seats), then the replica the takeover test kills
    (tests/generations/test_takeover_vllm.py), so one engine start serves all three."""
    root = tmp_path_factory.mktemp("spare")
    config = root / "spare.yaml"
    # (a killed one's stream moves on soon)
    config.write_text(TWO_SEATS + "state: {lease_seconds: 2}\n")

    def start(number: int) -> SluiceProcess:
        kv_args, kv_events = kv_events_args()
        args = [*vllm_args(demo_model_dir), *EAGER, "--config", str(config)]
        replica = SluiceProcess(
            [*args, "--state-url", session_redis.url, *kv_args],
            root / f"replica-{number}.log",
            env=UNCALIBRATED_VLLM_ENV,
        )
        replica.kv_events = kv_events
        return replica

    spare = SharedServer(start)
    stop_after_last_use(request, spare.close)
    try:
        yield spare
    finally:
        spare.close()


LORA_ADAPTERS = ("tenant-a", "tenant-b")  # the keyed server's adapters at start: demo variants 1, 2


@pytest.fixture(scope="session")
def demo_adapters(demo_model_dir: Path) -> dict[str, Path]:
    """The demo adapters, built once into the cache beside the demo model, as `sluice serve
    --demo-lora` builds its own (`demo-lora`, variant 1): built for each session in each worker
    whose servers serve them, they took ~4 s of CPU a worker (torch and transformers)."""
    from engine_adapters.demo_model import build_demo_adapter

    cache = demo_model_dir.parent
    return {
        name: build_demo_adapter(
            cache / ("demo-lora" if number == 1 else f"demo-lora-{number}"),
            demo_model_dir,
            variant=number,
        )
        for number, name in enumerate(LORA_ADAPTERS, start=1)
    }


# The keyed vLLM server's tenants, each with one key: the LoRA tests' (tests/api/
# test_lora_adapters.py and the batch's LoRA lines), the runtime LoRA tests' (an admin, a user,
# and one limited to an adapter loaded later: tests/api/test_lora_runtime.py) and the
# prefix-cache tests' (two with caches of their own, two sharing theirs: tests/tenancy/
# test_prefix_cache_vllm.py). One engine serves all four modules: no module's tenants see
# another's, and what a test loads at runtime it unloads.
KEYED_TENANTS: dict[str, dict[str, Any]] = {
    "lora": {"api_keys": ["sk-lora"]},
    "ops": {"api_keys": ["sk-ops"], "admin": True},
    "user": {"api_keys": ["sk-user"]},
    "limited": {"api_keys": ["sk-limited"], "models": ["narrow"]},
    "alpha": {"api_keys": ["sk-alpha"]},
    "beta": {"api_keys": ["sk-beta"]},
    "gamma": {"api_keys": ["sk-gamma"], "prefix_cache": "shared"},
    "delta": {"api_keys": ["sk-delta"], "prefix_cache": "shared"},
}


def tenant_key(tenant: str) -> str:
    """The key of one of `KEYED_TENANTS`."""
    return str(KEYED_TENANTS[tenant]["api_keys"][0])


@pytest.fixture(scope="session")
def keyed_vllm_server(
    request: pytest.FixtureRequest,
    demo_model_dir: Path,
    demo_adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SluiceProcess]:
    """Sluice on vLLM with the demo model, closed to all but `KEYED_TENANTS`, in float32 (vLLM
    0.32's CPU LoRA), serving the two demo adapters from the start (`LORA_ADAPTERS`) and those
    an admin loads at runtime. The engine holds two at once, and runs both in one step
    (`--max-cpu-loras 2`): one more in use makes the least recently used one leave it, to
    come back when a request names it. An engine of its own, so that the session's server runs
    without LoRA."""
    root = tmp_path_factory.mktemp("keyed")
    config = root / "sluice.json"
    config.write_text(json.dumps({"tenants": KEYED_TENANTS}))  # (YAML reads JSON)
    modules = [f"{name}={path}" for name, path in demo_adapters.items()]
    args = [
        "--model", str(demo_model_dir), "--served-model-name", "sluice-demo",
        "--config", str(config), "--lora-modules", *modules,
        "--max-cpu-loras", "2", "--engine-arg", "dtype=float32", *EAGER,
    ]  # fmt: skip
    with SluiceProcess(args, root / "server.log", env=UNCALIBRATED_VLLM_ENV) as server:
        stop_after_last_use(request, server.stop)
        yield server


@pytest.fixture(scope="session")
def sim_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    """The sim engine's server for validation and routes (uncalibrated: what its tests check
    does not depend on the engine's measured speed)."""
    with sim_sluice(tmp_path_factory.mktemp("sim")) as server:
        yield server


class RouterProcess(ServiceProcess):
    """vLLM's router (`vllm-router`, the dev extra's) in front of `workers`, on a reserved
    loopback port (it binds by number), its log in a file; ready once it answers `/health`
    (it waits for a healthy worker first)."""

    name = "vllm-router"
    ready_path = "/health"
    stop_signal = signal.SIGTERM
    stop_timeout = 10.0

    def __init__(
        self,
        workers: list[str],
        log_path: Path,
        *,
        policy: str = "cache_aware",
        more: list[str] | None = None,
        kv_sources: dict[str, str] | None = None,
        kv_block_size: int | None = None,
        kv_model: str | None = None,
    ) -> None:
        from server.fleet import find_router, router_command

        try:
            router = find_router()
        except SystemExit as exc:
            missing(str(exc))
        self.port = reserved_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = router_command(
            router,
            host="127.0.0.1",
            port=self.port,
            workers=workers,
            policy=policy,
            prometheus_port=reserved_port(),
            kv_sources=kv_sources,
            kv_block_size=kv_block_size,
            kv_model=kv_model,
            more=more or (),
        )
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, process_group=0
        )
