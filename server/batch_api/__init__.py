"""The OpenAI Batch API: its wire models (`wire`), durable files and batches (`store`, and
SQLite's `sqlite_store`), run on spare capacity (`runner`), its routes (`routes`, the only
module here that speaks HTTP), and its endpoints (`endpoints`: method, path, handler, OpenAPI
operation)."""
