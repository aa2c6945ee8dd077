"""OpenAI's Responses API: its wire models (`wire`, and over a WebSocket `ws_wire`), each
response a chat generation read into a response object and its events (`service`), kept per
tenant (`store`). Its routes are the edge's (`server.api.responses_routes`, `responses_ws`)."""
