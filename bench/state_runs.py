"""Resumable generations shared through Redis: what mirroring costs a stream, and how long
a client waits when the replica running its generation dies.

    python bench/state_runs.py

Starts a `redis-server` of its own (in memory, loopback) and sim-engine Sluice servers, and
measures:

1. **Added latency per stream.** Two servers, one with `--state-url`, one without, sent the
   same resumable streamed chats (each its own `Idempotency-Key`, 64 tokens) one at a time,
   alternately. With Redis each event is written to the generation's log before the client is
   sent it, so the round trip shows in what the client sees: time to the first content chunk
   and the gaps between chunks, measured by the client as bytes arrive (p50/p99 of each, and
   their difference). And what one 1,000-token stream holds in Redis, per token.
2. **Takeover.** A replica with `state.lease_seconds` 2 streams a long resumable generation;
   after 20 chunks it is SIGKILLed and the client at once asks the other replica for the rest
   (`Last-Event-ID`). The longest the client then waits for a chunk (from the kill) is the
   lease's remainder (it was last renewed up to a third of it before) plus up to one read
   interval (1 s): for each round, and whether every token arrived once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from state_quotas import redis_server, start_sluice, summary  # noqa: E402

from server.core.stats import quantile  # noqa: E402

KEY = {"Authorization": "Bearer acme-key"}


def stream_timings(
    client: httpx.Client, url: str, body: dict[str, Any], key: str
) -> tuple[float, list[float]]:
    """Seconds to the first content chunk, and the gaps between content chunks."""
    started = time.perf_counter()
    arrivals = []
    with client.stream(
        "POST", url + "/v1/chat/completions", json=body, headers={**KEY, "Idempotency-Key": key}
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if (
                line.startswith('data: {"id"')
                and '"content":"' in line
                and ('"content":""' not in line)
            ):
                arrivals.append(time.perf_counter())
    return arrivals[0] - started, [b - a for a, b in itertools.pairwise(arrivals)]


def added_latency(redis_url: str, streams: int, work: Path) -> dict[str, Any]:
    config = work / "sluice.yaml"
    config.write_text("tenants:\n  acme: {api_keys: [acme-key]}\n")
    local, local_url = start_sluice(["--config", str(config)], work / "local.log")
    shared, shared_url = start_sluice(
        ["--config", str(config), "--state-url", redis_url], work / "shared.log"
    )
    ttft: dict[str, list[float]] = {"in_process": [], "redis": []}
    gaps: dict[str, list[float]] = {"in_process": [], "redis": []}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "stream": True}
    try:
        with httpx.Client(timeout=30) as client:
            for i in range(streams + 20):
                for name, url in (("in_process", local_url), ("redis", shared_url)):
                    first, between = stream_timings(client, url, body, f"{name}-{i}")
                    if i >= 20:  # the first twenty warm both up
                        ttft[name].append(first)
                        gaps[name].extend(between)
            log_bytes = redis_bytes(client, shared_url, redis_url, 1000)
    finally:
        for process in (local, shared):
            process.terminate()
            process.wait(timeout=30)
    return {
        "streams": streams,
        "tokens_each": 64,
        "redis_bytes_per_token": log_bytes,
        **{f"ttft_{name}": summary(values) for name, values in ttft.items()},
        **{f"gap_{name}": summary(values) for name, values in gaps.items()},
        "ttft_added_p50_ms": round(
            (quantile(ttft["redis"], 0.5) - quantile(ttft["in_process"], 0.5)) * 1e3, 3
        ),
        "ttft_added_p99_ms": round(
            (quantile(ttft["redis"], 0.99) - quantile(ttft["in_process"], 0.99)) * 1e3, 3
        ),
        "gap_added_p50_ms": round(
            (quantile(gaps["redis"], 0.5) - quantile(gaps["in_process"], 0.5)) * 1e3, 3
        ),
        "gap_added_p99_ms": round(
            (quantile(gaps["redis"], 0.99) - quantile(gaps["in_process"], 0.99)) * 1e3, 3
        ),
    }


def redis_bytes(client: httpx.Client, url: str, redis_url: str, tokens: int) -> int:
    """What a resumable stream of `tokens` tokens holds in Redis (its record, key and event
    log, by MEMORY USAGE), per token."""
    reply = client.post(
        url + "/v1/chat/completions",
        headers={**KEY, "Idempotency-Key": "size"},
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": tokens,
            "stream": True,
        },
    )
    first = next(line for line in reply.text.splitlines() if line.startswith('data: {"id"'))
    generation = json.loads(first[6:])["id"]
    with redis.Redis.from_url(redis_url) as store:
        keys = [*store.keys(f"*{generation}*"), *store.keys("sluice:idem:*:size")]
        return round(sum(store.memory_usage(key) or 0 for key in keys) / tokens)


def takeover(redis_url: str, rounds: int, work: Path) -> dict[str, Any]:
    config = work / "sluice.yaml"
    doomed_config = work / "doomed.yaml"
    doomed_config.write_text(
        "tenants:\n  acme: {api_keys: [acme-key]}\nstate: {lease_seconds: 2}\n"
    )
    survivor, survivor_url = start_sluice(
        ["--config", str(config), "--state-url", redis_url], work / "survivor.log"
    )
    max_tokens = 1500
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
        "return_token_ids": True,
    }
    waits, complete = [], []
    try:
        for i in range(rounds):
            doomed, doomed_url = start_sluice(
                ["--config", str(doomed_config), "--state-url", redis_url], work / f"doomed-{i}.log"
            )
            lines: list[str] = []
            with httpx.stream(
                "POST",
                doomed_url + "/v1/chat/completions",
                json=body,
                headers={**KEY, "Idempotency-Key": f"takeover-{i}"},
                timeout=60,
            ) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    if sum(line.startswith("data: ") for line in lines) == 20:
                        break
                os.killpg(doomed.pid, signal.SIGKILL)
                killed = time.perf_counter()
            doomed.wait(timeout=30)
            last = max(int(line[4:]) for line in lines if line.startswith("id: "))
            generation = json.loads(next(line for line in lines if line.startswith("data: "))[6:])[
                "id"
            ]
            arrivals = [killed]
            rest = []
            with httpx.stream(
                "GET",
                f"{survivor_url}/v1/chat/completions/{generation}/stream",
                headers={**KEY, "Last-Event-ID": str(last)},
                timeout=60,
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.perf_counter())
                    rest.append(line)
            # The longest the client waited: for the first resumed chunk (events the dead
            # replica logged beyond what the client had read come at once), or between two.
            waits.append(max(b - a for a, b in itertools.pairwise(arrivals)))
            tokens = sum(
                len(choice.get("token_ids") or ())
                for line in lines + rest
                if line.startswith('data: {"id"')
                for choice in json.loads(line[6:])["choices"]
            )
            complete.append(tokens == max_tokens)
    finally:
        survivor.terminate()
        survivor.wait(timeout=30)
    return {
        "rounds": rounds,
        "lease_seconds": 2,
        "longest_wait_s": [round(w, 3) for w in waits],
        "every_token_once": complete,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "state-runs.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sluice-state-bench-"))
    with redis_server(work) as url:
        report = {
            "added_latency": added_latency(url, args.streams, work),
            "takeover": takeover(url, args.rounds, work),
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
