"""What every API's routes share: the edge (who is asking, deadlines, a client gone), Sluice's
own SSE responder and the guard on slow readers, JSON replies and errors, the reader of a
generation run, a WebSocket session, the services the routes are handed, and what an endpoint
is (`endpoints`: its method, path, typed handler and OpenAPI operation, made of
`operations`). The APIs' packages build on it; the composition root (`server.api`) builds it."""
