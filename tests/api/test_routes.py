"""The joined endpoint table (server/api/routes.py): each API's endpoints are declared in its own
package, beside their handlers, and no method and path is declared twice."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
from starlette.routing import BaseRoute, Route, WebSocketRoute

from server.anthropic import endpoints as anthropic
from server.api.routes import ENDPOINTS, Parts, routes
from server.batch_api import endpoints as batch_api
from server.chat_api import endpoints as chat_api
from server.conversations_api import endpoints as conversations_api
from server.responses_api import endpoints as responses_api
from server.websocket_api import endpoints as websocket_api

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "table",
    (chat_api, anthropic, responses_api, conversations_api, batch_api, websocket_api),
    ids=lambda table: table.__name__,
)
def test_each_api_table_holds_its_own_packages_handlers(table: ModuleType) -> None:
    package = table.__name__.rsplit(".", 1)[0]
    assert table.ENDPOINTS
    assert all(e.handler.__module__.startswith(package + ".") for e in table.ENDPOINTS)
    assert set(table.ENDPOINTS) <= set(ENDPOINTS)


def test_no_method_and_path_is_declared_twice() -> None:
    declared = [(e.method, e.path) for e in ENDPOINTS]
    assert len(declared) == len(set(declared))


def _paths(made: list[BaseRoute]) -> list[str]:
    return [route.path for route in made if isinstance(route, Route | WebSocketRoute)]


def test_the_routes_of_the_parts_served_are_made_from_the_table() -> None:
    nothing: Any = object()  # (the handlers are bound, not called)
    every = Parts(
        adapters=nothing, responses=nothing, conversations=nothing, batches=nothing, metrics=True
    )
    assert _paths(routes(nothing, every)) == [e.path for e in ENDPOINTS]
    core = _paths(routes(nothing, Parts(adapters=nothing)))
    assert {"/v1/files", "/v1/batches", "/v1/conversations", "/metrics"}.isdisjoint(core)
    assert "/v1/chat/completions" in core
