"""Chats while bulk fills every engine seat: the sim engine with 32 seats, bulk beyond them.

Each phase starts its own Sluice on the sim engine (`--sim-step-base-ms 5
--sim-decode-ms-per-token 0.02 --sim-max-num-seqs 32`, the default configuration otherwise), in
its own process group, and offers one load:

* idle: chats alone, a Poisson process at `--chat-rate` per second (4), each for
  `--chat-tokens` (32). Its TTFT p99 and median gap set the SLO of the phases with chats: a chat
  meets it within `--slo-factor` (3) x both;
* bulk: `--bulk-streams` (64) closed-loop bulk streams of `--bulk-tokens` (256), twice the
  engine's seats, no chats: bulk's tokens/s on its own;
* flood: the same streams with the chats: the chats' share within the SLO, and bulk's tokens/s
  against the bulk phase's;
* batch: a `--batch-lines` (2,000) Batch API job (lines as bench/batch.py's) with the chats,
  measured from `--warmup` seconds after the batch starts until it ends (or `--duration`): the
  chats' TTFT p99 against idle's.

As in bench/flood.py, the bulk streams run in their own process and count tokens without
parsing JSON, so the chat client's stopwatch measures the server. Targets: >= 95% of the
flood's chats within the SLO, flood bulk tokens/s >= 0.9 x the bulk phase's, the flood's and
the batch phase's chat TTFT p95 <= 2 x idle's (a freeze of a shared host can land in one p99;
it cannot move the p95; the p99 ratios are reported beside them).

    python bench/seat_flood.py [--duration 20] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import httpx
from batch import batch_lines
from flood import (
    SERVED_NAME,
    Measurements,
    System,
    bulk_load_process,
    chat_arrivals,
    idle_slo,
    stop_group,
    wait_ready,
)

from server.core.stats import quantile

PHASES = ("idle", "bulk", "flood", "batch")
SIM_FLAGS = ("--sim-step-base-ms", "5", "--sim-decode-ms-per-token", "0.02")


@dataclass
class Phase:
    name: str
    measurements: Measurements
    batch_lines_done: int | None = None


def server_command(args: argparse.Namespace, port: int, data_dir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--engine",
        "sim",
        *SIM_FLAGS,
        "--sim-max-num-seqs",
        str(args.seats),
        "--served-model-name",
        SERVED_NAME,
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--data-dir",
        data_dir,
    ]


async def start_batch(client: httpx.AsyncClient, lines: int) -> str:
    upload = await client.post(
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("lines.jsonl", batch_lines(lines))},
        timeout=60,
    )
    upload.raise_for_status()
    batch = await client.post(
        "/v1/batches",
        json={
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    batch.raise_for_status()
    return str(batch.json()["id"])


async def batch_counts(client: httpx.AsyncClient, batch_id: str) -> tuple[str, int]:
    batch = (await client.get(f"/v1/batches/{batch_id}")).json()
    return batch["status"], int(batch["request_counts"]["completed"])


async def until_batch_ends(
    client: httpx.AsyncClient, batch_id: str, m: Measurements, stop: asyncio.Event
) -> int:
    """Polls the batch until it ends or `stop`; the measurement window closes as it ends.
    Returns the lines completed in the window."""
    first = None
    done = 0
    while not stop.is_set():
        status, done = await batch_counts(client, batch_id)
        if first is None and time.monotonic() >= m.window_start:
            first = done
        if status in ("completed", "failed", "expired", "cancelled"):
            m.window_end = min(m.window_end, time.monotonic())
            stop.set()
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.25)  # polling the batch's counts
    return done - (first or 0)


async def measure(phase: str, args: argparse.Namespace, log: Any) -> Phase:
    data_dir = tempfile.mkdtemp(prefix="sluice-seat-flood-")
    process = await asyncio.create_subprocess_exec(
        *server_command(args, args.port, data_dir),
        env={**os.environ, "SLUICE_API_KEYS": ""},
        stdout=log or subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        process_group=0,  # its own group (to stop it whole), not a new session
    )
    limits = httpx.Limits(max_connections=args.bulk_streams + 256)
    m = Measurements()
    result = Phase(phase, m)
    try:
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{args.port}", limits=limits, timeout=httpx.Timeout(600.0)
        ) as client:
            await wait_ready(client, process, args.ready_timeout)
            batch_id = await start_batch(client, args.batch_lines) if phase == "batch" else None
            now, wall = time.monotonic(), time.time()
            m.window_start, m.window_end = now + args.warmup, now + args.warmup + args.duration
            window = (wall + args.warmup, wall + args.warmup + args.duration)
            bulk = None
            if phase in ("bulk", "flood"):
                context = multiprocessing.get_context("spawn")
                results = context.Queue()
                release = context.Event()  # the flood stops after the window's last chat
                bulk = context.Process(
                    target=bulk_load_process,
                    args=("sluice", args, args.port, window, release, results),
                    daemon=True,  # a phase that fails before the release does not outlive it
                )
                bulk.start()
            stop = asyncio.Event()
            sluice = System("sluice", "sluice")
            chats = (
                asyncio.create_task(chat_arrivals(client, sluice, args, m, stop))
                if phase != "bulk"
                else None
            )
            batch = (
                asyncio.create_task(until_batch_ends(client, batch_id, m, stop))
                if batch_id is not None
                else None
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.warmup + args.duration)
            stop.set()
            if chats is not None:
                await chats
            if batch is not None:
                result.batch_lines_done = await batch
            if bulk is not None:
                release.set()
                counts = await asyncio.to_thread(results.get, True, 120)
                bulk.join(30)
                m.bulk_tokens, m.bulk_failures = counts["tokens"], counts["failures"]
    finally:
        await stop_group(process)
    return result


def summarise(
    phase: Phase, args: argparse.Namespace, slo: tuple[float, float] | None
) -> dict[str, Any]:
    m = phase.measurements
    seconds = min(m.window_end, m.window_start + args.duration) - m.window_start
    median_gaps = [c.median_gap_s for c in m.chats if c.median_gap_s is not None]
    row: dict[str, Any] = {
        "phase": phase.name,
        "seconds": round(seconds, 1),
        "chats": len(m.chats),
        "chat_failures": m.chat_failures,
        "ttft_p50_ms": _ms(quantile([c.ttft_s for c in m.chats], 0.5)),
        "ttft_p95_ms": _ms(quantile([c.ttft_s for c in m.chats], 0.95)),
        "ttft_p99_ms": _ms(quantile([c.ttft_s for c in m.chats], 0.99)),
        "gap_p50_ms": _ms(quantile([g for c in m.chats for g in c.gaps_s], 0.5)),
        "chat_median_gap_p99_ms": _ms(quantile(median_gaps, 0.99)),
        "bulk_tokens_per_s": round(m.bulk_tokens / seconds, 1) if m.bulk_tokens else None,
        "bulk_failures": m.bulk_failures,
        "batch_lines_per_s": (
            round(phase.batch_lines_done / seconds, 1)
            if phase.batch_lines_done is not None
            else None
        ),
        "within_slo": None,
    }
    if slo is not None and (m.chats or m.chat_failures):
        ttft_limit, gap_limit = slo
        met = sum(
            1
            for c in m.chats
            if c.ttft_s <= ttft_limit and (c.median_gap_s is None or c.median_gap_s <= gap_limit)
        )
        row["within_slo"] = round(met / (len(m.chats) + m.chat_failures), 4)
    return row


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 1)


def verdict(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The targets, each with its measured value."""
    out: dict[str, Any] = {}
    idle, bulk, flood, batch = (rows.get(p) for p in PHASES)
    if flood is not None:
        out["flood_within_slo"] = flood["within_slo"]
    if flood is not None and bulk is not None and bulk["bulk_tokens_per_s"]:
        out["flood_bulk_vs_bulk_alone"] = round(
            (flood["bulk_tokens_per_s"] or 0) / bulk["bulk_tokens_per_s"], 3
        )
    # A chat's TTFT beside bulk beyond the seats, and beside a batch job, against idle: the p95
    # (a freeze of the host can land in one p99; it cannot move the p95), the p99 reported.
    for name, row in (("flood", flood), ("batch", batch)):
        if row is not None and idle is not None and idle["ttft_p95_ms"]:
            for q in ("p95", "p99"):
                ratio = (row[f"ttft_{q}_ms"] or 0) / idle[f"ttft_{q}_ms"]
                out[f"{name}_ttft_{q}_vs_idle"] = round(ratio, 2)
    out["met"] = (
        (out.get("flood_within_slo") or 0) >= 0.95
        and out.get("flood_bulk_vs_bulk_alone", 0) >= 0.9
        and out.get("flood_ttft_p95_vs_idle", float("inf")) <= 2.0
        and out.get("batch_ttft_p95_vs_idle", float("inf")) <= 2.0
    )
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phases", default=",".join(PHASES), help=f"subset of {PHASES}")
    p.add_argument("--seats", type=int, default=32, help="the sim engine's max_num_seqs")
    p.add_argument("--bulk-streams", type=int, default=64)
    p.add_argument("--bulk-tokens", type=int, default=256)
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--chat-rate", type=float, default=4.0, help="chats per second (Poisson)")
    p.add_argument("--chat-tokens", type=int, default=32)
    p.add_argument("--slo-factor", type=float, default=3.0)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    p.add_argument("--duration", type=float, default=20.0, help="seconds measured (at most)")
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=120.0)
    p.add_argument("--log-dir", default=None, help="keep each phase's server output here")
    p.add_argument("--json", action="store_true", help="print JSON only")
    p.add_argument("--repeat", type=int, default=1, help="run every phase this many times")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    phases = [p for p in args.phases.split(",") if p]
    if unknown := set(phases) - set(PHASES):
        raise SystemExit(f"unknown phases: {sorted(unknown)}")
    reports = [one_run(args, phases, run) for run in range(1, args.repeat + 1)]
    print(json.dumps(reports[0] if args.repeat == 1 else reports, indent=2))
    return 0


def one_run(args: argparse.Namespace, phases: list[str], run: int) -> dict[str, Any]:
    rows: dict[str, dict[str, Any]] = {}
    slo: tuple[float, float] | None = None
    prefix = f"r{run}-" if args.repeat > 1 else ""
    for phase in phases:
        with contextlib.ExitStack() as stack:
            log = None
            if args.log_dir:
                os.makedirs(args.log_dir, exist_ok=True)
                path = os.path.join(args.log_dir, f"{prefix}{phase}.log")
                log = stack.enter_context(open(path, "wb"))
            result = asyncio.run(measure(phase, args, log))
        if phase == "idle":
            slo = idle_slo(result.measurements, args.slo_factor)
        rows[phase] = summarise(result, args, slo)
        print(f"# run {run}, {phase}: {json.dumps(rows[phase])}", file=sys.stderr, flush=True)
    report: dict[str, Any] = {"run": run, "phases": list(rows.values()), "targets": verdict(rows)}
    if slo is not None:
        report["slo"] = {"ttft_ms": _ms(slo[0]), "median_gap_ms": _ms(slo[1])}
    return report


if __name__ == "__main__":
    sys.exit(main())
