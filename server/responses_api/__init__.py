"""OpenAI's Responses API: each response a chat generation read into a response object and
its events (`service`), kept per tenant (`store`)."""
