"""The cost of parsing and validating one request body, in microseconds (timeit, median).

    python bench/request_parse.py [--repeat 31] [--number 2000]

Three bodies: a typical chat, a typical completion, and a large chat (200 messages, a
logit_bias of 300 tokens, stop strings and token lists). Runs against whichever request
parser this checkout has (`server.openai_wire.requests`; before #58 `server.openai.requests`;
before that `server.openai_requests`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    from server.openai_wire.requests import parse_request
except ImportError:
    try:  # before #58's rename
        from server.openai.requests import parse_request  # type: ignore[no-redef]
    except ImportError:  # the hand-written parser this replaced
        from server.openai_requests import parse_request  # type: ignore[no-redef]

CHAT: dict[str, Any] = {
    "model": "demo",
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a haiku about queues."},
    ],
    "max_tokens": 64,
    "temperature": 0.7,
    "top_p": 0.95,
    "stream": True,
    "stream_options": {"include_usage": True},
}
COMPLETION: dict[str, Any] = {
    "model": "demo",
    "prompt": "Once upon a time",
    "max_tokens": 32,
    "temperature": 0.0,
    "stop": ["\n\n"],
    "seed": 7,
}
LARGE: dict[str, Any] = {
    "model": "demo",
    "messages": [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20}
        for i in range(200)
    ],
    "max_completion_tokens": 256,
    "logit_bias": {str(token): -5.0 + token % 10 for token in range(300)},
    "stop": ["END", "STOP", "\n\n"],
    "stop_token_ids": list(range(50)),
    "logprobs": True,
    "top_logprobs": 5,
    "seed": 123,
    "n": 2,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=31)
    parser.add_argument("--number", type=int, default=2000)
    args = parser.parse_args()
    for name, body, kind, number in (
        ("chat", CHAT, "chat", args.number),
        ("completion", COMPLETION, "completion", args.number),
        ("large chat", LARGE, "chat", max(1, args.number // 20)),
    ):
        times = timeit.repeat(
            lambda body=body, kind=kind: parse_request(body, kind),
            repeat=args.repeat,
            number=number,
        )
        print(f"{name:>12}: {statistics.median(times) / number * 1e6:8.1f} µs per parse")


if __name__ == "__main__":
    main()
