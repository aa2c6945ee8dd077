"""What an endpoint is: its method, path, handler and OpenAPI operation, declared in its API's
package beside the handler (`server.<api>.endpoints.ENDPOINTS`, one table per API). The
composition root (`server.api.routes`) joins the tables: the app's Starlette routes and
`/openapi.json`'s paths are both read from them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeAlias, TypeVar

from starlette.requests import Request
from starlette.types import ASGIApp
from starlette.websockets import WebSocket

from server.http.operations import Operation
from server.http.services import Services

Method = Literal["GET", "POST", "DELETE", "WEBSOCKET"]
# Which of the app's parts serves it: "metrics", "responses", "conversations" and "batches"
# only where the app has them. The handlers of "adapters", "responses", "conversations" and
# "batches" are handed their part's own after the services.
Part = Literal["core", "metrics", "adapters", "responses", "conversations", "batches"]

D = TypeVar("D")  # what an API's handlers are handed after the services (its own services)

# An HTTP handler answers with a Response, or an ASGI app that answers later (a stream).
Handler: TypeAlias = Callable[[Services, Request], Awaitable[ASGIApp]]
SocketHandler: TypeAlias = Callable[[Services, WebSocket], Awaitable[None]]
HandedHandler: TypeAlias = Callable[[Services, D, Request], Awaitable[ASGIApp]]
HandedSocketHandler: TypeAlias = Callable[[Services, D, WebSocket], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[D]):
    """One endpoint. `D`: what its part hands its handler after the services (None: nothing)."""

    method: Method
    path: str
    handler: Handler | SocketHandler | HandedHandler[D] | HandedSocketHandler[D]
    operation: Callable[[], Operation] | None = None  # its builder (None: not in the API)
    part: Part = "core"
