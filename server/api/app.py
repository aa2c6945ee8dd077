"""The Starlette application and its lifecycle: engine up, scheduler up, serve, shut down.

If the engine dies, /ready fails, new requests get 503, in-flight streams end with an error
event, and `on_engine_death` is set (the process then exits non-zero: `server.api.serving`).
The process itself (signals, the drain, logging) is `server.api.serving`'s, and so is what
the app is handed: the engine, the dispatcher, the stores (`Stores`: SQLite's, and with
`state.url` Redis's), the tracer and the metrics. The app wires routes to them and starts and
stops them; it knows no Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine_adapters.protocol import EngineClient, EngineDeadError
from server.api.access import AccessLogMiddleware
from server.api.routes import Parts, RuntimeLoras, ignorable_fields, prometheus_metrics, routes
from server.batch_api.routes import BatchServices
from server.batch_api.runner import BatchRunner
from server.batch_api.store import BatchStore
from server.chat_api.chunks import CHAT_WIRE
from server.conversations_api.service import Conversations
from server.conversations_api.store import ConversationStore
from server.core.config import SluiceConfig
from server.core.errors import (
    MethodNotAllowed,
    RouteNotFound,
    SluiceError,
)
from server.core.settings import ServeOptions
from server.generations.planner import Planner
from server.generations.ports import ResponseStore, SharedRuns
from server.generations.registry import RunStore
from server.generations.service import Generations
from server.http.edge import Edge
from server.http.replies import error_response
from server.http.send_guard import SendGuard
from server.http.services import Services
from server.observability.metrics import Metrics
from server.observability.tracing import Tracing
from server.responses_api.batch_lines import ResponseLines
from server.responses_api.service import Responses
from server.responses_api.store import SqliteResponses
from server.scheduler.types import Dispatcher, TrafficClass
from server.tenancy.tenants import TenantDirectory

logger = logging.getLogger("sluice.server")
HEALTH_POLL_SECONDS = 1.0


class SluiceApp(Starlette):
    """The Starlette app, with the services its routes were handed."""

    services: Services


class Started(Protocol):
    """A part the app's lifespan starts, and stops in reverse."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class SharedRunStore(SharedRuns, Started, Protocol):
    """Resumable generations shared by replicas (`server.state.runs`)."""


class SharedResponseStore(ResponseStore, Protocol):
    """Ended responses shared by replicas (`server.state.responses`)."""

    async def start(self) -> None: ...


class LoraAdapters(RuntimeLoras, Started, Protocol):
    """LoRA adapters loaded at runtime, on every replica with `state.url`
    (`server.state.adapters`)."""


@dataclass(frozen=True, slots=True)
class SharedStores:
    """With `state.url`: what replicas share, in Redis, built by `server.api.serving`."""

    runs: SharedRunStore
    responses: SharedResponseStore
    replica: str  # this replica's id: the owner of the batches it runs
    close: Callable[[], Awaitable[None]]  # the connections, once all that uses them stopped


@dataclass(frozen=True, slots=True)
class Stores:
    """What the app keeps beyond a request, built by the composition root
    (`server.api.serving.build_stores`); the app's lifespan starts and stops them."""

    responses: SqliteResponses  # ended responses on the host (with `shared`: while Redis is away)
    adapters: LoraAdapters
    conversations: ConversationStore  # SQLite's, or with `shared` Redis's
    batches: BatchStore | None = None  # the Batch API's (None: it is not served)
    shared: SharedStores | None = None


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


def build_app(
    engine: EngineClient,
    dispatcher: Dispatcher,
    config: SluiceConfig,
    served_model: str,
    *,
    metrics: Metrics,
    stores: Stores,
    options: ServeOptions | None = None,
    on_engine_death: asyncio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
    tracing: Tracing | None = None,
) -> SluiceApp:
    """`metrics`: the app's registry, which the dispatcher and the stores record into too.
    `stores`: what outlives a request (`build_stores`; with `stores.shared`, the dispatcher
    holds the quotas replicas share). `options`: the serve flags the app reads (bodies' and
    files' limits, the streams' pings, coalescing, interval and send timeout, and whether
    /metrics is its own, without --metrics-port); None: their defaults. `clock`: what the
    tenant directory and the run store read (in-process tests in virtual time pass the
    loop's, as they do to the dispatcher). `tracing`: the app's own tracer provider, with
    tracing on (None: no span is made); shut down (its last spans sent) when the app is."""
    options = options or ServeOptions()
    shared = stores.shared
    local_responses = stores.responses
    planner = Planner(
        engine,
        TenantDirectory(config, clock),
        dispatcher,
        served_model,
        options.stream_interval,
        wire=CHAT_WIRE,
    )
    generations = Generations(
        planner=planner,
        dispatcher=dispatcher,
        store=RunStore(config.idempotency.retention_seconds, config.idempotency.max_bytes, clock),
        metrics=metrics,
        shared=None if shared is None else shared.runs,
        grace_seconds=config.resume.grace_seconds,
        tracing=tracing,
    )
    services = Services(
        engine=engine,
        planner=planner,
        generations=generations,
        edge=Edge(
            SendGuard(options.send_timeout_seconds),
            options.sse_ping_seconds,
            options.max_body_bytes,
            options.stream_coalesce == "on",
        ),
        metrics=metrics,
        started=int(time.time()),
    )
    adapters = stores.adapters
    conversations = Conversations(
        stores.conversations, config.conversations.max_item_bytes, config.state.lease_s
    )
    responses = Responses(
        generations,
        local_responses if shared is None else shared.responses,
        None if shared is None else local_responses,
        conversations,
    )
    parts = Parts(
        adapters=adapters,
        batches=None
        if stores.batches is None
        else BatchServices(
            stores.batches,
            BatchRunner(
                generations,
                stores.batches,
                metrics,
                lease_s=config.state.lease_s,
                owner=None if shared is None else shared.replica,
                endpoints={"/v1/responses": ResponseLines(responses)},
            ),
            options.max_file_bytes,
        ),
        responses=responses,
        conversations=conversations,
        metrics=options.metrics_port is None,
    )
    services.served = parts.served()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        """Each part started, its stop pushed as it starts: the exit runs them in reverse, so
        a start that fails stops what had started before it, and a stop that fails still
        lets the others run."""
        services.ready = False
        tenants = planner.tenants
        metrics.initialise(served_model, tenants.metric_labels(), ignorable_fields())
        for label in (*tenants.metric_labels(), "other"):
            for asked in TrafficClass:
                metrics.class_downgrades.set_function(
                    (label, asked), partial(tenants.downgrades.__getitem__, (label, asked))
                )
        async with contextlib.AsyncExitStack() as stack:
            if tracing is not None:  # the last to stop: the spans of requests ended by the rest
                stack.push_async_callback(asyncio.to_thread, tracing.shutdown)
            await engine.start()
            stack.push_async_callback(engine.stop)
            stack.callback(local_responses.close)
            if shared is not None:
                stack.push_async_callback(shared.close)  # (opened by the parts that use it)
                await shared.responses.start()
            await conversations.start()  # (stopped once the responses' keepers are)
            stack.push_async_callback(conversations.stop)
            if parts.responses is not None:
                stack.push_async_callback(parts.responses.stop)
            await dispatcher.start()
            stack.push_async_callback(dispatcher.stop)
            if metrics.vllm is None:  # (once per app: a lifespan run again keeps its series)
                metrics.vllm_series(served_model, engine, dispatcher.queued)
            if shared is not None:
                await shared.runs.start()
                stack.push_async_callback(shared.runs.stop)
            await adapters.start()
            stack.push_async_callback(adapters.stop)
            if parts.batches is not None:
                stack.push_async_callback(parts.batches.store.close)
                await parts.batches.runner.start()
                stack.push_async_callback(parts.batches.runner.stop)
            for watch in (_watch_engine(services, on_engine_death), services.edge.send_guard.run()):
                stack.push_async_callback(_cancel, asyncio.create_task(watch))
            stack.callback(setattr, services, "ready", False)  # the first thing the exit does
            services.ready = True
            metrics.engine_healthy.labels(served_model).set(1)
            logger.info("Sluice ready: model %s", served_model)
            yield

    app = SluiceApp(
        routes=routes(services, parts),
        exception_handlers={HTTPException: http_error, SluiceError: sluice_error},
        middleware=[Middleware(AccessLogMiddleware, metrics=metrics)],
        lifespan=lifespan,
    )
    app.services = services
    return app


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


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
