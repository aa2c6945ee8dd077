"""The OpenAI Batch API: its wire models (`wire`), durable files and batches (`store`, and
SQLite's `sqlite_store`), run on spare capacity (`runner`). Its routes are the edge's
(`server.api.batch_api_routes`)."""
