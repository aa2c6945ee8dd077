"""The engine's floor: a bare uvicorn ASGI app over vLLM's `AsyncLLM`, for `bench/api_cpu.py`.

It serves streamed chat completions and does only what any server on vLLM's `AsyncLLM` must do
in its API process: read and parse the JSON body, render the chat template and tokenize it,
hand the prompt to `AsyncLLM.generate` (whose output processing, detokenizing and IPC with the
engine core run in this process), and write one OpenAI chunk per output, then the usage chunk
and `[DONE]`. No validation, no scheduling, no metrics, no logging, no framework: what the API
process costs per request or per token here is what vLLM's engine client costs, plus the
HTTP parser's floor. Sluice and vLLM's server are read against it.

    python bench/engine_floor.py --model PATH --port 8305 [--engine-arg max_num_seqs=128 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import uuid
from typing import Any

import uvicorn


def build(model: str, served: str, engine_args: dict[str, Any]) -> Any:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    state: dict[str, Any] = {}

    async def lifespan(receive: Any, send: Any) -> None:
        message = await receive()
        args = AsyncEngineArgs(
            model=model, served_model_name=[served], disable_log_stats=True, **engine_args
        )
        state["llm"] = llm = AsyncLLM.from_engine_args(args)
        state["tokenizer"] = llm.get_tokenizer()
        await send({"type": "lifespan.startup.complete"})
        message = await receive()
        if message["type"] == "lifespan.shutdown":
            llm.shutdown()
            await send({"type": "lifespan.shutdown.complete"})

    async def reply(send: Any, status: int, body: bytes, kind: bytes) -> None:
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}
        )
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["path"] != "/v1/chat/completions":
            return await reply(send, 200, b"{}", b"application/json")  # /health
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        request = json.loads(body)
        tokenizer = state["tokenizer"]
        text = tokenizer.apply_chat_template(
            request["messages"], tokenize=False, add_generation_prompt=True
        )
        prompt = {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        params = SamplingParams(  # each output the new tokens alone, as vLLM's server streams
            max_tokens=request["max_tokens"],
            ignore_eos=request.get("ignore_eos", False),
            output_kind=RequestOutputKind.DELTA,
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk", "model": served}
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )

        async def event(payload: dict[str, Any]) -> None:
            data = (
                b"data: "
                + json.dumps({**head, **payload}, separators=(",", ":")).encode()
                + b"\n\n"
            )
            await send({"type": "http.response.body", "body": data, "more_body": True})

        await event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        tokens = 0
        async for out in state["llm"].generate(prompt, params, rid):
            for completion in out.outputs:
                tokens += len(completion.token_ids)
                choice = {"index": 0, "delta": {"content": completion.text}}
                await event({"choices": [{**choice, "finish_reason": completion.finish_reason}]})
        usage = {"prompt_tokens": len(prompt["prompt_token_ids"]), "completion_tokens": tokens}
        await event({"choices": [], "usage": usage})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", default="sluice-demo")
    parser.add_argument("--port", type=int, default=8305)
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    engine_args = {
        key: int(value) if value.lstrip("-").isdigit() else value
        for key, value in (item.split("=", 1) for item in args.engine_arg)
    }
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    app = build(args.model, args.served_model_name, engine_args)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
