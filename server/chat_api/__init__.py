"""OpenAI's Chat Completions and Completions APIs as vLLM's server serves them: their routes
(`routes`: `/v1/chat/completions`, `/v1/completions`, `/invocations`, vLLM's batch chat
endpoint, a resumable generation's stream) and vLLM's tokenizer endpoints (`tokenizer`). Their
wire models are `server.openai_wire`'s, which every API shares."""
