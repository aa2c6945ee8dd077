"""Sluice's own WebSocket API's endpoint (`/v1/ws`): not in the OpenAPI document, which
describes HTTP."""

from __future__ import annotations

from server.http.endpoints import Endpoint
from server.websocket_api.routes import websocket_endpoint

ENDPOINTS: tuple[Endpoint[None], ...] = (Endpoint("WEBSOCKET", "/v1/ws", websocket_endpoint),)
