"""The Starlette application and its lifecycle: engine up, scheduler up, serve, shut down.

If the engine dies, /ready fails, new requests get 503, in-flight streams end with an error
event, and the process exits non-zero so an orchestrator restarts it. On SIGTERM it drains:
/ready and new generations get 503 at once, running generations finish (for up to
`--drain-seconds`, then end with a `shutting_down` error event), and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute

from engine_adapters.protocol import EngineClient, EngineDeadError
from server import batch_routes, metrics, redaction
from server.access_log import install_handler
from server.batch_api.runner import BatchRunner
from server.batch_api.store import BatchStore, DataDirInUse
from server.config import ConfigError, SluiceConfig, load_config, with_state_url
from server.errors import (
    EngineUnavailable,
    MethodNotAllowed,
    RouteNotFound,
    ShuttingDown,
    SluiceError,
)
from server.generation import RequestContext, Sluice
from server.generations.store import RunStore
from server.openai_routes import (
    JSONResponse,
    chat_completions,
    chat_completions_batch,
    completions,
    error_response,
    invocations,
    resume_chat_completion,
    resume_completion,
)
from server.openapi import openapi_json
from server.scheduler.tenants import TenantDirectory
from server.scheduler.types import Dispatcher
from server.send_guard import SendGuard
from server.state.backend import RedisState
from server.state.quotas import SharedQuotaDispatcher, SharedQuotas
from server.state.runs import SharedRuns
from server.tokenizer_routes import detokenize, tokenize, version
from server.ws_routes import websocket_endpoint

BATCH_ROUTES = [
    Route("/v1/files", batch_routes.create_file, methods=["POST"]),
    Route("/v1/files", batch_routes.list_files),
    Route("/v1/files/{id}", batch_routes.get_file),
    Route("/v1/files/{id}", batch_routes.delete_file, methods=["DELETE"]),
    Route("/v1/files/{id}/content", batch_routes.file_content),
    Route("/v1/batches", batch_routes.create_batch, methods=["POST"]),
    Route("/v1/batches", batch_routes.list_batches),
    Route("/v1/batches/{id}", batch_routes.get_batch),
    Route("/v1/batches/{id}/cancel", batch_routes.cancel_batch, methods=["POST"]),
]

logger = logging.getLogger("sluice.server")
STATIC = Path(__file__).parent / "static"
HEALTH_POLL_SECONDS = 1.0


async def health(request: Request) -> Response:
    return JSONResponse({"status": "alive"})


async def ready(request: Request) -> Response:
    sluice: Sluice = request.app.state.sluice
    if sluice.draining:
        return error_response(ShuttingDown("the server is shutting down", retry_after=1))
    if request.app.state.ready and sluice.engine.is_healthy:
        return JSONResponse({"status": "ready", "model": sluice.served_model})
    return error_response(EngineUnavailable("the engine is not ready", retry_after=5))


async def models(request: Request) -> Response:
    sluice: Sluice = request.app.state.sluice
    sluice.tenant_of(RequestContext.of(request))
    info = sluice.engine.model
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": sluice.served_model,
                    "object": "model",
                    "created": request.app.state.started,
                    "owned_by": "sluice",
                    "root": str(info.extra.get("path", sluice.served_model)),
                    "max_model_len": info.max_model_len,
                }
            ],
        }
    )


async def prometheus_metrics(request: Request) -> Response:
    sluice: Sluice | None = getattr(request.app.state, "sluice", None)
    if sluice is not None:
        metrics.ENGINE_UNFINISHED_REQUESTS.labels(sluice.served_model).set(
            sluice.engine.num_unfinished_requests()
        )
    return Response(generate_latest(metrics.REGISTRY), media_type=CONTENT_TYPE_LATEST)


async def chat_page(request: Request) -> Response:
    page = STATIC / "index.html"
    if not page.is_file():
        return PlainTextResponse("Sluice is running. The chat page is not installed.")
    return FileResponse(page, media_type="text/html")


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error: SluiceError
    if exc.status_code == 404:
        error = RouteNotFound(f"no route for {request.method} {request.url.path}")
    elif exc.status_code == 405:
        error = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
    else:
        error = SluiceError(str(exc.detail))
        error.status = exc.status_code  # type: ignore[misc]
    return error_response(error)


async def sluice_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, SluiceError)
    return error_response(exc)


def metrics_app() -> Starlette:
    """`/metrics` alone, for `--metrics-port`: scraped on a port the API's clients never see."""
    return Starlette(
        routes=[Route("/metrics", prometheus_metrics)],
        exception_handlers={HTTPException: http_error},
    )


def build_app(
    engine: EngineClient,
    dispatcher: Dispatcher,
    config: SluiceConfig,
    served_model: str,
    *,
    ping_seconds: float = 15.0,
    send_timeout_seconds: float = 30.0,
    max_body_bytes: int = 1 << 20,
    on_engine_death: asyncio.Event | None = None,
    metrics_route: bool = True,
    batch_store: BatchStore | None = None,
    max_file_bytes: int = 100 << 20,
    state: RedisState | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Starlette:
    """`state`: Redis, for quotas (the dispatcher's) and resumable generations shared by
    replicas. `clock`: what the tenant directory and the run store read (in-process tests in
    virtual time pass the loop's, as they do to the dispatcher)."""
    shared = (
        None
        if state is None
        else SharedRuns(state, config.resume.retention_s, config.resume.grace_s)
    )
    sluice = Sluice(
        engine=engine,
        dispatcher=dispatcher,
        tenants=TenantDirectory(config, clock),
        served_model=served_model,
        send_guard=SendGuard(send_timeout_seconds),
        store=RunStore(config.resume.retention_s, config.resume.max_bytes, clock),
        shared=shared,
        ping_seconds=ping_seconds,
        max_body_bytes=max_body_bytes,
        grace_seconds=config.resume.grace_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        app.state.ready = False
        metrics.initialise(served_model, sluice.tenants.metric_labels())
        await engine.start()
        if shared is not None:
            await shared.start()
        await dispatcher.start()
        runner = None
        if batch_store is not None:
            runner = app.state.batch_runner = BatchRunner(sluice, batch_store)
            runner.start()
        # What start-up built (vLLM, torch, transformers: ~600,000 objects) lives as long as
        # the server; keep it out of the collector's full passes, each of which otherwise
        # stalls the event loop (~350 ms here with vLLM imported).
        gc.collect()
        gc.freeze()
        app.state.ready = True
        metrics.ENGINE_HEALTHY.labels(served_model).set(1)
        watchdog = asyncio.create_task(_watch_engine(app, on_engine_death))
        send_watchdog = asyncio.create_task(sluice.send_guard.run())
        logger.info("Sluice ready: model %s", served_model)
        try:
            yield
        finally:
            app.state.ready = False
            for task in (watchdog, send_watchdog):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if runner is not None:
                await runner.stop()
                batch_store.close()  # type: ignore[union-attr]
            if shared is not None:
                await shared.stop()
            await dispatcher.stop()
            if state is not None:
                await state.stop()
            await engine.stop()

    app = Starlette(
        routes=[
            Route("/", chat_page),
            Route("/health", health),
            Route("/ready", ready),
            *([Route("/metrics", prometheus_metrics)] if metrics_route else []),
            Route("/v1/models", models),
            Route("/version", version),
            Route("/openapi.json", openapi_json),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/invocations", invocations, methods=["POST"]),
            Route("/v1/chat/completions/batch", chat_completions_batch, methods=["POST"]),
            Route("/v1/chat/completions/{id}/stream", resume_chat_completion),
            Route("/v1/completions/{id}/stream", resume_completion),
            WebSocketRoute("/v1/ws", websocket_endpoint),
            *(BATCH_ROUTES if batch_store is not None else []),
        ],
        exception_handlers={HTTPException: http_error, SluiceError: sluice_error},
        lifespan=lifespan,
    )
    app.state.sluice = sluice
    app.state.batch_store = batch_store
    app.state.max_file_bytes = max_file_bytes
    app.state.ready = False
    app.state.started = int(time.time())
    return app


async def _watch_engine(app: Starlette, on_death: asyncio.Event | None) -> None:
    sluice: Sluice = app.state.sluice
    while True:
        await asyncio.sleep(HEALTH_POLL_SECONDS)
        try:
            await sluice.engine.check_health()
        except EngineDeadError as exc:
            logger.error("engine died: %s; refusing new requests and shutting down", exc)
            app.state.ready = False
            metrics.ENGINE_HEALTHY.labels(sluice.served_model).set(0)
            if on_death is not None:
                on_death.set()
            return


def _build_engine(args: argparse.Namespace) -> tuple[EngineClient, str]:
    if args.engine == "sim":
        from engine_adapters.sim import SimConfig, SimEngine

        name = args.served_model_name or "sim"
        return SimEngine(SimConfig.from_args(args), model_name=name), name
    from engine_adapters.vllm_adapter import VLLMEngine, parse_engine_args
    from engine_adapters.vllm_output import ParserOptions

    engine_args = parse_engine_args(args.engine_arg)
    if args.model is None:
        from engine_adapters.demo_model import DEMO_MODEL_NAME, build_demo_model

        model = str(build_demo_model(args.cache_dir / "demo-model"))
        name = args.served_model_name or DEMO_MODEL_NAME
    else:
        model = args.model
        name = args.served_model_name or model
    parsers = ParserOptions(
        args.tool_call_parser, args.enable_auto_tool_choice, args.reasoning_parser
    )
    return VLLMEngine(model, name, engine_args, parsers), name


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    install_handler()
    redaction.install()
    try:
        config = load_config(args.config)
        if args.state_url is not None:
            config = with_state_url(config, args.state_url)
    except ConfigError as exc:
        logger.error("invalid configuration: %s", exc)
        return 2
    if args.engine != "vllm" and (
        args.tool_call_parser or args.enable_auto_tool_choice or args.reasoning_parser
    ):
        raise SystemExit(
            "--tool-call-parser, --enable-auto-tool-choice and --reasoning-parser "
            "read vLLM's output: they need --engine vllm"
        )
    engine: EngineClient
    dispatcher: Dispatcher
    if args.engine == "sim-batch":
        from server.batching.cli import build_serving

        engine, dispatcher, name = build_serving(args, config)
    else:
        engine, name = _build_engine(args)
        from server.scheduler.runtime import SchedulerRuntime

        dispatcher = SchedulerRuntime(config, engine, name)
    state = None
    if config.state.url is not None:
        state = RedisState(config.state)
        dispatcher = SharedQuotaDispatcher(dispatcher, SharedQuotas(state, config.tenants))
    if _has_uvloop():
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return asyncio.run(_serve(args, engine, dispatcher, config, name, state))


async def _serve(
    args: argparse.Namespace,
    engine: EngineClient,
    dispatcher: Dispatcher,
    config: SluiceConfig,
    name: str,
    state: RedisState | None = None,
) -> int:
    engine_died = asyncio.Event()
    try:
        batch_store = BatchStore(args.data_dir)
    except DataDirInUse as exc:
        logger.error("%s", exc)
        return 2
    app = build_app(
        engine,
        dispatcher,
        config,
        name,
        ping_seconds=args.sse_ping_seconds,
        send_timeout_seconds=args.send_timeout_seconds,
        max_body_bytes=args.max_body_bytes,
        on_engine_death=engine_died,
        metrics_route=args.metrics_port is None,
        batch_store=batch_store,
        max_file_bytes=args.max_file_bytes,
        state=state,
    )
    server = DrainingServer(
        app.state.sluice,
        args.drain_seconds,
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            fd=args.fd,
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=10,
            ws_max_size=args.max_body_bytes,
        ),
    )

    async def stop_on_engine_death() -> None:
        await engine_died.wait()
        # Keep answering (/ready 503, new requests 503) so balancers see it, then exit.
        await asyncio.sleep(args.engine_death_exit_seconds)
        server.should_exit = True

    scraper = None
    if args.metrics_port is not None:
        metrics_app_instance = metrics_app()
        metrics_app_instance.state.sluice = app.state.sluice
        scraper = QuietServer(
            uvicorn.Config(
                metrics_app_instance,
                host=args.metrics_host or args.host,
                port=args.metrics_port,
                log_level=args.log_level,
                access_log=False,
                lifespan="off",
            )
        )
    # Each uvicorn Config set its loggers up anew: filter their handlers now, after the last.
    redaction.install()
    watcher = asyncio.create_task(stop_on_engine_death())
    if scraper is not None:
        scraping = asyncio.create_task(scraper.serve())
    try:
        await server.serve()
    finally:
        watcher.cancel()
        if scraper is not None:
            scraper.should_exit = True
            await scraping
    if engine_died.is_set():
        logger.error("exiting with status 3 because the engine died")
        return 3
    return 0 if server.started else 1


class QuietServer(uvicorn.Server):
    """A second server in the process (metrics): the signals are the API server's to handle."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM drains first (see the module's docstring): the listener
    stays open, answering 503 `shutting_down`, until the running generations are done. A
    second SIGTERM, or SIGINT, stops at once as uvicorn does."""

    def __init__(self, sluice: Sluice, drain_seconds: float, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.sluice = sluice
        self.drain_seconds = drain_seconds
        self._draining: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[Any] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.sluice.draining or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self.sluice.draining = True  # /ready answers 503 from now on
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._draining = asyncio.create_task(self._drain())

    async def _drain(self) -> None:
        logger.info(
            "SIGTERM: draining (up to %gs for %d running generation(s))",
            self.drain_seconds,
            len(self.sluice.live),
        )
        await self.sluice.drain(self.drain_seconds)
        logger.info("drained; shutting down")
        self.should_exit = True


def _has_uvloop() -> bool:
    return os.environ.get("SLUICE_NO_UVLOOP") is None and _importable("uvloop")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
