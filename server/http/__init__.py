"""What every API's routes share: the edge (who is asking, deadlines, a client gone), Sluice's
own SSE responder and the guard on slow readers, JSON replies and errors, the reader of a
generation run, a WebSocket session, and the services the routes are handed. The APIs'
packages build on it; the composition root (`server.api`) builds it."""
