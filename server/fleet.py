"""`sluice fleet`: a fleet on this host in one command, to try what a deployment does. Redis
(started here unless `--state-url` names one), N replicas of `sluice serve` sharing it, and
vLLM's router (`vllm-router`, from PyPI) in front of them, as deploy/compose.yaml and
deploy/kubernetes/ run them.

Each child runs in a process group of its own, so that Ctrl-C reaches this process alone: the
first stops the router and drains the replicas (SIGINT, as `sluice serve` takes it), a second
kills everything. A child that exits on its own stops the fleet.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from server.api.terminal import terminate_with_parent

POLICIES = ("cache_aware", "round_robin", "kv_aware", "power_of_two", "random")
KV_EVENTS_PORT = 5557  # vLLM's default publisher port; replica i publishes on this + i
READY_TIMEOUT_S = 600.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="replicas of `sluice serve`")
    parser.add_argument("--host", default="127.0.0.1", help="address of the router and replicas")
    parser.add_argument(
        "--port", type=int, default=8000, help="the router's port (replica i serves on PORT + i)"
    )
    parser.add_argument(
        "--replica-port",
        type=int,
        default=None,
        help="the first replica's port, the others' after it (default: --port + 1; 0: any "
        "free ports, bound here and handed to each replica)",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="cache_aware",
        help="the router's policy; kv_aware turns on each replica's KV-event publisher "
        "(--kv-events-config) and points the router at it",
    )
    parser.add_argument(
        "--state-url",
        default=None,
        help="the replicas' Redis (default: a redis-server started here, in memory)",
    )
    parser.add_argument(
        "--router",
        default=None,
        help="the vllm-router executable (default: beside this Python, else on PATH)",
    )
    parser.add_argument(
        "--router-metrics-port",
        type=int,
        default=None,
        help="the router's own /metrics (default: the port after the replicas')",
    )
    parser.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the router (repeatable), e.g. --router-arg=--log-level=debug",
    )
    parser.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="after --: each replica's `sluice serve` arguments (default: the demo model on vLLM)",
    )


def find_router(given: str | None = None) -> str:
    """The vllm-router executable: `given`, beside this Python (a venv's), or on PATH."""
    if given:
        return given
    beside = Path(sys.executable).with_name("vllm-router")
    if beside.exists():
        return str(beside)
    found = shutil.which("vllm-router")
    if found is None:
        raise SystemExit("sluice fleet: vllm-router not found (pip install vllm-router)")
    return found


def kv_events_config(port: int) -> str:
    """vLLM's `--kv-events-config` for a replica publishing on `port` (all interfaces)."""
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{port}",
            "topic": "",  # vllm-router reads static sources on the empty topic only
        }
    )


def router_command(
    router: str,
    *,
    host: str,
    port: int,
    workers: Sequence[str],
    policy: str,
    prometheus_port: int,
    kv_sources: dict[str, str] | None = None,
    kv_block_size: int | None = None,
    more: Sequence[str] = (),
) -> list[str]:
    """vllm-router in front of `workers`; `kv_sources`: each worker's KV-event endpoint, for
    kv_aware (`kv_block_size`: the engine's KV block, which the router must hash alike)."""
    command = [router, "--host", host, "--port", str(port), "--worker-urls", *workers]
    command += ["--policy", policy, "--prometheus-port", str(prometheus_port)]
    # /ready: a replica that drains, or whose engine died, answers 503 and is passed over.
    command += ["--health-check-endpoint", "/ready", "--health-check-interval-secs", "5"]
    for worker, endpoint in (kv_sources or {}).items():
        command += ["--kv-event-source", f"{worker}={endpoint}"]
    if kv_sources and kv_block_size is not None:
        command += ["--kv-event-block-size", str(kv_block_size)]
    return [*command, *more]


@dataclass
class Child:
    name: str
    command: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, listener: socket.socket | None = None) -> None:
        """`listener`: a listening socket the child inherits (its `--fd`), closed here."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,  # Ctrl-C reaches the fleet alone; it signals each child
                pass_fds=() if listener is None else (listener.fileno(),),
                # SIGTERM when the fleet dies, however: a killed fleet leaves nothing behind.
                preexec_fn=terminate_with_parent,
            )
        if listener is not None:
            listener.close()  # the child's copy alone: once it exits, connecting is refused

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)


def answers(url: str, timeout: float = 2.0) -> bool:
    """Whether GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(children: Sequence[tuple[Child, str]], timeout: float) -> None:
    """Until each child's URL answers 200; SystemExit if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    waiting = list(children)
    while waiting:
        for child, url in list(waiting):
            if not child.running():
                raise SystemExit(f"sluice fleet: {child.name} exited; see {child.log}")
            if answers(url):
                waiting.remove((child, url))
        if time.monotonic() > deadline:
            names = ", ".join(child.name for child, _ in waiting)
            raise SystemExit(f"sluice fleet: not ready in {timeout:.0f} s: {names}")
        if waiting:
            time.sleep(0.5)  # polling start-up (engines take tens of seconds)


def redis_child(directory: Path) -> tuple[Child, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("sluice fleet: redis-server not found: install it, or pass --state-url")
    socket_path = directory / "redis.sock"
    command = [binary, "--port", "0", "--unixsocket", str(socket_path), "--save", ""]
    command += ["--appendonly", "no", "--dir", str(directory)]
    return Child("redis", command, directory / "redis.log"), f"unix://{socket_path}?db=0"


def run(args: argparse.Namespace) -> int:
    serve_args = [a for a in args.serve_args if a != "--"] if args.serve_args else []
    router = find_router(args.router)
    # A short folder: a unix socket's path holds at most 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="sluice-fleet-"))
    children: list[Child] = []
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:  # a second Ctrl-C: at once
            for child in children:
                child.signal(signal.SIGKILL)
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        state_url = args.state_url
        if state_url is None:
            redis, state_url = redis_child(workdir)
            children.append(redis)
            redis.start()
        replicas = []
        kv_sources = {}
        first = args.port + 1 if args.replica_port is None else args.replica_port
        for i in range(1, args.replicas + 1):
            # Bound here (no port to race for between its choice and its use), inherited.
            listener = socket.create_server((args.host, first + i - 1 if first else 0))
            port = listener.getsockname()[1]
            url = f"http://{args.host}:{port}"
            command = [sys.executable, "-m", "server.cli", "serve", *serve_args]
            command += ["--fd", str(listener.fileno()), "--state-url", state_url]
            if args.policy == "kv_aware":
                publish = KV_EVENTS_PORT + i - 1
                command += ["--kv-events-config", kv_events_config(publish)]
                kv_sources[url] = f"tcp://{args.host}:{publish}"
            replica = Child(f"replica {i} ({url})", command, workdir / f"replica-{i}.log")
            replicas.append((replica, url + "/ready"))
            children.append(replica)
            replica.start(listener)
            print(f"sluice fleet: replica {i} at {url}", flush=True)
        print(f"sluice fleet: {args.replicas} replicas starting; logs in {workdir}", flush=True)
        wait_ready(replicas, READY_TIMEOUT_S)
        block_size = kv_block_size(replicas[0][1].removesuffix("/ready")) if kv_sources else None
        command = router_command(
            router,
            host=args.host,
            port=args.port,
            workers=[url.removesuffix("/ready") for _, url in replicas],
            policy=args.policy,
            prometheus_port=args.router_metrics_port or args.port + args.replicas + 1,
            kv_sources=kv_sources,
            kv_block_size=block_size,
            more=args.router_arg,
        )
        front = Child("vllm-router", command, workdir / "router.log")
        children.append(front)
        front.start()
        wait_ready([(front, f"http://{args.host}:{args.port}/health")], 120)
        print(
            f"sluice fleet: vllm-router --policy {args.policy} at http://{args.host}:{args.port}"
            f" in front of {args.replicas} replicas (Ctrl-C stops them)",
            flush=True,
        )
        while all(child.running() for child in children):
            time.sleep(1)  # supervising: a child that exits stops the fleet
        gone = next(child for child in children if not child.running())
        print(f"sluice fleet: {gone.name} exited; stopping (see {gone.log})", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for child in reversed(children):  # the router first, Redis last
            child.signal(signal.SIGINT if child.name.startswith("replica") else signal.SIGTERM)
            child.wait(60)


def kv_block_size(replica: str) -> int:
    """The replica's KV block size, as its `vllm:cache_config_info` says (the router hashes
    the request's tokens in blocks of this size to match the replica's KV events)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(replica + "/metrics", timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                return int(sample.labels["block_size"])
    raise SystemExit(f"sluice fleet: {replica}/metrics says no vllm:cache_config_info")
