"""The Starlette application and its lifecycle: engine up, scheduler up, serve, shut down.

If the engine dies, /ready fails, new requests get 503, in-flight streams end with an error
event, and `on_engine_death` is set (the process then exits non-zero: `server.serving`).
The process itself (signals, the drain, logging) is `server.serving`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute

from engine_adapters.protocol import EngineClient, EngineDeadError
from server import batch_routes
from server.batch_api.runner import BatchRunner
from server.batch_api.store import BatchStore
from server.core.config import SluiceConfig
from server.errors import (
    EngineUnavailable,
    MethodNotAllowed,
    RouteNotFound,
    ShuttingDown,
    SluiceError,
)
from server.generation import RequestContext, Sluice
from server.generations.store import RunStore
from server.metrics import Metrics
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
from server.state.runs import RedisRuns
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
                    "root": info.path,
                    "max_model_len": info.max_model_len,
                }
            ],
        }
    )


async def prometheus_metrics(request: Request) -> Response:
    """The app's own registry (one per app: `Metrics`)."""
    metrics: Metrics = request.app.state.metrics
    sluice: Sluice = request.app.state.sluice
    metrics.engine_unfinished_requests.labels(sluice.served_model).set(
        sluice.engine.num_unfinished_requests()
    )
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


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


def metrics_app(api: Starlette) -> Starlette:
    """`/metrics` of the app `api` alone, for `--metrics-port`: scraped on a port the API's
    clients never see."""
    app = Starlette(
        routes=[Route("/metrics", prometheus_metrics)],
        exception_handlers={HTTPException: http_error},
    )
    app.state.metrics = api.state.metrics
    app.state.sluice = api.state.sluice
    return app


def build_app(
    engine: EngineClient,
    dispatcher: Dispatcher,
    config: SluiceConfig,
    served_model: str,
    *,
    metrics: Metrics,
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
    """`metrics`: the app's registry, which the dispatcher and `state` record into too.
    `state`: Redis, for quotas (the dispatcher's) and resumable generations shared by
    replicas. `clock`: what the tenant directory and the run store read (in-process tests in
    virtual time pass the loop's, as they do to the dispatcher)."""
    shared = (
        None
        if state is None
        else RedisRuns(
            state, config.idempotency.retention_seconds, config.resume.grace_seconds, metrics
        )
    )
    sluice = Sluice(
        engine=engine,
        dispatcher=dispatcher,
        tenants=TenantDirectory(config, clock),
        served_model=served_model,
        send_guard=SendGuard(send_timeout_seconds),
        store=RunStore(config.idempotency.retention_seconds, config.idempotency.max_bytes, clock),
        metrics=metrics,
        shared=shared,
        ping_seconds=ping_seconds,
        max_body_bytes=max_body_bytes,
        grace_seconds=config.resume.grace_seconds,
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
            runner = app.state.batch_runner = BatchRunner(sluice, batch_store, metrics)
            runner.start()
        app.state.ready = True
        metrics.engine_healthy.labels(served_model).set(1)
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
    app.state.metrics = metrics
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
            metrics: Metrics = app.state.metrics
            metrics.engine_healthy.labels(sluice.served_model).set(0)
            if on_death is not None:
                on_death.set()
            return
