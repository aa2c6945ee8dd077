"""Chats under a bulk flood: Sluice against vLLM's own server (FCFS and priority), in one run.

One command starts each system in turn on the same model and the same engine settings, offers
the same load, and reports side by side what a person chatting feels (time to first token, the
median gap between tokens, the whole answer) and what the flood gets (bulk tokens/s):

* idle: Sluice with chats only, no bulk. Its TTFT p99 and median gap set the SLO the others are
  judged by: a chat meets it when its TTFT is at most `--slo-factor` (3) times the idle TTFT p99
  and the median of its own gaps at most 3 times the idle median gap. It runs first and again
  last; the run reports how far the two differ (a shared host's speed drifts);
* bulk: `--bulk-streams` closed-loop streams (96), each asking for `--bulk-tokens` (512) with
  `ignore_eos`, marked bulk (Sluice: `X-Traffic-Class: bulk`; vLLM priority: `priority: 10`), a
  new request as soon as the previous one ends;
* chats: a Poisson process at `--chat-rate` per second (4), each for `--chat-tokens` (32),
  read to the end (vLLM priority: `priority: -10`).

The bulk flood runs in its own process and counts tokens without parsing JSON, so the chat
client's stopwatch measures the server, not a load generator busy with 96 streams. Only what
starts in the measurement window (after `--warmup` seconds, for `--duration` seconds) counts.
Gaps are between streamed content chunks (one token each for these servers). On a machine
the client shares (2 cores here, with the flood's generator), it reads some tokens later than
they were written, so each Sluice row also gives its own verdict: the share of chats that
ended in the window within the targets it holds, timed where it wrote their tokens
(`sluice_slo_requests_total`). The row told the SLO holds the bench's targets, so the two
shares differ only by what happened after Sluice's writes; the others hold their own.

`--chat-apis chat,responses,messages` runs Sluice's flood once per API the chats speak (the
bulk flood always uses Chat Completions): `/v1/chat/completions`, OpenAI's `/v1/responses` or
Anthropic's `/v1/messages`, each streamed, so the rows show whether the API a person's client
speaks changes what the scheduler gives them. The idle SLO is set by chats over Chat
Completions.

`--repeat N` runs the whole comparison N times in a row, each row on a server started for it.
With `--keep-servers`, Sluice's own rows (the default, the SLO told, variants; not the ladder's
fixed caps, which learn nothing) keep one server from the first run to the last: the first run
meets it freshly started, the next ones as the last run left it, as the same load repeated on
one deployment would. Every run is then judged by the SLO of the first run's idle row (the SLO
the kept row was told); each run's idle rows still measure the host, against that one. A kept
server idles while the other rows run (about 0.7% of a core, measured here). Runs in a row
also report the steady frontier: the ladder's rung that kept the frontier's share of chats in
every run, with the most bulk over them (`steady`). `--report FILE...` prints the every-run table
of saved `--json` outputs again, several as one series.

`--adapters` serves three LoRA adapters of the demo model on both servers (issue #33) with two
slots (`--max-loras 2 --max-cpu-loras 3`: two adapters in one step): the flood runs on two of
them (its streams take turns), the chats on the third, so the rows show whether a flood that
can hold every slot delays the chats of another adapter.

`--variant 'LABEL=YAML'` (repeatable) adds a Sluice run with that scheduler configuration, and
`--tradeoff` adds a ladder of interactive gap targets: bulk tokens/s against chat end-to-end
time as the target varies. `--root-variant 'LABEL=PATH'` (repeatable) adds a Sluice run in its
default configuration served by the checkout at PATH (its server started there, PATH first on
`PYTHONPATH`, as token_cpu.py's `--root` does; Sluice's other rows are served by this
checkout): a change measured before and after in one run. Usage:

    python bench/flood.py                                  # idle, vLLM FCFS, vLLM priority, Sluice
    python bench/flood.py --tradeoff                       # ... and the trade-off curve
    python bench/flood.py --systems idle,sluice --duration 5 --bulk-streams 4
    python bench/flood.py --repeat 3 --ladder 4,6,9 --keep-servers  # #32's three runs in a row
    python bench/flood.py --systems idle,vllm-fcfs,sluice --chat-apis chat,responses,messages
    python bench/flood.py --adapters --systems idle,vllm-priority,sluice --ladder ''
    git worktree add --detach /tmp/before f47f4c3  # then this checkout against it:
    python bench/flood.py --systems idle,sluice --root-variant before=/tmp/before --ladder ''
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
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from server.core.stats import quantile
from server.observability.metrics import SLO_RESULTS
from server.scheduler.types import PreemptCause

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (loaded by path, as the tests do)
from checkouts import ROOT, checkout, served_from

SERVED_NAME = "sluice-demo"
# With --adapters: the flood's two adapters and the chats' (demo variants 1-3), both servers,
# with two slots (two adapters in one step) and room for all three.
BULK_ADAPTERS, CHAT_ADAPTER = ("flood-bulk", "flood-bulk-2"), "flood-chat"
ADAPTER_SLOTS = ["--max-loras", "2", "--max-cpu-loras", "3"]
SYSTEMS = ("idle", "vllm-fcfs", "vllm-priority", "sluice")
# Idle measured at the end differing from the start by more than this share: a warning.
DRIFT_WARNING = 0.2
# The gap targets of --tradeoff, as multiples of the idle step time (Sluice's itl_factor).
TRADEOFF_ITL_FACTORS = (1.5, 2.0, 5.0, 10.0)


@dataclass
class Chat:
    started: float  # on the bench's monotonic clock
    ttft_s: float
    gaps_s: list[float]
    total_s: float

    @property
    def median_gap_s(self) -> float | None:
        return statistics.median(self.gaps_s) if self.gaps_s else None


@dataclass
class Measurements:
    window_start: float = 0.0
    window_end: float = float("inf")
    chats: list[Chat] = field(default_factory=list)
    chat_failures: int = 0
    bulk_tokens: int = 0
    bulk_failures: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)  # Sluice's gauges, sampled
    course: list[dict[str, float]] = field(default_factory=list)  # each scrape's, timed
    counted: dict[str, list[float]] = field(default_factory=dict)  # Sluice's counters, sampled

    def in_window(self, t: float) -> bool:
        return self.window_start <= t < self.window_end


@dataclass(frozen=True)
class System:
    name: str  # the row's label
    kind: str  # idle | vllm-fcfs | vllm-priority | sluice
    sluice_config: dict[str, Any] | None = None
    chat_api: str = "chat"  # the API the chats speak (CHAT_APIS)
    ladder: int | None = None  # the fixed cap of a rung of the frontier's ladder
    stated_slo: bool = False  # told the idle run's SLO in ms (`slo.interactive`)
    root: Path = ROOT  # the checkout whose code serves a Sluice row (--root-variant)

    def configured(self, slo: tuple[float, float] | None) -> System:
        """This row with the SLO it is told, once the idle run has set it."""
        if not self.stated_slo or slo is None:
            return self
        stated = {"interactive": {"ttft_ms": 1000 * slo[0], "itl_ms": 1000 * slo[1]}}
        config = {**(self.sluice_config or {})}
        config["slo"] = {**config.get("slo", {}), **stated}
        return replace(self, sluice_config=config)

    @property
    def bulk(self) -> bool:
        return self.kind != "idle"

    @property
    def is_sluice(self) -> bool:
        return self.kind in ("idle", "sluice")

    @property
    def keeps_server(self) -> bool:
        """Whether `--keep-servers` keeps its server from run to run: Sluice's own rows, whose
        controller learns as it runs; the ladder's fixed caps learn nothing."""
        return self.kind == "sluice" and self.ladder is None


def server_command(
    system: System, args: argparse.Namespace, port: int, config_path: str | None
) -> list[str]:
    if system.is_sluice:
        command = [
            sys.executable,
            "-m",
            "server.cli",
            "serve",
            "--engine",
            args.sluice_engine,
            "--model",
            args.model,
            "--served-model-name",
            SERVED_NAME,
            "--port",
            str(port),
            "--data-dir",
            tempfile.mkdtemp(prefix="sluice-bench-"),
        ]
        if config_path:
            command += ["--config", config_path]
        if args.adapters:
            command += ["--lora-modules", *args.adapters, *ADAPTER_SLOTS]
        return command
    policy = "priority" if system.kind == "vllm-priority" else "fcfs"
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--served-model-name",
        SERVED_NAME,
        "--port",
        str(port),
        "--scheduling-policy",
        policy,
        *(
            ["--enable-lora", "--lora-modules", *args.adapters, *ADAPTER_SLOTS]
            if args.adapters
            else []
        ),
        *args.vllm_arg,
    ]


async def wait_ready(
    client: httpx.AsyncClient, process: asyncio.subprocess.Process, within_s: float
) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if process.returncode is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get("/v1/models", timeout=2.0)).status_code == 200:
                return
        await asyncio.sleep(1.0)  # polling a starting process: nothing to wait on instead
    raise RuntimeError("server not ready in time")


def request_body(
    kind: str, max_tokens: int, bulk: bool, text: str, model: str = SERVED_NAME
) -> tuple[dict, dict]:
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": text}],
    }
    headers: dict[str, str] = {}
    if kind == "vllm-priority":
        body["priority"] = 10 if bulk else -10
    elif kind == "sluice" and bulk:
        headers["X-Traffic-Class"] = "bulk"
    return body, headers


# What a chat is sent, by the API it speaks: (path, body). Sluice's Responses API has no
# `ignore_eos` (OpenAI's has none), so those chats may end before `--chat-tokens`.
CHAT_APIS = ("chat", "responses", "messages")


def chat_request(
    api: str, kind: str, max_tokens: int, text: str, model: str = SERVED_NAME
) -> tuple[str, dict, dict]:
    body, headers = request_body(kind, max_tokens, False, text, model)
    if api == "responses":
        body = {
            "model": model,
            "stream": True,
            "max_output_tokens": max_tokens,
            "input": text,
        }
        return "/v1/responses", body, headers
    if api == "messages":  # Anthropic's body has these fields too (`ignore_eos`: vLLM's)
        return "/v1/messages", body, headers
    return "/v1/chat/completions", body, headers


def content_event(api: str, event: dict) -> bool:
    """Whether a streamed event carries generated text (raises on an error event)."""
    kind = event.get("type")
    if "error" in event or kind in ("error", "response.failed"):
        raise RuntimeError(str(event.get("error") or event))
    if api == "responses":
        return kind == "response.output_text.delta" and bool(event.get("delta"))
    if api == "messages":
        return kind == "content_block_delta" and bool(event["delta"].get("text"))
    return any((c.get("delta") or {}).get("content") for c in event.get("choices", ()))


def bulk_text(number: int, distinct: bool) -> str:
    """The `number`th bulk stream's prompt; `distinct`: its own from its first word (vLLM's
    router, cache_aware, sends prompts that begin alike to one replica)."""
    return (f"{number} " if distinct else "") + "summarise the report " * 8


async def bulk_stream(
    client, kind, args, window: tuple[float, float], counts: dict, number: int
) -> None:
    """One closed-loop bulk stream (the `number`th), until cancelled. Tokens are counted from
    raw lines (no JSON parsing) so the load generator stays cheap; times are wall-clock (the
    window is shared across processes)."""
    start, end = window
    model = model_of(args, bulk=True, number=number)
    while True:
        body, headers = request_body(
            kind, args.bulk_tokens, True, bulk_text(number, args.bulk_distinct), model
        )
        try:
            async with client.stream(
                "POST", "/v1/chat/completions", json=body, headers=headers
            ) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}")
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"role"' not in line:
                        if start <= time.time() < end:
                            counts["tokens"] += 1
        except (httpx.HTTPError, RuntimeError):
            if start <= time.time() < end:
                counts["failures"] += 1
            await asyncio.sleep(0.1)  # back off before reopening a refused stream


async def _bulk_load(kind, args, port, window, counts, release) -> None:
    """The flood runs on past the window until `release` (an event the chat side sets once its
    last chat has ended), then every stream closes at once. Streams that ended one by
    one at the window's end made the server dispatch, prefill and abort its whole bulk queue in
    a cascade, under the window's last chats."""
    limits = httpx.Limits(max_connections=args.bulk_streams + 8)
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=httpx.Timeout(600.0)
    ) as client:
        streams = [
            asyncio.create_task(bulk_stream(client, kind, args, window, counts, number))
            for number in range(args.bulk_streams)
        ]
        await asyncio.to_thread(release.wait)
        for stream in streams:
            stream.cancel()
        await asyncio.gather(*streams, return_exceptions=True)


def bulk_load_process(kind, args, port, window, release, results) -> None:
    """The bulk flood, in its own process so that its work cannot delay the chat client."""
    counts = {"tokens": 0, "failures": 0}
    asyncio.run(_bulk_load(kind, args, port, window, counts, release))
    results.put(counts)


def model_of(args: argparse.Namespace, *, bulk: bool, number: int = 0) -> str:
    """The model a request names: with --adapters, one of the flood's adapters (the `number`th
    stream's) or the chats'."""
    if not args.adapters:
        return SERVED_NAME
    return BULK_ADAPTERS[number % len(BULK_ADAPTERS)] if bulk else CHAT_ADAPTER


async def one_chat(client, system: System, args, m: Measurements) -> None:
    path, body, headers = chat_request(
        system.chat_api,
        system.kind,
        args.chat_tokens,
        "hello, how are you today?",
        model_of(args, bulk=False),
    )
    started = time.monotonic()
    stamps: list[float] = []
    try:
        async with client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if content_event(system.chat_api, json.loads(line[6:])):
                    stamps.append(time.monotonic())
        if not stamps:
            raise RuntimeError("no content")
    except (httpx.HTTPError, RuntimeError):
        if m.in_window(started):
            m.chat_failures += 1
        return
    if m.in_window(started):
        gaps = [b - a for a, b in itertools.pairwise(stamps)]
        m.chats.append(Chat(started, stamps[0] - started, gaps, stamps[-1] - started))


async def chat_arrivals(client, system: System, args, m: Measurements, stop: asyncio.Event) -> None:
    rng = random.Random(args.seed)
    chats: set[asyncio.Task] = set()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), rng.expovariate(args.chat_rate))
        if not stop.is_set():
            task = asyncio.create_task(one_chat(client, system, args, m))
            chats.add(task)
            task.add_done_callback(chats.discard)
    if chats:  # let the chats that started in the window finish
        await asyncio.wait(chats, timeout=60)


# Sluice gauges sampled through the window: what the bulk cap allowed, what bulk ran, and the
# interactive targets of the chats' model (ms; `CHATS`: its name, the served model's or with
# --adapters the chats' adapter's): (the line's start, what it must hold, scale).
CHATS = "{chats}"
SAMPLED = {
    "bulk_cap": ("sluice_bulk_cap_sequences{", "", 1.0),
    "bulk_running": ('sluice_running_requests{model="sluice-demo",traffic_class="bulk"}', "", 1.0),
    "itl_target_ms": (f'sluice_slo_target_seconds{{model="{CHATS}"', 'target="itl"', 1e3),
    "ttft_target_ms": (
        f'sluice_slo_target_seconds{{model="{CHATS}"',
        'target="ttft",traffic_class="interactive"',
        1e3,
    ),
    "controller_scale": ("sluice_bulk_controller_scale{", "", 1.0),
    "controller_aim": ("sluice_bulk_controller_aim{", "", 1.0),
    "aim_by_spread": ("sluice_bulk_controller_aim_limit{", 'source="spread"', 1.0),
    "aim_by_misses": ("sluice_bulk_controller_aim_limit{", 'source="misses"', 1.0),
    "controller_pace": ("sluice_bulk_controller_pace{", "", 1.0),
    "chat_gap_share": ("sluice_chat_gap_share{", "", 1.0),
}
# Chats' verdicts by Sluice's own measure: times at its writes, against the targets it holds.
VERDICTS = {
    f"slo_{result}_{reason}": (
        "sluice_slo_requests_total{",
        f'reason="{reason}",result="{result}",traffic_class="interactive"',  # (labels sorted)
    )
    for result, reason in SLO_RESULTS["interactive"]
}
# Sluice counters, reported as their increase over the window: bulk requests stopped, by
# cause, and the chats that ended, by verdict.
COUNTED = {
    **{
        f"preempted_{cause}": ("sluice_bulk_preemptions_total{", f'cause="{cause}"')
        for cause in PreemptCause
    },
    **VERDICTS,
}


async def sample_gauges(
    client: httpx.AsyncClient, m: Measurements, stop: asyncio.Event, chats: str
) -> None:
    """Samples `SAMPLED` and `COUNTED` every 2 s of the window; `chats`: the chats' model."""
    sampled = {
        key: (prefix.replace(CHATS, chats), holds, scale)
        for key, (prefix, holds, scale) in SAMPLED.items()
    }
    while not stop.is_set():
        if m.in_window(time.monotonic()):
            with contextlib.suppress(httpx.HTTPError):
                text = (await client.get("/metrics", timeout=2.0)).text
                scrape = {"at": time.monotonic()}
                for line in text.splitlines():
                    for key, (prefix, holds, scale) in sampled.items():
                        if line.startswith(prefix) and holds in line:
                            value = scale * float(line.rsplit(" ", 1)[1])
                            if math.isfinite(value):
                                m.samples.setdefault(key, []).append(value)
                                scrape[key] = value
                    for key, (prefix, holds) in COUNTED.items():
                        if line.startswith(prefix) and holds in line:
                            m.counted.setdefault(key, []).append(float(line.rsplit(" ", 1)[1]))
                m.course.append(scrape)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)


async def start_server(
    system: System,
    args: argparse.Namespace,
    port: int,
    log_name: str,
    stack: contextlib.AsyncExitStack,
) -> None:
    """Starts `system`'s server on `port` and returns once it is ready; closing `stack` (an
    `AsyncExitStack`) stops it. Its output goes to `log_name`.log in `--log-dir`."""
    config_path = None
    if system.sluice_config:
        config_file = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".yaml"))
        yaml.safe_dump(system.sluice_config, config_file)
        config_file.flush()
        config_path = config_file.name
    log = None
    if args.log_dir:
        log = stack.enter_context((Path(args.log_dir) / f"{log_name}.log").open("wb"))
    served = (
        served_from(system.root, {**os.environ, "SLUICE_API_KEYS": ""})
        if system.is_sluice
        else {"env": dict(os.environ)}
    )
    process = await asyncio.create_subprocess_exec(
        *server_command(system, args, port, config_path),
        **served,
        stdout=log or subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        process_group=0,
    )
    stack.push_async_callback(stop_group, process)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
        await wait_ready(client, process, args.ready_timeout)


async def measure(system: System, args: argparse.Namespace, port: int) -> Measurements:
    """The load on the server ready on `port`: the flood (unless idle) and the chats."""
    limits = httpx.Limits(max_connections=args.bulk_streams + 256)
    m = Measurements()
    async with httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", limits=limits, timeout=httpx.Timeout(600.0)
    ) as client:
        now, wall = time.monotonic(), time.time()
        m.window_start, m.window_end = now + args.warmup, now + args.warmup + args.duration
        window = (wall + args.warmup, wall + args.warmup + args.duration)
        bulk = None
        if system.bulk:
            context = multiprocessing.get_context("spawn")
            results = context.Queue()
            release = context.Event()  # the flood stops after the window's last chat
            bulk = context.Process(
                target=bulk_load_process,
                args=(system.kind, args, port, window, release, results),
                daemon=True,  # a run that fails before the release does not outlive it
            )
            bulk.start()
        stop = asyncio.Event()
        chats = asyncio.create_task(chat_arrivals(client, system, args, m, stop))
        sampler = (
            asyncio.create_task(sample_gauges(client, m, stop, model_of(args, bulk=False)))
            if system.kind == "sluice"
            else None
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.warmup + args.duration)
        stop.set()
        await chats
        if sampler is not None:
            await sampler
        if bulk is not None:
            release.set()
            counts = await asyncio.to_thread(results.get, True, 120)
            bulk.join(30)
            m.bulk_tokens, m.bulk_failures = counts["tokens"], counts["failures"]
    return m


async def stop_group(process: asyncio.subprocess.Process) -> None:
    """SIGINT to the server's process group, then wait until every process in it (vLLM's
    engine processes too) is gone, so that none of it runs into the next system's run."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        if process.returncode is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(process.wait(), 0.5)
        else:
            await asyncio.sleep(0.5)  # the engine's processes outlive the server by seconds
    else:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    await process.wait()


@dataclass
class KeptServers:
    """With `--keep-servers`, Sluice's own rows (not the ladder's fixed caps) keep one server
    from run to run: the first run meets it freshly started, the next ones as it was left, as
    the same load repeated on one deployment would. Each gets a port of its own."""

    stack: contextlib.AsyncExitStack
    ports: dict[str, int] = field(default_factory=dict)


async def run_system(
    system: System, args: argparse.Namespace, prefix: str, kept: KeptServers | None
) -> Measurements:
    """One system's run, on a server started for it (and stopped after) or on its kept one."""
    if kept is not None and system.keeps_server:
        if system.name not in kept.ports:
            port = args.port + 1 + len(kept.ports)
            await start_server(system, args, port, system.name, kept.stack)
            kept.ports[system.name] = port
        return await measure(system, args, kept.ports[system.name])
    async with contextlib.AsyncExitStack() as stack:
        await start_server(system, args, args.port, f"{prefix}{system.name}", stack)
        return await measure(system, args, args.port)


def summarise(
    system: System, m: Measurements, args: argparse.Namespace, slo: tuple[float, float] | None
) -> dict[str, Any]:
    ms = 1000.0
    ttfts = [c.ttft_s * ms for c in m.chats]
    gaps = [g * ms for c in m.chats for g in c.gaps_s]
    row: dict[str, Any] = {
        "system": system.name,
        "chats": len(m.chats),
        "chat_failures": m.chat_failures,
        "ttft_p50_ms": quantile(ttfts, 0.5),
        "ttft_p99_ms": quantile(ttfts, 0.99),
        "gap_p50_ms": quantile(gaps, 0.5),
        "chat_median_gap_p99_ms": quantile(
            [c.median_gap_s * ms for c in m.chats if c.median_gap_s is not None], 0.99
        ),
        "e2e_p50_ms": quantile([c.total_s * ms for c in m.chats], 0.5),
        "e2e_p99_ms": quantile([c.total_s * ms for c in m.chats], 0.99),
        "bulk_tokens_per_s": round(m.bulk_tokens / args.duration, 1) if system.bulk else None,
        "bulk_failures": m.bulk_failures if system.bulk else None,
        "within_slo": None,
        **{
            f"{key}_mean": round(statistics.fmean(values), 1)
            for key, values in m.samples.items()
            if values
        },
        **{key: round(values[-1] - values[0]) for key, values in m.counted.items()},
    }
    if slo is not None:
        row["within_slo"] = within_slo(m.chats, m.chat_failures, slo)
    # The same chats as Sluice judged them: where the bench's client shares the host, it reads
    # tokens later than Sluice writes them, and the difference is the client's, not Sluice's.
    ended = sum(row.get(key, 0) for key in VERDICTS)
    if ended:
        row["within_slo_by_sluice"] = round(row.get("slo_met_none", 0) / ended, 4)
    return row


def within_slo(chats: list[Chat], failures: int, slo: tuple[float, float]) -> float | None:
    """The share of chats (failed ones too) within `slo`: (TTFT limit, median-gap limit) in
    seconds; None: no chats."""
    ttft_limit, gap_limit = slo
    met = sum(
        1
        for c in chats
        if c.ttft_s <= ttft_limit and (c.median_gap_s is None or c.median_gap_s <= gap_limit)
    )
    total = len(chats) + failures
    return round(met / total, 4) if total else None


def idle_slo(m: Measurements, factor: float) -> tuple[float, float]:
    """(TTFT limit, median-gap limit) in seconds: `factor` x the idle TTFT p99 and median gap."""
    ttft_p99 = quantile([c.ttft_s for c in m.chats], 0.99)
    gap_p50 = quantile([g for c in m.chats for g in c.gaps_s], 0.5)
    if ttft_p99 is None or gap_p50 is None:
        raise RuntimeError("the idle run measured no chats; the SLO cannot be set")
    return factor * ttft_p99, factor * gap_p50


def format_table(rows: list[dict[str, Any]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:.1f}" if isinstance(value, float) else str(value)

    columns = [
        ("system", "system"),
        ("chats", "chats"),
        ("chat_failures", "chat errors"),
        ("ttft_p50_ms", "TTFT p50 ms"),
        ("ttft_p99_ms", "TTFT p99 ms"),
        ("gap_p50_ms", "gap p50 ms"),
        ("e2e_p50_ms", "chat e2e p50 ms"),
        ("e2e_p99_ms", "chat e2e p99 ms"),
        ("within_slo", "chats within SLO"),
        ("within_slo_by_sluice", "by Sluice's measure"),
        ("bulk_tokens_per_s", "bulk tok/s"),
        ("bulk_vs_fcfs", "bulk / vLLM FCFS"),
        ("bulk_vs_frontier", "bulk / frontier"),
    ]
    lines = [" | ".join(title for _, title in columns), " | ".join("---" for _ in columns)]
    for row in rows:
        values = dict(row)
        for share in ("within_slo", "within_slo_by_sluice"):
            if values.get(share) is not None:
                values[share] = f"{100 * values[share]:.1f}%"
        for ratio in ("bulk_vs_fcfs", "bulk_vs_frontier"):
            if values.get(ratio) is not None:
                values[ratio] = f"{values[ratio]:.2f}x"
        lines.append(" | ".join(cell(values.get(key)) for key, _ in columns))
    return "\n".join(lines)


def parse_variant(text: str) -> System:
    label, sep, raw = text.partition("=")
    config = yaml.safe_load(raw) if sep else None
    if not label or not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"--variant expects LABEL=YAML mapping, got {text!r}")
    return System(f"sluice[{label}]", "sluice", config)


def parse_root_variant(text: str) -> System:
    label, sep, path = text.partition("=")
    if not label or not sep:
        raise argparse.ArgumentTypeError(f"--root-variant expects LABEL=PATH, got {text!r}")
    try:
        return System(f"sluice[{label}]", "sluice", root=checkout(path))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def plan(args: argparse.Namespace) -> list[System]:
    systems = [System(name, name) for name in args.systems.split(",") if name.strip()]
    unknown = {s.kind for s in systems} - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems: {sorted(unknown)}")
    systems += args.variant + args.root_variant
    apis = [api.strip() for api in args.chat_apis.split(",") if api.strip()]
    if set(apis) - set(CHAT_APIS):
        raise SystemExit(f"unknown chat APIs: {sorted(set(apis) - set(CHAT_APIS))}")
    if any(s.kind == "sluice" for s in systems):
        systems += [System(f"sluice[{api}]", "sluice", None, api) for api in apis if api != "chat"]
    if any(s.kind == "sluice" for s in systems):
        systems += [rung(n) for n in args.ladder]
        if args.stated_slo:
            systems.append(System("sluice[SLO in ms]", "sluice", stated_slo=True))
    if args.tradeoff:
        systems += [
            System(f"sluice[itl x{f:g}]", "sluice", {"slo": {"itl_factor": f}})
            for f in TRADEOFF_ITL_FACTORS
        ]
        systems.append(System("sluice[no cap]", "sluice", {"slo": {"cap_bulk": False}}))
    if any(s.bulk for s in systems) and not any(s.kind == "idle" for s in systems):
        systems.insert(0, System("idle", "idle"))  # the SLO is relative to it
    systems = sorted(systems, key=lambda s: s.kind != "idle")
    if len(systems) > 1 and systems[0].kind == "idle":
        # Measured again at the end: if the machine's speed drifted during the run (a shared
        # host), the two idle rows disagree, and the run says so.
        systems.append(System("idle (again)", "idle"))
    return systems


def rung(cap: int) -> System:
    """The ladder's row at a fixed bulk cap."""
    return System(f"sluice[cap {cap}]", "sluice", {"slo": {"bulk_cap_sequences": cap}}, ladder=cap)


def next_rung(
    systems: list[System], rows: list[dict[str, Any]], args: argparse.Namespace
) -> int | None:
    """The cap to measure after the row just measured (`rows[-1]`), when it was the ladder's
    top rung; else None. If it kept the frontier's share of chats, the frontier may lie above
    the ladder (a fast host): the ladder climbs by half again, up to the bulk streams. If it
    did not, and the rung that did with the most bulk is 3 or more below, the frontier lies
    between the two: one rung halfway, unless the ladder has it."""
    row = rows[-1]
    cap = row["ladder"]
    if not args.climb or cap is None or cap < max(s.ladder or 0 for s in systems):
        return None
    if row["within_slo"] is not None and row["within_slo"] >= args.frontier_share:
        higher = max(cap + 1, math.ceil(1.5 * cap))
        return higher if higher <= args.bulk_streams else None
    below = frontier(rows, args.frontier_share)
    if below is None or cap - below["ladder"] < 3:
        return None
    halfway = (cap + below["ladder"]) // 2
    return None if any(s.ladder == halfway for s in systems) else halfway


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default=None, help="model path (default: the demo model, built on first use)"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"subset of {SYSTEMS}")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        type=parse_variant,
        metavar="LABEL=YAML",
        help="another Sluice run with this configuration",
    )
    p.add_argument(
        "--root-variant",
        action="append",
        default=[],
        type=parse_root_variant,
        metavar="LABEL=PATH",
        help="another Sluice run in its default configuration, served by the checkout at "
        "PATH (e.g. one before a change: `git worktree add --detach PATH COMMIT`)",
    )
    p.add_argument(
        "--tradeoff",
        action="store_true",
        help=f"add Sluice runs at gap targets of {TRADEOFF_ITL_FACTORS} x the idle "
        "step, and one without the bulk cap",
    )
    p.add_argument(
        "--ladder",
        type=lambda text: [int(n) for n in text.split(",") if n.strip()],
        default=[2, 3, 4, 6],
        metavar="N,N,...",
        help="fixed bulk caps (slo.bulk_cap_sequences) whose best that keeps "
        "--frontier-share of chats within the SLO is the frontier ('' for none)",
    )
    p.add_argument(
        "--climb",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="while the ladder's top rung keeps --frontier-share of chats, add a rung half "
        "again as high; when one misses it, one between it and the highest that kept it",
    )
    p.add_argument(
        "--frontier-share",
        type=float,
        default=0.95,
        help="share of chats a ladder row must keep within the SLO to count for the frontier",
    )
    p.add_argument(
        "--stated-slo",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a Sluice row told the idle run's SLO in ms (slo.interactive.ttft_ms / itl_ms)",
    )
    p.add_argument(
        "--repeat", type=int, default=1, help="run the whole comparison this many times in a row"
    )
    p.add_argument(
        "--keep-servers",
        action="store_true",
        help="Sluice's own rows (not the ladder's) keep one server from the first run to the "
        "last, and every run is judged by the first run's SLO",
    )
    p.add_argument("--bulk-streams", type=int, default=96)
    p.add_argument("--bulk-tokens", type=int, default=512)
    p.add_argument(
        "--bulk-distinct",
        action="store_true",
        help="each bulk stream's prompt its own (default: all alike, as before)",
    )
    p.add_argument("--chat-rate", type=float, default=4.0, help="chats per second (Poisson)")
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument(
        "--chat-apis",
        default="chat",
        help=f"Sluice rows per API the chats speak, a subset of {CHAT_APIS} (chat: the plain "
        "'sluice' row)",
    )
    p.add_argument(
        "--slo-factor",
        type=float,
        default=3.0,
        help="a chat meets the SLO within this multiple of the idle TTFT p99 and median gap",
    )
    p.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    p.add_argument("--duration", type=float, default=60.0, help="seconds measured")
    p.add_argument("--port", type=int, default=8111)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument(
        "--sluice-engine",
        default="vllm",
        choices=("vllm", "sim"),
        help="Sluice's engine; 'sim' only to smoke-test this script without a model",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        help="extra argument for vLLM's server, e.g. --vllm-arg=--max-model-len=2048",
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="keep each server's output here, and each chat's timings (JSON lines)",
    )
    p.add_argument(
        "--adapters",
        action="store_true",
        help="both servers serve three demo LoRA adapters, two in one step (--max-loras 2): "
        f"the flood runs on {' and '.join(BULK_ADAPTERS)}, the chats on '{CHAT_ADAPTER}'",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument(
        "--report",
        nargs="+",
        default=None,
        metavar="FILE",
        help="run nothing: print the every-run table of saved --repeat --json outputs (of "
        "several: their runs in turn, as one series)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:  # a saved run's table again, with what was added to the report since
        runs = [run for path in args.report for run in json.loads(Path(path).read_text())]
        steady(runs, args.frontier_share)
        print(format_repeats(runs))
        return 0
    # SIGTERM (`kill`, `pkill`) ends a run as Ctrl-C does, through each server's stop: else the
    # server running then outlives the bench, and spoils whatever runs next on the machine.
    signal.signal(signal.SIGTERM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    # The same KV cache for every system (vLLM's CPU default is larger than this machine holds).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.model is None:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
        from engine_adapters.demo_model import build_demo_model
        from server.core.settings import default_cache_dir

        args.model = str(build_demo_model(default_cache_dir() / "demo-model"))
    elif Path(args.model).exists():  # (Sluice's servers run in their checkout's folder)
        args.model = str(Path(args.model).resolve())
    if args.adapters:  # (the demo model's: needs no --model)
        from engine_adapters.demo_model import build_demo_adapter
        from server.core.settings import default_cache_dir

        root = default_cache_dir() / "flood-adapters"
        args.adapters = [
            f"{name}={build_demo_adapter(root / name, Path(args.model), variant=variant)}"
            for variant, name in enumerate((*BULK_ADAPTERS, CHAT_ADAPTER), start=1)
        ]
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    runs = asyncio.run(compare_all(args))
    if args.json:
        print(json.dumps(runs, indent=2))
    elif args.repeat > 1:
        print(format_repeats(runs))
    return 0


async def compare_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """`--repeat` comparisons in a row. With `--keep-servers`, Sluice's own rows keep their
    servers from the first run to the last, and every run is judged by the SLO the first run's
    idle row set (the SLO those servers were told)."""
    async with contextlib.AsyncExitStack() as stack:
        kept = KeptServers(stack) if args.keep_servers else None
        runs = [await compare(args, 1, kept)]
        first = runs[0]["slo_ms"]
        first_slo = (first[0] / 1000, first[1] / 1000) if kept is not None and first else None
        for n in range(2, args.repeat + 1):
            runs.append(await compare(args, n, kept, first_slo))
    steady(runs, args.frontier_share)
    return runs


async def compare(
    args: argparse.Namespace,
    run: int,
    kept: KeptServers | None = None,
    slo: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """One whole comparison: every system of the plan in turn, each on a server of its own (or
    its kept one), judged by the SLO its idle row sets, or by `slo` where one is given."""
    rows: list[dict[str, Any]] = []
    given = slo is not None
    drift = None
    prefix = f"r{run}-" if args.repeat > 1 else ""
    systems = plan(args)
    for at, planned in enumerate(systems):  # (a rung climbed to joins the plan as it runs)
        system = planned.configured(slo)
        m = await run_system(system, args, prefix, kept)
        if args.log_dir:
            with (Path(args.log_dir) / f"{prefix}{system.name}.chats.jsonl").open("w") as out:
                for chat in m.chats:
                    out.write(json.dumps(vars(chat)) + "\n")
            if m.course:  # the gauges through the window, to read a controller's course by
                with (Path(args.log_dir) / f"{prefix}{system.name}.gauges.jsonl").open("w") as out:
                    for scrape in m.course:
                        out.write(json.dumps(scrape) + "\n")
        if system.kind == "idle" and slo is None:
            slo = idle_slo(m, args.slo_factor)
        elif system.kind == "idle" and slo is not None:
            again = idle_slo(m, args.slo_factor)
            drift = (again[0] / slo[0] - 1, again[1] / slo[1] - 1)  # (given: against run 1)
        rows.append({**summarise(system, m, args, slo), "ladder": system.ladder})
        print(f"# run {run}, {system.name}: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
        cap = next_rung(systems, rows, args)
        if cap is not None:
            systems.insert(at + 1, rung(cap))
    fcfs = next((r["bulk_tokens_per_s"] for r in rows if r["system"] == "vllm-fcfs"), None)
    point = frontier(rows, args.frontier_share)
    for row in rows:
        if fcfs and row["bulk_tokens_per_s"] is not None:
            row["bulk_vs_fcfs"] = round(row["bulk_tokens_per_s"] / fcfs, 3)
        if point and row["bulk_tokens_per_s"] is not None:
            row["bulk_vs_frontier"] = round(
                row["bulk_tokens_per_s"] / point["bulk_tokens_per_s"], 3
            )
    lines = [f"## Run {run} of {args.repeat}"] if args.repeat > 1 else []
    if slo is not None:
        lines.append(
            f"SLO: TTFT <= {1000 * slo[0]:.1f} ms and median gap <= {1000 * slo[1]:.2f} ms "
            f"({args.slo_factor:g} x the idle TTFT p99 and median gap"
            + (" of run 1: the kept servers hold it)" if given else ")")
        )
    if drift is not None:
        lines.append(
            f"Idle at the end against {'run 1' if given else 'the start'}: TTFT p99 "
            f"{drift[0]:+.0%}, median gap "
            f"{drift[1]:+.0%}"
            + (
                "  (the machine's speed drifted: compare with care)"
                if max(abs(d) for d in drift) > DRIFT_WARNING
                else ""
            )
        )
    if any(row["ladder"] for row in rows):
        lines.append(
            "Frontier: "
            + (
                f"{point['system']}, {point['bulk_tokens_per_s']:.1f} bulk tokens/s with "
                f"{100 * point['within_slo']:.1f}% of chats within the SLO"
                if point
                else f"no fixed cap kept {100 * args.frontier_share:g}% of chats within the SLO"
            )
        )
    if not args.json:
        print("\n".join([*lines, format_table(rows), ""]), flush=True)
    return {
        "run": run,
        "slo_ms": None if slo is None else [round(1000 * v, 3) for v in slo],
        "idle_drift": drift,
        "frontier": point,
        "rows": rows,
    }


def frontier(rows: list[dict[str, Any]], share: float) -> dict[str, Any] | None:
    """The ladder's point with the most bulk tokens/s among those that kept `share` of the
    chats within the SLO (None: none did)."""
    kept = [
        r for r in rows if r["ladder"] and r["within_slo"] is not None and r["within_slo"] >= share
    ]
    return max(kept, key=lambda r: r["bulk_tokens_per_s"], default=None)


def steady(runs: list[dict[str, Any]], share: float) -> str | None:
    """The steady frontier of runs in a row: the ladder's rung that kept `share` of the chats
    within the SLO in every run, with the most bulk over them all (None: none did). Each run's
    frontier is chosen in hindsight of that run, from rows a few minutes apart on a host whose
    speed wanders, so the rung at the edge passes in one run and fails in the next: it is the
    most that luck gives a fixed cap. The steady one is the fixed cap an operator could have
    chosen ahead on this host. Each run gets `steady_frontier` (its name) and each row with
    bulk `bulk_vs_steady`, against that rung's bulk in the same run."""
    rungs = [r["system"] for r in runs[0]["rows"] if r["ladder"]]

    def row(run: dict[str, Any], name: str) -> dict[str, Any] | None:
        return next((r for r in run["rows"] if r["system"] == name), None)

    def kept(name: str) -> bool:
        rows = [row(run, name) for run in runs]
        return all(r is not None and (r["within_slo"] or 0.0) >= share for r in rows)

    name = max(
        filter(kept, rungs),
        key=lambda n: sum(row(run, n)["bulk_tokens_per_s"] for run in runs),  # type: ignore[index]
        default=None,
    )
    for run in runs:
        run["steady_frontier"] = name
        point = None if name is None else row(run, name)
        for r in run["rows"]:
            if point and r["bulk_tokens_per_s"] is not None:
                r["bulk_vs_steady"] = round(r["bulk_tokens_per_s"] / point["bulk_tokens_per_s"], 3)
    return name


def format_repeats(runs: list[dict[str, Any]]) -> str:
    """Each Sluice row that is not on the ladder, run by run: chats within the SLO and bulk
    against the frontier, and against the steady one."""
    names = [r["system"] for r in runs[0]["rows"] if not r["ladder"]]
    name = runs[0].get("steady_frontier")
    lines = [
        "## Every run",
        f"Steady frontier: {name}, the fixed cap that kept the frontier's share of chats in "
        "every run"
        if name
        else "Steady frontier: none (no fixed cap kept the frontier's share of chats in every run)",
        "",
        "system | " + " | ".join(f"run {n}" for n in range(1, len(runs) + 1)),
        " | ".join("---" for _ in range(len(runs) + 1)),
    ]
    for name in names:
        cells = []
        for run in runs:
            row = next((r for r in run["rows"] if r["system"] == name), None)
            if row is None or row["within_slo"] is None:
                cells.append("-")
                continue
            cell = f"{100 * row['within_slo']:.1f}%"
            if row.get("bulk_vs_frontier") is not None:
                cell += f", {row['bulk_vs_frontier']:.3f}x frontier"
            if row.get("bulk_vs_steady") is not None:
                cell += f", {row['bulk_vs_steady']:.3f}x steady"
            cells.append(cell)
        lines.append(f"{name} | " + " | ".join(cells))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
