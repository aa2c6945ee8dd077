"""The OpenAI Batch API: its wire models (`wire`), durable files and batches (`store`, and
SQLite's `sqlite_store`), run on spare capacity (`runner`), and its routes (`routes`, the only
module here that speaks HTTP)."""
