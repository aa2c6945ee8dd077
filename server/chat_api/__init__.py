"""OpenAI's Chat Completions and Completions APIs as vLLM's server serves them: their routes
(`routes`: `/v1/chat/completions`, `/v1/completions`, `/invocations`, vLLM's batch chat
endpoint, a resumable generation's stream), their stream chunks and whole bodies (`chunks`,
the wire a run's log is written in) and vLLM's tokenizer and render endpoints (`tokenizer`,
`render`), and the endpoints of all of them (`endpoints`: method, path, handler, OpenAPI
operation). Their request models are `server.openai_wire`'s, which every API shares."""
