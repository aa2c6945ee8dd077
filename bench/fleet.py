"""A fleet behind vLLM's router: two replicas of Sluice and two of vLLM's own server, in one run.

Each fleet is two replicas of the demo model behind `vllm-router` (from PyPI), as
`sluice fleet` runs them: Sluice's (`sluice serve`, sharing a Redis) and vLLM's
(`python -m vllm.entrypoints.openai.api_server`, with `--enable-scale-out` so that the router's
`/v1/chat/completions/render` answers and `--enable-prompt-tokens-details` so that usage says
what was cached). For each `--policies` (round_robin, cache_aware, kv_aware) the run starts
Sluice's fleet, then vLLM's, one at a time, and offers each the same chats:

* `--conversations` (24) users, each in a conversation of its own with a long system prompt
  of about `--prefix-tokens` (1,600) random words, distinct per conversation and fixed by
  `--seed`, for `--turns` (6) turns. Each turn appends a user message of about
  `--user-tokens` (24) and asks for `--answer-tokens` (32, `ignore_eos`); the answer the
  fleet streamed back joins the conversation (its last turn: about 1,940 tokens, within the
  demo model's 2,048). Between turns each user thinks for an exponential time of mean
  `--think` (4 s), so the conversations' turns interleave as real users' do: between two
  turns of one conversation, most others take one;
* sizing, as real fleets are: each replica's KV cache is `--kv-blocks` blocks (vLLM's
  `num_gpu_blocks_override`, the same on both fleets; 128 tokens a block on vLLM's CPU
  backend). By default it is 60% of the conversations' blocks at their last turn (24 x 16
  blocks: 384; 231 a replica), so all the conversations together exceed one replica's cache
  (a replica that sees every conversation evicts them in turn) and fit the fleet's, 120% of
  them, with room for the requests running and for an uneven split (one that sees its share
  keeps it). The run prints the check. With two replicas, round_robin sends a turn to the
  replica of the conversation's previous turn one time in two, and that replica may still
  hold it: round_robin's hits are that chance's;
* the prefix is long enough that prefill dominates the time to the first token on this CPU:
  on one replica, straight, a cold 1,600-token prompt took about 72 ms, the same prompt
  cached 13 ms (either server); through the router, with its render calls, a conversation's
  first turn about 85-100 ms, a later turn that found its prefix 31-36 ms at the median.

For each fleet and policy, over turns 2 and later (the first turn of a conversation can find
nothing): the share of prompt tokens found cached (usage's
`prompt_tokens_details.cached_tokens` over `prompt_tokens`), the share of turns that found at
least half of their prompt cached, TTFT p50, p99 and mean, and the mean against the same
fleet's round_robin. Where the replicas' `/metrics` carry vLLM's prefix-cache counters, their
hit share over all turns is given beside, and each replica's share of the prompt tokens.

Then the flood (unless `--no-flood`), under `--flood-policy` (cache_aware) on each fleet:
flood.py's bulk flood (`--bulk-streams` closed-loop streams of `--bulk-tokens`, in a process
of its own that counts tokens without parsing JSON; each stream's prompt its own, else
cache_aware sends the whole flood to one replica) sent through the router, marked bulk
(Sluice: `X-Traffic-Class: bulk`; vLLM's fleet, with `--scheduling-policy priority`: bulk
`priority: 10` and chats `-10`, as flood.py's vllm-priority row; `--vllm-scheduling fcfs` for
first come, first served) while new conversations (another seed) chat beside it. A chat turn
meets the SLO when its TTFT is at most `--slo-factor` (3) times the TTFT p99 of Sluice's fleet's
chats without the flood (all turns, under the flood policy) and the median of its gaps at most
3 times theirs: flood.py's rule. The flood starts `--flood-warmup` seconds before the chats
and stops when their last turn ends; bulk tokens/s is over that span. Sluice's fleet runs it
twice: as started (each replica's targets from its own calibration), and then (unless
`--no-told-slo`) a fleet started afresh whose replicas are told that SLO in ms, as an operator
states it (flood.py's row told the SLO).

The targets (issue #57), each reported as met or not: with cache_aware, at least 90% of later
turns on Sluice's fleet find at least half of their prompt cached; their mean TTFT is at most
0.5x the same turns' under round_robin; Sluice's fleet's hit share is at least vLLM's fleet's;
under the flood, at least 95% of chats stay within the SLO on Sluice's fleet (vLLM's figure
beside it), as started and told the SLO.

The two cores of this host are shared by everything, so each replica's engine is bound to a
core of its own (`VLLM_CPU_OMP_THREADS_BIND`, replica i on core i-1, both fleets alike: by
default each binds to the same core), as two machines would be. kv_aware's router hashes in
the engine's block size, which a replica's `vllm:cache_config_info` says (`--kv-block-size`
overrides it). Run from the repository root:

    python bench/fleet.py                                         # everything, ~13 minutes here
    python bench/fleet.py --systems vllm --policies cache_aware --no-flood --conversations 6
    python bench/fleet.py --json > docs/fleet-runs/DATE-COMMIT.json
    python bench/fleet.py --report docs/fleet-runs/FILE.json      # its tables again
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import random
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]  # this checkout's server, and flood.py
import flood  # noqa: E402

from server import fleet  # noqa: E402
from server.core.stats import quantile  # noqa: E402

SERVED_NAME = flood.SERVED_NAME
SYSTEMS = ("sluice", "vllm")
TOLD = "sluice (told the SLO)"  # the flood's row of Sluice's fleet told the bench's SLO
POLICIES = ("round_robin", "cache_aware", "kv_aware")
TOKENS_PER_CHAR = 0.87  # the demo tokenizer on random lowercase words (1,590 tokens / 1,832)
BLOCK_SIZE = 128  # vLLM's KV block on its CPU backend, the sizing's unit
TEMPLATE_TOKENS = 3  # the demo chat template's tokens around each message's content
CACHE_SHARE = 0.6  # --kv-blocks by default: this share of the conversations' last blocks
HALF = 0.5  # a turn "finds its prompt cached" with at least this share cached
# Targets (issue #57).
TARGET_CACHED_TURNS = 0.9
TARGET_TTFT_RATIO = 0.5
TARGET_WITHIN_SLO = 0.95
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
SLUICE_PROMPT_TOKENS = "sluice_prompt_tokens"  # (by class: bulk's too, under the flood)
COUNTERS = (PREFIX_QUERIES, PREFIX_HITS, SLUICE_PROMPT_TOKENS)


# The workload.


def words(rng: random.Random, tokens: int) -> str:
    """Random lowercase words of about `tokens` tokens of the demo tokenizer."""
    chars, out = round(tokens / TOKENS_PER_CHAR), []
    while chars > 0:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))
        out.append(word)
        chars -= len(word) + 1
    return " ".join(out)


@dataclass(frozen=True)
class Workload:
    conversations: int
    prefix_tokens: int
    turns: int
    user_tokens: int
    answer_tokens: int
    think_s: float

    def last_prompt_tokens(self) -> int:
        """About how many tokens a conversation's last turn sends (its prompt)."""
        messages = 1 + self.turns + (self.turns - 1)
        content = self.prefix_tokens + self.turns * self.user_tokens
        return content + (self.turns - 1) * self.answer_tokens + TEMPLATE_TOKENS * messages

    def blocks(self, block_size: int = BLOCK_SIZE) -> int:
        """KV blocks a conversation holds at its end: its last prompt and answer."""
        return math.ceil((self.last_prompt_tokens() + self.answer_tokens) / block_size)


def default_kv_blocks(workload: Workload, block_size: int = BLOCK_SIZE) -> int:
    return math.ceil(CACHE_SHARE * workload.conversations * workload.blocks(block_size))


def sizing(workload: Workload, kv_blocks: int, replicas: int = 2) -> dict[str, Any]:
    """Whether the conversations exceed one replica's cache and fit the fleet's."""
    total = workload.conversations * workload.blocks()
    return {
        "conversation_blocks": workload.blocks(),
        "all_conversations_blocks": total,
        "kv_blocks_per_replica": kv_blocks,
        "one_replica_holds": round(kv_blocks / total, 3),
        "fleet_holds": round(replicas * kv_blocks / total, 3),
        "exceeds_one_replica": total > kv_blocks,
        "fits_the_fleet": total <= replicas * kv_blocks,
    }


@dataclass
class Turn:
    conversation: int
    turn: int
    started: float  # monotonic
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def cached_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_chat(self) -> flood.Chat:
        assert self.ttft_s is not None
        return flood.Chat(self.started, self.ttft_s, self.gaps_s, self.total_s)


async def one_turn(
    client: httpx.AsyncClient, kind: str, messages: list[dict[str, str]], turn: Turn, tokens: int
) -> str:
    """Sends the conversation so far, streams the answer; fills `turn`, returns the answer."""
    body, headers = flood.request_body(kind, tokens, False, "")
    body["messages"] = messages
    body["stream_options"] = {"include_usage": True}
    stamps: list[float] = []
    answer: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if flood.content_event("chat", event):
                stamps.append(time.monotonic())
                answer += [(c.get("delta") or {}).get("content") or "" for c in event["choices"]]
            if event.get("usage"):
                usage = event["usage"]
                turn.prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                turn.cached_tokens = details.get("cached_tokens") or 0
    if not stamps:
        raise RuntimeError("no content")
    turn.ttft_s = stamps[0] - turn.started
    turn.gaps_s = [b - a for a, b in itertools.pairwise(stamps)]
    turn.total_s = stamps[-1] - turn.started
    return "".join(answer)


async def user(
    client: httpx.AsyncClient, kind: str, w: Workload, seed: int, number: int
) -> list[Turn]:
    """One user's conversation: its prefix, then `w.turns` turns with think time between."""
    rng = random.Random(f"{seed}-{number}")
    prefix = f"You are assistant {number}. Remember this: " + words(rng, w.prefix_tokens)
    messages = [{"role": "system", "content": prefix}]
    turns: list[Turn] = []
    await asyncio.sleep(rng.uniform(0, w.think_s))  # users do not start in step
    for n in range(1, w.turns + 1):
        messages.append({"role": "user", "content": words(rng, w.user_tokens)})
        turn = Turn(number, n, time.monotonic())
        turns.append(turn)
        try:
            answer = await one_turn(client, kind, messages, turn, w.answer_tokens)
        except (httpx.HTTPError, RuntimeError, KeyError) as exc:
            turn.error = str(exc)[:200] or type(exc).__name__
            return turns  # the conversation ends with its failed turn
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(rng.expovariate(1 / w.think_s) if w.think_s > 0 else 0)
    return turns


async def converse(url: str, kind: str, w: Workload, seed: int) -> list[Turn]:
    """Every user's conversation, at once."""
    limits = httpx.Limits(max_connections=w.conversations + 8)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600.0) as client:
        done = await asyncio.gather(
            *(user(client, kind, w, seed, n) for n in range(w.conversations))
        )
    return sorted((t for turns in done for t in turns), key=lambda t: t.started)


# The fleets.


@dataclass
class Fleet:
    system: str
    policy: str
    url: str  # the router's
    replicas: list[str]
    children: list[fleet.Child]


def vllm_command(args: argparse.Namespace, port: int, kv_port: int | None) -> list[str]:
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", args.model, "--served-model-name", SERVED_NAME]
    command += ["--host", "127.0.0.1", "--port", str(port), "--enable-prompt-tokens-details"]
    command += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    command += ["--scheduling-policy", args.vllm_scheduling]
    if args.vllm_render:
        command.append("--enable-scale-out")  # the router's render calls, else /tokenize
    if kv_port is not None:
        command += ["--kv-events-config", fleet.kv_events_config(kv_port)]
    return command


def sluice_args(
    args: argparse.Namespace, data_dir: Path, slo: tuple[float, float] | None = None
) -> list[str]:
    """A replica's `sluice serve` arguments; `slo` (seconds): told that SLO in ms, as an operator
    states it (`slo.interactive.ttft_ms` / `itl_ms`, flood.py's row told the SLO)."""
    config = []
    if slo is not None:
        path = data_dir / "told-slo.yaml"
        stated = {"interactive": {"ttft_ms": 1000 * slo[0], "itl_ms": 1000 * slo[1]}}
        path.write_text(yaml.safe_dump({"slo": stated}))
        config = ["--config", str(path)]
    return [
        *config,
        "--model",
        args.model,
        "--served-model-name",
        SERVED_NAME,
        "--engine-arg",
        f"num_gpu_blocks_override={args.kv_blocks}",
        "--data-dir",
        str(data_dir),
    ]


@contextlib.contextmanager
def started(
    system: str,
    policy: str,
    args: argparse.Namespace,
    logs: Path,
    told_slo: tuple[float, float] | None = None,
) -> Iterator[Fleet]:
    """`system`'s fleet under `policy`, ready; stopped (every process gone) on leaving.
    `told_slo`: Sluice's replicas told that SLO (seconds)."""
    port, replicas = args.port, args.replicas
    children: list[fleet.Child] = []
    urls: list[str] = []
    try:
        state_url = None
        if system == "sluice":
            redis, state_url = fleet.redis_child(Path(tempfile.mkdtemp(prefix="fleet-")))
            children.append(redis)
            redis.start()
        waiting = []
        kv_sources = {}
        for i in range(1, replicas + 1):
            url = f"http://127.0.0.1:{port + i}"
            kv_port = args.kv_events_port + i - 1 if policy == "kv_aware" else None
            listener = None
            if system == "sluice":  # as `sluice fleet` starts its replicas
                assert state_url is not None
                listener = socket.create_server(("127.0.0.1", port + i))
                data = Path(tempfile.mkdtemp(prefix="fleet-data-"))
                command = fleet.replica_command(
                    sluice_args(args, data, told_slo), listener.fileno(), state_url, kv_port
                )
                ready = url + "/ready"
            else:
                command = vllm_command(args, port + i, kv_port)
                ready = url + "/health"
            if kv_port is not None:
                kv_sources[url] = f"tcp://127.0.0.1:{kv_port}"
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT), "SLUICE_API_KEYS": ""}
            if args.bind_cores:
                env["VLLM_CPU_OMP_THREADS_BIND"] = str((i - 1) % (os.cpu_count() or 1))
            replica = fleet.Child(f"{system} replica {i}", command, logs / f"replica-{i}.log", env)
            children.append(replica)
            replica.start(listener)
            waiting.append((replica, ready))
            urls.append(url)
        fleet.wait_ready(waiting, args.ready_timeout)
        block_size = None
        if kv_sources:
            block_size = args.kv_block_size or fleet.kv_block_size(urls[0])
        command = fleet.router_command(
            fleet.find_router(args.router),
            host="127.0.0.1",
            port=port,
            workers=urls,
            policy=policy,
            prometheus_port=port + replicas + 1,
            kv_sources=kv_sources,
            kv_block_size=block_size,
            kv_model=SERVED_NAME,
            # vLLM's server has no /ready (the fleet's health check): its /health.
            more=[
                *(["--health-check-endpoint", "/health"] if system == "vllm" else []),
                *args.router_arg,
            ],
        )
        router = fleet.Child("vllm-router", command, logs / "router.log")
        router.start()
        children.append(router)
        fleet.wait_ready([(router, f"http://127.0.0.1:{port}/health")], 120)
        warm_up(urls)
        yield Fleet(system, policy, f"http://127.0.0.1:{port}", urls, children)
    finally:
        fleet.stop(children)


def warm_up(replicas: Sequence[str]) -> None:
    """One short request to each replica, straight (not through the router, whose prefix tree
    it would join): a replica's first request pays one-off costs the chats should not."""
    body = {"model": SERVED_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for url in replicas:
        httpx.post(url + "/v1/chat/completions", json=body, timeout=120).raise_for_status()


def counters(replicas: Sequence[str]) -> list[dict[str, float]]:
    """Each replica's prefix-cache and prompt-token counters, those its /metrics has."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for url in replicas:
        values: dict[str, float] = {}
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(url + "/metrics", timeout=5) as response:
                text = response.read().decode()
            for family in text_string_to_metric_families(text):
                if family.name in COUNTERS:
                    values[family.name] = sum(
                        s.value for s in family.samples if s.name.endswith("_total")
                    )
        out.append(values)
    return out


# The phases.


def bulk_kind(system: str, args: argparse.Namespace) -> str:
    """flood.py's name for how this fleet's requests are marked (its `request_body`)."""
    if system == "sluice":
        return "sluice"
    return "vllm-priority" if args.vllm_scheduling == "priority" else "vllm-fcfs"


def chats(f: Fleet, args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    """The conversations on a fleet, without the flood: the turns and the replicas' counters."""
    before = counters(f.replicas)
    turns = asyncio.run(converse(f.url, bulk_kind(f.system, args), w, args.seed))
    after = counters(f.replicas)
    return {"turns": turns, "counters": counter_increase(before, after)}


def counter_increase(
    before: list[dict[str, float]], after: list[dict[str, float]]
) -> list[dict[str, float]]:
    return [{k: a[k] - b.get(k, 0.0) for k in a} for b, a in zip(before, after, strict=True)]


def flooded(f: Fleet, args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    """New conversations while flood.py's bulk flood runs through the router."""
    kind = bulk_kind(f.system, args)
    port = int(f.url.rsplit(":", 1)[1])
    bulk = argparse.Namespace(
        bulk_streams=args.bulk_streams,
        bulk_tokens=args.bulk_tokens,
        bulk_distinct=True,  # (alike, cache_aware would send the whole flood to one replica)
        adapters=None,
    )
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    release = context.Event()  # the flood stops after the chats' last turn
    begin = time.time() + args.flood_warmup
    process = context.Process(
        target=flood.bulk_load_process,
        args=(kind, bulk, port, (begin, math.inf), release, results),
        daemon=True,
    )
    before = counters(f.replicas)
    process.start()
    try:
        time.sleep(args.flood_warmup)  # the flood reaching its steady state
        turns, sampled = asyncio.run(
            chats_sampled(f, kind, w, args.seed + 1, sample=f.system == "sluice")
        )
        span = time.time() - begin
    finally:
        release.set()
    counts = results.get(True, 120)
    process.join(30)
    return {
        "turns": turns,
        "counters": counter_increase(before, counters(f.replicas)),
        "bulk_tokens_per_s": round(counts["tokens"] / span, 1),
        "bulk_failures": counts["failures"],
        **sluice_gauges(sampled),
    }


async def chats_sampled(
    f: Fleet, kind: str, w: Workload, seed: int, sample: bool
) -> tuple[list[Turn], list[flood.Measurements]]:
    """The conversations, and (`sample`) each Sluice replica's gauges and SLO verdicts as
    flood.py samples them, through the same span."""
    stop = asyncio.Event()
    sampled = [flood.Measurements(window_start=time.monotonic()) for _ in f.replicas]
    async with contextlib.AsyncExitStack() as stack:
        samplers = []
        for url, m in zip(f.replicas, sampled, strict=True) if sample else ():
            client = await stack.enter_async_context(httpx.AsyncClient(base_url=url))
            samplers.append(asyncio.create_task(flood.sample_gauges(client, m, stop, SERVED_NAME)))
        turns = await converse(f.url, kind, w, seed)
        stop.set()
        await asyncio.gather(*samplers)
    return turns, sampled if sample else []


SLUICE_GAUGES = ("within_slo_by_sluice", "ttft_target_ms", "itl_target_ms", "bulk_cap")


def sluice_gauges(sampled: Sequence[flood.Measurements]) -> dict[str, Any]:
    """The fleet's Sluice replicas through the flood: each one's mean interactive TTFT and gap
    targets (ms) and bulk cap, and the share of chats that met the targets Sluice held, timed at its
    writes (flood.py's `within_slo_by_sluice`)."""
    if not sampled:
        return {}

    def means(key: str) -> list[float] | None:
        values = [statistics.fmean(m.samples[key]) for m in sampled if m.samples.get(key)]
        return [round(v, 1) for v in values] if len(values) == len(sampled) else None

    def increase(key: str) -> float:
        return sum(m.counted[key][-1] - m.counted[key][0] for m in sampled if m.counted.get(key))

    ended = sum(increase(key) for key in flood.VERDICTS)
    return {
        "ttft_target_ms": means("ttft_target_ms"),
        "itl_target_ms": means("itl_target_ms"),
        "bulk_cap": means("bulk_cap"),
        "within_slo_by_sluice": round(increase("slo_met_none") / ended, 4) if ended else None,
    }


# The report (pure functions of the turns).


def later(turns: Sequence[Turn]) -> list[Turn]:
    return [t for t in turns if t.turn >= 2]


def summarise(
    system: str, policy: str, turns: Sequence[Turn], counted: list[dict[str, float]]
) -> dict[str, Any]:
    """A fleet's row: its later turns' cache and TTFT (ms)."""
    ok = [t for t in later(turns) if t.error is None]
    ttfts = [1000 * t.ttft_s for t in ok if t.ttft_s is not None]
    prompt = sum(t.prompt_tokens for t in ok)
    firsts = [1000 * t.ttft_s for t in turns if t.turn == 1 and t.ttft_s is not None]
    row: dict[str, Any] = {
        "system": system,
        "policy": policy,
        "later_turns": len(ok),
        "failures": sum(1 for t in turns if t.error is not None),
        "hit_share": round(sum(t.cached_tokens for t in ok) / prompt, 4) if prompt else None,
        "half_cached_share": (
            round(sum(1 for t in ok if t.cached_share >= HALF) / len(ok), 4) if ok else None
        ),
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p99_ms": quantile(ttfts, 0.99),
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else None,
        "first_turn_ttft_mean_ms": statistics.fmean(firsts) if firsts else None,
        "ttft_vs_round_robin": None,
    }
    return {**row, **replica_counters(counted)}


def replica_counters(counted: list[dict[str, float]]) -> dict[str, Any]:
    """From each replica's counters: vLLM's prefix-cache hit share (all turns), and each
    replica's share of the prompt tokens (vLLM's prefix-cache queries, else Sluice's
    `sluice_prompt_tokens`)."""
    row: dict[str, Any] = {}
    for name in (PREFIX_QUERIES, SLUICE_PROMPT_TOKENS):
        tokens = [c[name] for c in counted if name in c]
        if counted and len(tokens) == len(counted) and sum(tokens) > 0:
            row["replica_token_split"] = [round(t / sum(tokens), 3) for t in tokens]
            if name == PREFIX_QUERIES and all(PREFIX_HITS in c for c in counted):
                row["replica_hit_share"] = round(
                    sum(c[PREFIX_HITS] for c in counted) / sum(tokens), 4
                )
            break
    return row


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's later-turn TTFT mean against its own fleet's under round_robin."""
    for row in rows:
        base = next(
            (r for r in rows if r["system"] == row["system"] and r["policy"] == "round_robin"),
            None,
        )
        if base and base["ttft_mean_ms"] and row["ttft_mean_ms"] is not None:
            row["ttft_vs_round_robin"] = round(row["ttft_mean_ms"] / base["ttft_mean_ms"], 3)


def idle_slo(turns: Sequence[Turn], factor: float) -> tuple[float, float]:
    """flood.py's SLO (seconds) from chats without the flood: all their turns."""
    chats = [t.as_chat() for t in turns if t.error is None]
    return flood.idle_slo(flood.Measurements(chats=chats), factor)


def flood_row(
    system: str, policy: str, result: dict[str, Any], slo: tuple[float, float] | None
) -> dict[str, Any]:
    turns = result["turns"]
    ok = [t for t in turns if t.error is None]
    ttfts = [1000 * t.ttft_s for t in ok if t.ttft_s is not None]
    cached = summarise(system, policy, turns, result.get("counters", []))
    failures = len(turns) - len(ok)
    return {
        "system": system,
        "policy": policy,
        "chats": len(ok),
        "failures": failures,
        "within_slo": (flood.within_slo([t.as_chat() for t in ok], failures, slo) if slo else None),
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p99_ms": quantile(ttfts, 0.99),
        "hit_share": cached["hit_share"],
        "bulk_tokens_per_s": result["bulk_tokens_per_s"],
        "bulk_failures": result["bulk_failures"],
        "replica_token_split": cached.get("replica_token_split"),
        **{k: result.get(k) for k in SLUICE_GAUGES},
    }


def targets(rows: list[dict[str, Any]], floods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue #57's targets, each with its figure and whether it was met (None: not measured)."""

    def row(system: str, policy: str = "cache_aware") -> dict[str, Any]:
        found = [r for r in rows if r["system"] == system and r["policy"] == policy]
        return found[0] if found else {}

    def flood_of(system: str) -> dict[str, Any]:
        return next((r for r in floods if r["system"] == system), {})

    sluice, vllm = row("sluice"), row("vllm")
    checks = [
        (
            "cache_aware: later turns on Sluice's fleet with half their prompt cached",
            sluice.get("half_cached_share"),
            lambda v: v >= TARGET_CACHED_TURNS,
            f">= {TARGET_CACHED_TURNS:.0%}",
        ),
        (
            "cache_aware: Sluice's later-turn TTFT mean / round_robin's",
            sluice.get("ttft_vs_round_robin"),
            lambda v: v <= TARGET_TTFT_RATIO,
            f"<= {TARGET_TTFT_RATIO}x",
        ),
        (
            "cache_aware: Sluice's fleet's hit share - vLLM's fleet's",
            (
                round(sluice["hit_share"] - vllm["hit_share"], 4)
                if sluice.get("hit_share") is not None and vllm.get("hit_share") is not None
                else None
            ),
            lambda v: v >= 0,
            ">= 0",
        ),
        (
            "under the flood: chats within the SLO on Sluice's fleet "
            f"(vLLM's fleet: {share(flood_of('vllm').get('within_slo'))})",
            flood_of("sluice").get("within_slo"),
            lambda v: v >= TARGET_WITHIN_SLO,
            f">= {TARGET_WITHIN_SLO:.0%}",
        ),
        (
            "under the flood: chats within the SLO on Sluice's fleet told the SLO",
            flood_of(TOLD).get("within_slo"),
            lambda v: v >= TARGET_WITHIN_SLO,
            f">= {TARGET_WITHIN_SLO:.0%}",
        ),
    ]
    return [
        {"target": name, "value": value, "goal": goal, "met": None if value is None else met(value)}
        for name, value, met, goal in checks
    ]


def share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    def cell(key: str, value: Any) -> str:
        if value is None:
            return "-"
        if key.endswith("share") or key.startswith("within_slo"):
            return share(value)
        if key.startswith("ttft_vs"):
            return f"{value:.2f}x"
        if isinstance(value, list) and key.endswith("split"):
            return "/".join(f"{100 * v:.0f}%" for v in value)
        if isinstance(value, list):
            return "/".join(f"{v:.1f}" for v in value)
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    lines = [" | ".join(t for _, t in columns), " | ".join("---" for _ in columns)]
    lines += [" | ".join(cell(k, row.get(k)) for k, _ in columns) for row in rows]
    return "\n".join(lines)


CACHE_COLUMNS = [
    ("system", "fleet"),
    ("policy", "policy"),
    ("later_turns", "later turns"),
    ("failures", "errors"),
    ("hit_share", "prompt cached"),
    ("half_cached_share", "turns >= half cached"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("ttft_mean_ms", "TTFT mean ms"),
    ("ttft_vs_round_robin", "mean / round_robin"),
    ("first_turn_ttft_mean_ms", "1st turn mean ms"),
    ("replica_hit_share", "replicas' hit share (all)"),
    ("replica_token_split", "replicas' token split"),
]
FLOOD_COLUMNS = [
    ("system", "fleet"),
    ("policy", "policy"),
    ("chats", "chat turns"),
    ("failures", "errors"),
    ("within_slo", "within SLO"),
    ("within_slo_by_sluice", "by Sluice's measure"),
    ("ttft_p50_ms", "TTFT p50 ms"),
    ("ttft_p99_ms", "TTFT p99 ms"),
    ("hit_share", "prompt cached (later)"),
    ("bulk_tokens_per_s", "bulk tok/s"),
    ("bulk_failures", "bulk errors"),
    ("replica_token_split", "replicas' token split"),
    ("ttft_target_ms", "Sluice's TTFT target ms"),
    ("itl_target_ms", "Sluice's gap target ms"),
    ("bulk_cap", "Sluice's bulk cap"),
]


def format_report(report: dict[str, Any]) -> str:
    size = report["sizing"]
    lines = [
        f"{report.get('date', '?')} on {report.get('host', '?')} at {report.get('commit', '?')}"
        f" (load average {report.get('load_average', '?')}): {report.get('command', '')}",
        f"Sizing: {size['kv_blocks_per_replica']} KV blocks a replica; the conversations hold "
        f"{size['all_conversations_blocks']} at their end ({size['conversation_blocks']} each): "
        f"one replica holds {share(size['one_replica_holds'])} of them, the fleet "
        f"{share(size['fleet_holds'])}",
        "",
        "Turns 2 and later, without the flood:",
        "",
        table(report["rows"], CACHE_COLUMNS),
    ]
    if report.get("flood"):
        slo = report.get("slo_ms")
        lines += [
            "",
            f"Under the flood ({report['args']['bulk_streams']} bulk streams through the router)"
            + (f"; SLO: TTFT <= {slo[0]:.1f} ms and median gap <= {slo[1]:.2f} ms" if slo else "")
            + ":",
            "",
            table(report["flood"], FLOOD_COLUMNS),
        ]
    lines += ["", "Targets:", ""]
    for t in report["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        value = t["value"]
        shown = "-" if value is None else (f"{value:.3f}" if isinstance(value, float) else value)
        lines.append(f"- {t['target']}: {shown} (goal {t['goal']}): {verdict}")
    return "\n".join(lines)


# The run.


def host() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        for line in subprocess.check_output(["lscpu"], text=True).splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.check_output(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True
        ).strip()
    return "unknown"


def write_turns(path: Path, turns: Sequence[Turn]) -> None:
    with path.open("w") as out:
        for turn in turns:
            out.write(json.dumps(asdict(turn)) + "\n")


def run(args: argparse.Namespace) -> dict[str, Any]:
    w = workload(args)
    systems = [s for s in args.systems.split(",") if s]
    policies = [p for p in args.policies.split(",") if p]
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="fleet-bench-"))
    print(f"# logs in {logs}", file=sys.stderr, flush=True)
    began = time.strftime("%Y-%m-%d %H:%M")
    load = [round(os.getloadavg()[0], 2)]  # (a host others share: its load, start and end)
    rows: list[dict[str, Any]] = []
    floods: list[dict[str, Any]] = []
    flood_results: dict[str, dict[str, Any]] = {}
    slo: tuple[float, float] | None = None
    for policy in policies:
        for system in systems:
            name = f"{system}-{policy}"
            (logs / name).mkdir(parents=True, exist_ok=True)
            with started(system, policy, args, logs / name) as f:
                result = chats(f, args, w)
                write_turns(logs / f"{name}.turns.jsonl", result["turns"])
                rows.append(summarise(system, policy, result["turns"], result["counters"]))
                print(f"# {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
                if args.flood and policy == args.flood_policy:
                    if system == "sluice" or slo is None:  # (vLLM's only without Sluice's)
                        slo = idle_slo(result["turns"], args.slo_factor)
                    flood_results[system] = flooded(f, args, w)
                    write_turns(logs / f"{name}.flood.jsonl", flood_results[system]["turns"])
    if args.flood and args.told_slo and slo is not None and "sluice" in systems:
        # A fleet of its own, started told the SLO the rows above set, as flood.py's row told
        # the SLO: the same flood and chats.
        name = f"sluice-{args.flood_policy}-told"
        (logs / name).mkdir(parents=True, exist_ok=True)
        with started("sluice", args.flood_policy, args, logs / name, told_slo=slo) as f:
            flood_results[TOLD] = flooded(f, args, w)
            write_turns(logs / f"{name}.flood.jsonl", flood_results[TOLD]["turns"])
    for system, result in flood_results.items():
        floods.append(flood_row(system, args.flood_policy, result, slo))
        print(f"# {json.dumps(floods[-1])}", file=sys.stderr, flush=True)
    add_ratios(rows)
    load.append(round(os.getloadavg()[0], 2))
    return {
        "date": f"{began} to {time.strftime('%H:%M')}",
        "host": host(),
        "commit": commit(),
        "load_average": load,
        "command": " ".join(["python", "bench/fleet.py", *sys.argv[1:]]),
        "args": {k: v for k, v in vars(args).items() if k not in ("report",)},
        "sizing": sizing(w, args.kv_blocks, args.replicas),
        "slo_ms": None if slo is None else [round(1000 * v, 3) for v in slo],
        "rows": rows,
        "flood": floods,
        "targets": targets(rows, floods),
    }


def workload(args: argparse.Namespace) -> Workload:
    return Workload(
        args.conversations,
        args.prefix_tokens,
        args.turns,
        args.user_tokens,
        args.answer_tokens,
        args.think,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model path (default: the demo model)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"a subset of {SYSTEMS}")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"a subset of {POLICIES}")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--conversations", type=int, default=24)
    p.add_argument("--prefix-tokens", type=int, default=1600)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--think", type=float, default=4.0, help="mean think time (s) between turns")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help=f"each replica's KV blocks (default: {CACHE_SHARE:g} x the conversations' "
        "blocks at their end)",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=None,
        help="the block size kv_aware's router hashes with (default: the replica's "
        "vllm:cache_config_info)",
    )
    p.add_argument("--flood", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--flood-policy", default="cache_aware", choices=POLICIES)
    p.add_argument("--bulk-streams", type=int, default=48)
    p.add_argument("--bulk-tokens", type=int, default=512)
    p.add_argument("--flood-warmup", type=float, default=10.0)
    p.add_argument("--slo-factor", type=float, default=3.0)
    p.add_argument(
        "--told-slo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the flood also on a Sluice fleet started told the SLO in ms (a row of its own)",
    )
    p.add_argument("--vllm-scheduling", choices=("priority", "fcfs"), default="priority")
    p.add_argument(
        "--vllm-render",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM's replicas with --enable-scale-out (the router's render calls answer; "
        "without it the router falls back to /tokenize)",
    )
    p.add_argument(
        "--bind-cores",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each replica's engine on a core of its own (VLLM_CPU_OMP_THREADS_BIND)",
    )
    p.add_argument("--router", default=None, help="the vllm-router executable")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--port", type=int, default=8420, help="the router's (replicas: +1, +2..)")
    p.add_argument("--kv-events-port", type=int, default=5620)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default=None, help="servers' logs and each turn (JSON lines)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--report", default=None, metavar="FILE", help="print a saved --json's tables")
    args = p.parse_args(argv)
    if args.kv_blocks is None:
        args.kv_blocks = default_kv_blocks(workload(args))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(format_report(json.loads(Path(args.report).read_text())))
        return 0
    # SIGTERM ends a run as Ctrl-C does, through each fleet's stop.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    if args.model is None:
        from engine_adapters.demo_model import build_demo_model
        from server.core.settings import default_cache_dir

        args.model = str(build_demo_model(default_cache_dir() / "demo-model"))
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else format_report(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
