"""Sluice's own WebSocket API (`/v1/ws`): many generations multiplexed over one socket, each
resumable and cancellable by its id (`routes`, its endpoint in `endpoints`; the protocol is in
docs/api/websocket.md)."""
