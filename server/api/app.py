"""The Starlette application and its lifecycle: engine up, scheduler up, serve, shut down.

If the engine dies, /ready fails, new requests get 503, in-flight streams end with an error
event, and `on_engine_death` is set (the process then exits non-zero: `server.api.serving`).
The process itself (signals, the drain, logging) is `server.api.serving`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from engine_adapters.protocol import EngineClient, EngineDeadError
from server.api import anthropic_routes, batch_api_routes, responses_routes
from server.api.access import AccessLogMiddleware
from server.api.edge import Edge, context_of
from server.api.openai_routes import (
    JSONResponse,
    chat_completions,
    chat_completions_batch,
    completions,
    error_response,
    invocations,
    resume_chat_completion,
    resume_completion,
)
from server.api.openapi import openapi_json
from server.api.responses_ws import responses_websocket
from server.api.send_guard import SendGuard
from server.api.services import BatchServices, Services
from server.api.tokenizer_routes import detokenize, tokenize, version
from server.api.ws_routes import websocket_endpoint
from server.batch_api.runner import BatchRunner
from server.batch_api.store import BatchStore
from server.core.config import SluiceConfig
from server.core.errors import (
    EngineUnavailable,
    MethodNotAllowed,
    RouteNotFound,
    ShuttingDown,
    SluiceError,
)
from server.generations.planner import Planner
from server.generations.registry import RunStore
from server.generations.service import Generations
from server.observability.metrics import Metrics
from server.responses_api.service import Responses
from server.responses_api.store import SqliteResponses
from server.scheduler.types import Dispatcher, TrafficClass
from server.state.backend import RedisState
from server.state.responses import RedisResponses
from server.state.runs import RedisRuns
from server.tenancy.tenants import TenantDirectory

logger = logging.getLogger("sluice.server")
STATIC = Path(__file__).parent / "static"
HEALTH_POLL_SECONDS = 1.0


class SluiceApp(Starlette):
    """The Starlette app, with the services its routes were handed."""

    services: Services


async def health(request: Request) -> Response:
    return JSONResponse({"status": "alive"})


async def ready(services: Services, request: Request) -> Response:
    if services.generations.draining:
        return error_response(ShuttingDown("the server is shutting down", retry_after=1))
    if services.ready and services.engine.is_healthy:
        return JSONResponse({"status": "ready", "model": services.served_model})
    return error_response(EngineUnavailable("the engine is not ready", retry_after=5))


async def models(services: Services, request: Request) -> Response:
    services.planner.tenant_of(context_of(request))
    info = services.engine.model
    return JSONResponse(
        {
            "object": "list",
            "data": [
                {
                    "id": services.served_model,
                    "object": "model",
                    "created": services.started,
                    "owned_by": "sluice",
                    "root": info.path,
                    "max_model_len": info.max_model_len,
                }
            ],
        }
    )


async def prometheus_metrics(services: Services, request: Request) -> Response:
    """The app's own registry (one per app: `Metrics`)."""
    services.metrics.engine_unfinished_requests.labels(services.served_model).set(
        services.engine.num_unfinished_requests()
    )
    return Response(services.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


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


def metrics_app(services: Services) -> Starlette:
    """`/metrics` of one app's `services` alone, for `--metrics-port`: scraped on a port the
    API's clients never see."""
    return Starlette(
        routes=[Route("/metrics", partial(prometheus_metrics, services))],
        exception_handlers={HTTPException: http_error},
    )


def routes(services: Services, *, metrics_route: bool = True) -> list[BaseRoute]:
    """Every route, each handed `services`."""

    def post(path: str, endpoint: Callable[..., Any]) -> Route:
        return Route(path, partial(endpoint, services), methods=["POST"])

    def get(path: str, endpoint: Callable[..., Any]) -> Route:
        return Route(path, partial(endpoint, services))

    batches = batch_api_routes
    return [
        Route("/", chat_page),
        Route("/health", health),
        get("/ready", ready),
        *([get("/metrics", prometheus_metrics)] if metrics_route else []),
        get("/v1/models", models),
        Route("/version", version),
        Route("/openapi.json", openapi_json),
        post("/tokenize", tokenize),
        post("/detokenize", detokenize),
        post("/v1/chat/completions", chat_completions),
        post("/v1/completions", completions),
        post("/invocations", invocations),
        post("/v1/chat/completions/batch", chat_completions_batch),
        post("/v1/messages", anthropic_routes.messages),
        post("/v1/messages/count_tokens", anthropic_routes.count_tokens),
        get("/v1/chat/completions/{id}/stream", resume_chat_completion),
        get("/v1/completions/{id}/stream", resume_completion),
        *(
            []
            if services.responses is None
            else [
                post("/v1/responses", responses_routes.create_response),
                get("/v1/responses/{id}", responses_routes.get_response),
                post("/v1/responses/{id}/cancel", responses_routes.cancel_response),
                WebSocketRoute("/v1/responses", partial(responses_websocket, services)),
            ]
        ),
        WebSocketRoute("/v1/ws", partial(websocket_endpoint, services)),
        *(
            []
            if services.batches is None
            else [
                post("/v1/files", batches.create_file),
                get("/v1/files", batches.list_files),
                get("/v1/files/{id}", batches.get_file),
                Route("/v1/files/{id}", partial(batches.delete_file, services), methods=["DELETE"]),
                get("/v1/files/{id}/content", batches.file_content),
                post("/v1/batches", batches.create_batch),
                get("/v1/batches", batches.list_batches),
                get("/v1/batches/{id}", batches.get_batch),
                post("/v1/batches/{id}/cancel", batches.cancel_batch),
            ]
        ),
    ]


def build_app(
    engine: EngineClient,
    dispatcher: Dispatcher,
    config: SluiceConfig,
    served_model: str,
    *,
    metrics: Metrics,
    ping_seconds: float = 15.0,
    coalesce: bool = True,
    stream_interval: int = 1,
    send_timeout_seconds: float = 30.0,
    max_body_bytes: int = 1 << 20,
    on_engine_death: asyncio.Event | None = None,
    metrics_route: bool = True,
    batch_store: BatchStore | None = None,
    max_file_bytes: int = 100 << 20,
    state: RedisState | None = None,
    responses_dir: Path | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SluiceApp:
    """`metrics`: the app's registry, which the dispatcher and `state` record into too.
    `state`: Redis, for quotas (the dispatcher's), and resumable generations and stored
    responses shared by replicas. `responses_dir`: where ended responses are kept (SQLite;
    None: in memory), or, with `state`, kept while Redis does not answer. `clock`: what the
    tenant directory and the run store read (in-process tests in virtual time pass the
    loop's, as they do to the dispatcher)."""
    shared = (
        None
        if state is None
        else RedisRuns(
            state, config.idempotency.retention_seconds, config.resume.grace_seconds, metrics
        )
    )
    kept = config.responses
    local_responses = SqliteResponses(responses_dir, kept.retention_seconds, kept.max_bytes)
    shared_responses = (
        None if state is None else RedisResponses(state, kept.retention_seconds, kept.max_bytes)
    )
    planner = Planner(
        engine, TenantDirectory(config, clock), dispatcher, served_model, stream_interval
    )
    generations = Generations(
        planner=planner,
        dispatcher=dispatcher,
        store=RunStore(config.idempotency.retention_seconds, config.idempotency.max_bytes, clock),
        metrics=metrics,
        shared=shared,
        grace_seconds=config.resume.grace_seconds,
    )
    services = Services(
        engine=engine,
        planner=planner,
        generations=generations,
        edge=Edge(SendGuard(send_timeout_seconds), ping_seconds, max_body_bytes, coalesce),
        metrics=metrics,
        started=int(time.time()),
        batches=None
        if batch_store is None
        else BatchServices(
            batch_store,
            BatchRunner(
                generations,
                batch_store,
                metrics,
                lease_s=config.state.lease_s,
                owner=None if state is None else state.replica,
            ),
            max_file_bytes,
        ),
        responses=Responses(
            generations,
            local_responses if shared_responses is None else shared_responses,
            None if shared_responses is None else local_responses,
        ),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        services.ready = False
        tenants = planner.tenants
        metrics.initialise(served_model, tenants.metric_labels())
        for label in (*tenants.metric_labels(), "other"):
            for asked in TrafficClass:
                metrics.class_downgrades.set_function(
                    (label, asked), partial(tenants.downgrades.__getitem__, (label, asked))
                )
        await engine.start()
        if shared is not None:
            await shared.start()
        if shared_responses is not None:
            await shared_responses.start()
        await dispatcher.start()
        if services.batches is not None:
            await services.batches.runner.start()
        services.ready = True
        metrics.engine_healthy.labels(served_model).set(1)
        watchdog = asyncio.create_task(_watch_engine(services, on_engine_death))
        send_watchdog = asyncio.create_task(services.edge.send_guard.run())
        logger.info("Sluice ready: model %s", served_model)
        try:
            yield
        finally:
            services.ready = False
            for task in (watchdog, send_watchdog):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if services.batches is not None:
                await services.batches.runner.stop()
                await services.batches.store.close()
            if shared is not None:
                await shared.stop()
            await dispatcher.stop()
            if services.responses is not None:
                await services.responses.stop()
            if state is not None:
                await state.stop()
            local_responses.close()
            await engine.stop()

    app = SluiceApp(
        routes=routes(services, metrics_route=metrics_route),
        exception_handlers={HTTPException: http_error, SluiceError: sluice_error},
        middleware=[Middleware(AccessLogMiddleware, metrics=metrics)],
        lifespan=lifespan,
    )
    app.services = services
    return app


async def _watch_engine(services: Services, on_death: asyncio.Event | None) -> None:
    while True:
        await asyncio.sleep(HEALTH_POLL_SECONDS)
        try:
            await services.engine.check_health()
        except EngineDeadError as exc:
            logger.error("engine died: %s; refusing new requests and shutting down", exc)
            services.ready = False
            services.metrics.engine_healthy.labels(services.served_model).set(0)
            if on_death is not None:
                on_death.set()
            return
