"""OpenAI's Responses API: its wire models (`wire`, and over a WebSocket `ws_wire`), each
response a chat generation read into a response object and its events (`service`), kept per
tenant (`store`), and its routes over HTTP (`routes`) and a WebSocket (`websocket`), the only
modules here that speak either, and its endpoints (`endpoints`: method, path, handler, OpenAPI
operation)."""
