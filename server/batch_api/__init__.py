"""The OpenAI Batch API: durable files and batches (`store`), run on spare capacity (`runner`)."""
