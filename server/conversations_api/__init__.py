"""OpenAI's Conversations API: its wire models (`wire`; its items are the Responses API's
input items, `server.openai_wire.items`), conversations kept per tenant until deleted (`store`:
the port, and SQLite's; Redis's is `server.state.conversations`), made, read and changed, and
held by a response from its start to its end (`service`), its routes (`routes`, the only module
here that speaks HTTP), and its endpoints (`endpoints`: method, path, handler, OpenAPI
operation)."""
