"""`sluice serve`: the app its options assemble, the servers that serve it, and the process.

`ServeCommand` is what the command line said, typed (`server.cli` makes it from its parser's
result; nothing here reads an `argparse.Namespace`). `assemble` is the composition root: it
builds every adapter the app is handed (the engine and its dispatcher; with `state.url`, the
Redis state, the quotas replicas share and Redis's stores, the only place Redis is known;
SQLite's stores under `--data-dir`; the app's tracer with `--otlp-traces-endpoint`; and one
`Metrics` that all of them record into), then the app; `Serving` runs the result under uvicorn,
with /metrics on a port of its own when asked, until it is told to stop or the engine dies;
`serve` is the process around them: logging, the event loop, the collector frozen once start-up
is done, and uvicorn's signal handlers. The first two do nothing process-wide, so tests run
them in a thread of their own process (`tests/conftest.py`).

If the engine dies, /ready and new requests get 503 for `--engine-death-exit-seconds`, then the
process exits 3 so an orchestrator restarts it. On SIGTERM or SIGINT (Ctrl-C) it drains: /ready
and new generations get 503 at once, running generations finish (for up to `--drain-seconds`,
then end with a `shutting_down` error event), and the process exits 0. A second signal stops at
once, as uvicorn does (open streams are ended, the app shuts down), and the process still exits
0, with no traceback: it stopped as it was asked to. (A third SIGINT is uvicorn's forced exit:
no waiting for connections, no shutdown of the app, whose cancelled tasks uvicorn reports.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.config import LOGGING_CONFIG

from engine_adapters.protocol import EngineClient
from server.api.app import SharedStores, SluiceApp, Stores, build_app, metrics_app
from server.batch_api.sqlite_store import SqliteBatchStore
from server.batch_api.store import BatchStore
from server.conversations_api.store import ConversationStore, Limits, SqliteConversations
from server.core import last_exit
from server.core.config import ConfigError, SluiceConfig
from server.core.settings import ServeOptions, config_flags, load_config
from server.generations.service import Generations
from server.observability import redaction
from server.observability.access_log import install_handler
from server.observability.metrics import Metrics
from server.observability.tracing import build_tracing
from server.responses_api.store import SqliteResponses
from server.scheduler.types import Dispatcher
from server.state.adapters import RuntimeAdapters
from server.state.backend import RedisState
from server.state.batches import RedisBatchStore
from server.state.conversations import RedisConversations
from server.state.quotas import SharedQuotaDispatcher, SharedQuotas
from server.state.responses import RedisResponses
from server.state.runs import RedisRuns

if TYPE_CHECKING:
    from engine_adapters.sim import SimConfig
    from server.fixed_batch.cli import BatchShape

logger = logging.getLogger("sluice.server")
ENGINE_DIED_STATUS = 3
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartRefused(Exception):
    """The configuration or the data directory does not allow a start (exit status 2)."""


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """What `sluice serve` was told: its own flags, and those of the engine it runs (each
    group the model its flags are derived from, read once, frozen)."""

    options: ServeOptions
    sim: SimConfig | None = None  # the --sim-* flags, with --engine sim
    batch: BatchShape | None = None  # the batch engine's flags, with --engine sim-batch


@dataclass(frozen=True, slots=True)
class Assembled:
    """What `sluice serve`'s arguments build, not yet started."""

    options: ServeOptions
    app: SluiceApp
    scrape_app: Starlette | None  # /metrics alone, with --metrics-port
    engine_died: asyncio.Event


def assemble(command: ServeCommand, environ: Mapping[str, str] = os.environ) -> Assembled:
    """The app `sluice serve` runs as `command` says, its API keys and its OTLP protocol read
    from `environ`. StartRefused: the configuration is invalid or the data directory cannot be
    used."""
    options = command.options
    try:
        config = load_config(options.config, environ, config_flags(options))
    except ConfigError as exc:
        raise StartRefused(f"invalid configuration: {exc}") from None
    if options.engine != "vllm" and (
        options.tool_call_parser or options.enable_auto_tool_choice or options.reasoning_parser
    ):
        raise SystemExit(
            "--tool-call-parser, --enable-auto-tool-choice and --reasoning-parser "
            "read vLLM's output: they need --engine vllm"
        )
    if options.engine == "sim-batch" and (
        options.lora_modules or options.enable_lora or options.demo_lora
    ):
        raise SystemExit("the sim-batch engine serves no LoRA adapters")
    if options.engine == "sim" and options.demo_lora:
        raise SystemExit("--demo-lora is the demo model's adapter: it needs --engine vllm")
    metrics = Metrics()
    engine, dispatcher, name = _build_serving(command, config, metrics)
    state = None
    if config.state.url is not None:
        state = RedisState(config.state, metrics)
        dispatcher = SharedQuotaDispatcher(dispatcher, SharedQuotas(state, config.tenants))
    try:
        tracing = build_tracing(config.tracing.otlp_traces_endpoint, environ)
    except ValueError as exc:
        raise StartRefused(f"tracing: {exc}") from None
    stores = build_stores(
        engine, config, metrics, options.data_dir, state, adapter_loaded=dispatcher.adapter_loaded
    )
    engine_died = asyncio.Event()
    app = build_app(
        engine,
        dispatcher,
        config,
        name,
        metrics=metrics,
        stores=stores,
        options=options,
        on_engine_death=engine_died,
        tracing=tracing,
    )
    scrape_app = None if options.metrics_port is None else metrics_app(app.services)
    return Assembled(options, app, scrape_app, engine_died)


def build_stores(
    engine: EngineClient,
    config: SluiceConfig,
    metrics: Metrics,
    data_dir: Path | None = None,
    state: RedisState | None = None,
    *,
    adapter_loaded: Callable[[str], None] | None = None,
) -> Stores:
    """What the app keeps beyond a request: on the host, under `data_dir` (None: ended
    responses and conversations in memory, and no Batch API), and with `state` (`state.url`)
    in Redis, shared by replicas (conversations there alone); `adapter_loaded` is told of each
    LoRA adapter loaded at runtime. StartRefused: the data directory cannot be used."""
    kept = config.responses
    try:
        batches: BatchStore | None = None
        if state is not None:
            batches = RedisBatchStore(state)
        elif data_dir is not None:
            batches = SqliteBatchStore(data_dir)
        responses = SqliteResponses(data_dir, kept.retention_seconds, kept.max_bytes)
        limits = Limits(config.conversations.max_conversations, config.conversations.max_items)
        conversations: ConversationStore = (
            SqliteConversations(data_dir, limits)
            if state is None
            else RedisConversations(state, limits)
        )
    except (OSError, sqlite3.Error) as exc:
        raise StartRefused(f"the data directory {data_dir} cannot be used: {exc}") from None
    adapters = RuntimeAdapters(engine, state, adapter_loaded)
    if state is None:
        return Stores(responses, adapters, conversations, batches)
    shared = SharedStores(
        RedisRuns(
            state, config.idempotency.retention_seconds, config.resume.grace_seconds, metrics
        ),
        RedisResponses(state, kept.retention_seconds, kept.max_bytes),
        state.replica,
        state.stop,
    )
    return Stores(responses, adapters, conversations, batches, shared)


def _build_serving(
    command: ServeCommand, config: SluiceConfig, metrics: Metrics
) -> tuple[EngineClient, Dispatcher, str]:
    """(engine, dispatcher, served model name) for `--engine`."""
    if command.options.engine == "sim-batch":
        from server.fixed_batch.cli import BatchShape, build_serving

        shape = command.batch or BatchShape()
        return build_serving(shape, command.options.served_model_name, metrics)
    from server.scheduler.runtime import SchedulerRuntime

    engine, name = _build_engine(command)
    return engine, SchedulerRuntime(config, engine, name, metrics), name


def _build_engine(command: ServeCommand) -> tuple[EngineClient, str]:
    from engine_adapters.lora_modules import plan_adapters

    options = command.options
    modules = list(options.lora_modules)
    if options.demo_lora:
        if options.model is not None:
            raise StartRefused("--demo-lora is the demo model's adapter: it needs no --model")
        from engine_adapters.demo_model import (
            DEMO_ADAPTER_NAME,
            build_demo_adapter,
            build_demo_model,
        )

        demo = build_demo_model(options.cache_dir / "demo-model")
        path = build_demo_adapter(options.cache_dir / "demo-lora", demo)
        modules.append(f"{DEMO_ADAPTER_NAME}={path}")
    try:
        plan = plan_adapters(
            modules,
            enable_lora=options.enable_lora,
            max_loras=options.max_loras,
            max_cpu_loras=options.max_cpu_loras,
        )
    except ValueError as exc:
        raise StartRefused(str(exc)) from None
    if options.engine != "vllm" and options.kv_events_config is not None:
        raise StartRefused("--kv-events-config is vLLM's: the sim engines publish no KV events")
    if options.engine == "sim":
        from engine_adapters.sim import SimConfig, SimEngine

        name = options.served_model_name or "sim"
        if name in plan.adapters:
            raise StartRefused(f"LoRA module {name!r} has the served model's name")
        config = dataclasses.replace(command.sim or SimConfig(), max_loras=plan.slots)
        return SimEngine(config, model_name=name, adapters=plan.adapters), name
    from engine_adapters.vllm_adapter import VLLMEngine, parse_engine_args
    from engine_adapters.vllm_output import ParserOptions

    try:
        engine_args = parse_engine_args(options.engine_arg)
    except ValueError as exc:
        raise StartRefused(str(exc)) from None
    if options.kv_events_config is not None:
        try:
            engine_args["kv_events_config"] = json.loads(options.kv_events_config)
        except json.JSONDecodeError as exc:
            raise StartRefused(f"--kv-events-config is not JSON: {exc}") from None
    if options.demo_lora:
        engine_args.setdefault("dtype", "float32")
    if plan.room:
        # Every adapter in a slot of vLLM's own, and one slot more that none takes: vLLM 0.32's
        # CPU LoRA ops read a base-model token's slot index, -1, as the last slot, and so add
        # that slot's adapter to the base model's output (vllm-project/vllm#48421). Slots are
        # taken first free, so with one more than are ever loaded the last stays empty. How
        # many adapters one step runs (`plan.slots`) is the scheduler's to hold, chats first.
        engine_args.update(enable_lora=True, max_loras=plan.room + 1, max_cpu_loras=plan.room + 1)
        if options.max_lora_rank is not None:
            engine_args["max_lora_rank"] = options.max_lora_rank
    if options.model is None:
        from engine_adapters.demo_model import DEMO_MODEL_NAME, build_demo_model

        model = str(build_demo_model(options.cache_dir / "demo-model"))
        name = options.served_model_name or DEMO_MODEL_NAME
    else:
        model = options.model
        name = options.served_model_name or model
    parsers = ParserOptions(
        options.tool_call_parser, options.enable_auto_tool_choice, options.reasoning_parser
    )
    if name in plan.adapters:
        raise StartRefused(f"LoRA module {name!r} has the served model's name")
    engine = VLLMEngine(model, name, engine_args, parsers, plan.adapters, plan.room, plan.slots)
    return engine, name


class Serving:
    """The assembled app under uvicorn, and its /metrics app with --metrics-port, until
    `stop` or the engine's death.

    `log_config`: uvicorn's logging set-up, applied as each server is configured (the
    process's; None leaves logging as it is). `on_started`: called once the app's start-up
    (the lifespan) is done and the sockets listen.
    """

    def __init__(
        self,
        assembled: Assembled,
        *,
        log_config: dict[str, Any] | None = LOGGING_CONFIG,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        options = self.options = assembled.options
        self.engine_died = assembled.engine_died
        self.api = DrainingServer(
            assembled.app.services.generations,
            options.drain_seconds,
            uvicorn.Config(
                assembled.app,
                host=options.host,
                port=options.port,
                log_level=options.log_level,
                log_config=log_config,
                access_log=False,
                timeout_graceful_shutdown=10,
                ws_max_size=options.max_body_bytes,
            ),
            on_started=on_started,
        )
        metrics_port = options.metrics_port  # (the scrape app exists with one)
        self.scraper = (
            None
            if assembled.scrape_app is None or metrics_port is None
            else QuietServer(
                uvicorn.Config(
                    assembled.scrape_app,
                    host=options.metrics_host or options.host,
                    port=metrics_port,
                    log_level=options.log_level,
                    log_config=log_config,
                    access_log=False,
                    lifespan="off",
                )
            )
        )

    async def run(
        self,
        sockets: list[socket.socket] | None = None,
        metrics_sockets: list[socket.socket] | None = None,
    ) -> int:
        """Serve (on `sockets`, or --host/--port; /metrics on `metrics_sockets`, or
        --metrics-host/--metrics-port) until stopped. The exit status: 0 after a stop,
        3 after the engine died, 1 if it never started."""

        async def stop_on_engine_death() -> None:
            await self.engine_died.wait()
            # Keep answering (/ready 503, new requests 503) so balancers see it, then exit.
            await asyncio.sleep(self.options.engine_death_exit_seconds)
            self.api.should_exit = True

        if sockets is None and self.options.fd is not None:
            sockets = [inherited_listener(self.options.fd)]
        watcher = asyncio.create_task(stop_on_engine_death())
        scraping = None
        if self.scraper is not None:
            scraping = asyncio.create_task(self.scraper.serve(metrics_sockets))
        try:
            await self.api.serve(sockets)
        finally:
            watcher.cancel()
            if self.scraper is not None and scraping is not None:
                self.scraper.should_exit = True
                await scraping
        if self.engine_died.is_set():
            logger.error("exiting with status 3 because the engine died")
            return ENGINE_DIED_STATUS
        return 0 if self.api.started else 1

    def stop(self) -> None:
        """Stop as SIGINT does: close the listeners, let open connections finish (bounded by
        uvicorn's graceful shutdown), shut the app down. Call it from the servers' loop."""
        self.api.should_exit = True


def inherited_listener(fd: int) -> socket.socket:
    """The listening socket inherited as `fd` (`--fd`), its family read from it. uvicorn's own
    `fd` takes every descriptor for a Unix socket, and asyncio then leaves its TCP connections
    without TCP_NODELAY: a response written in two sends waited for the client's delayed ACK,
    40 ms a request."""
    return socket.socket(fileno=fd)


def serve(command: ServeCommand) -> int:
    """The `sluice serve` process; its exit status."""
    logging.basicConfig(
        level=command.options.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    install_handler()
    redaction.install()
    try:
        assembled = assemble(command)
    except StartRefused as exc:
        logger.error("%s", exc)
        return 2
    serving = Serving(assembled, on_started=_freeze_start_up)
    # Each uvicorn Config set its loggers up anew: filter their handlers now, after the last.
    redaction.install()
    if _has_uvloop():
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    status = asyncio.run(serving.run())
    last_exit.exit_after_handlers(status)
    return status


def _freeze_start_up() -> None:
    """What start-up built (vLLM, torch, transformers: ~600,000 objects) lives as long as the
    process; keep it out of the collector's full passes, each of which otherwise stalls the
    event loop (~350 ms here with vLLM imported)."""
    gc.collect()
    gc.freeze()


class QuietServer(uvicorn.Server):
    """A second server in the process (metrics): the signals are the API server's to handle."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM and SIGINT drain first (see the module's docstring): the
    listener stays open, answering 503 `shutting_down`, until the running generations are
    done. A second signal stops at once as uvicorn does (a third SIGINT forces it), but no
    signal is raised again once the server has stopped (uvicorn re-raises those it handled,
    which ends the process with SIGINT's KeyboardInterrupt traceback and status 130).
    (uvicorn handles signals only in the main thread.)"""

    def __init__(
        self,
        generations: Generations,
        drain_seconds: float,
        config: uvicorn.Config,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.generations = generations
        self.drain_seconds = drain_seconds
        self.on_started = on_started
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[Any] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig not in DRAIN_SIGNALS or self._loop is None:
            super().handle_exit(sig, frame)
            return
        name = signal.Signals(sig).name
        if not self.generations.draining:
            self.generations.draining = True  # /ready answers 503 from now on
            self._loop.call_soon_threadsafe(self._start_drain, name)
        elif self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            logger.warning("%s again: stopping now", name)
            self._loop.call_soon_threadsafe(self.generations.cut)  # streams end, not hang
            self.should_exit = True

    def _start_drain(self, signal_name: str) -> None:
        self._draining = asyncio.create_task(self._drain(signal_name))

    async def _drain(self, signal_name: str) -> None:
        logger.info(
            "%s: draining (up to %gs for %d running generation(s))",
            signal_name,
            self.drain_seconds,
            len(self.generations.live),
        )
        await self.generations.drain(self.drain_seconds)
        logger.info("drained; shutting down")
        self.should_exit = True


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """New event loops as `serve`'s: uvloop's where it is installed (and SLUICE_NO_UVLOOP is
    not set), for a server run in a thread of another process without touching its policy."""
    if _has_uvloop():
        import uvloop

        return uvloop.new_event_loop
    return asyncio.new_event_loop


def _has_uvloop() -> bool:
    return os.environ.get("SLUICE_NO_UVLOOP") is None and _importable("uvloop")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
