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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from server.api.terminal import terminate_with_parent
from server.core.settings import add_arguments

Policy = Literal["cache_aware", "round_robin", "kv_aware", "power_of_two", "random"]
KV_EVENTS_PORT = 5557  # vLLM's default publisher port; replica i publishes on this + i
READY_TIMEOUT_S = 600.0


class FleetOptions(BaseModel):
    """The flags of `sluice fleet` (each replica's own `sluice serve` arguments apart)."""

    model_config = ConfigDict(frozen=True)

    replicas: int = Field(2, description="replicas of `sluice serve`")
    host: str = Field("127.0.0.1", description="address of the router and replicas")
    port: int = Field(8000, description="the router's port (replica i serves on PORT + i)")
    replica_port: int | None = Field(
        None,
        description="the first replica's port, the others' after it (default: --port + 1; 0: "
        "any free ports, bound here and handed to each replica)",
    )
    policy: Policy = Field(
        "cache_aware",
        description="the router's policy; kv_aware turns on each replica's KV-event publisher "
        "(--kv-events-config) and points the router at it",
    )
    state_url: str | None = Field(
        None, description="the replicas' Redis (default: a redis-server started here, in memory)"
    )
    router: str | None = Field(
        None, description="the vllm-router executable (default: beside this Python, else on PATH)"
    )
    router_metrics_port: int | None = Field(
        None, description="the router's own /metrics (default: the port after the replicas')"
    )
    router_arg: list[str] = Field(
        [],
        description="one more argument for the router (repeatable), e.g. "
        "--router-arg=--log-level=debug",
        json_schema_extra={"metavar": "ARG"},
    )


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    add_arguments(parser, FleetOptions)
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
    kv_model: str | None = None,
    more: Sequence[str] = (),
) -> list[str]:
    """vllm-router in front of `workers`; `kv_sources`: each worker's KV-event endpoint, for
    kv_aware (`kv_block_size`: the engine's KV block, which the router must hash alike;
    `kv_model`: the model the workers serve, which the router's index is kept for)."""
    command = [router, "--host", host, "--port", str(port), "--worker-urls", *workers]
    command += ["--policy", policy, "--prometheus-port", str(prometheus_port)]
    # /ready: a replica that drains, or whose engine died, answers 503 and is passed over.
    command += ["--health-check-endpoint", "/ready", "--health-check-interval-secs", "5"]
    for worker, endpoint in (kv_sources or {}).items():
        command += ["--kv-event-source", f"{worker}={endpoint}"]
    if kv_sources and kv_block_size is not None:
        command += ["--kv-event-block-size", str(kv_block_size)]
    if kv_sources and kv_model is not None:
        command += ["--kv-event-model", kv_model]
    return [*command, *more]


def replica_command(
    serve_args: Sequence[str], fd: int, state_url: str, kv_events_port: int | None
) -> list[str]:
    """`sluice serve` as a replica of the fleet: on the listening socket it inherits as `fd`,
    sharing `state_url`, publishing its KV events on `kv_events_port` (for kv_aware; None:
    not at all)."""
    command = [sys.executable, "-m", "server.cli", "serve", *serve_args]
    command += ["--fd", str(fd), "--state-url", state_url]
    if kv_events_port is not None:
        command += ["--kv-events-config", kv_events_config(kv_events_port)]
    return command


@dataclass
class Child:
    name: str
    command: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)  # set for the child, beside this one's
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self, listener: socket.socket | None = None) -> None:
        """`listener`: a listening socket the child inherits (its `--fd`), closed here."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env} if self.env else None,
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
        """Until the child and every process of its group (vLLM's engine processes outlive
        the server by seconds) are gone; SIGKILL to the group after `timeout`."""
        if self.proc is None:
            return
        deadline = time.monotonic() + timeout
        try:
            self.proc.wait(timeout)
            while time.monotonic() < deadline and self.group_alive():
                time.sleep(0.2)  # polling the group: nothing to wait on for its members
        except subprocess.TimeoutExpired:
            pass
        if self.group_alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def group_alive(self) -> bool:
        assert self.proc is not None
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        return True


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


def run(options: FleetOptions, serve_args: Sequence[str] = ()) -> int:
    """`sluice fleet`, its flags read (`server/cli.py`); `serve_args`: each replica's."""
    serve_args = [a for a in serve_args if a != "--"]
    router = find_router(options.router)
    # A short folder: a unix socket's path holds at most 107 bytes.
    workdir = Path(tempfile.mkdtemp(prefix="sluice-fleet-"))
    children: list[Child] = []
    stopping = False

    def interrupted(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:  # a second Ctrl-C: at once
            for child in children:
                child.signal(signal.SIGKILL)
            return
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    try:
        state_url = options.state_url
        if state_url is None:
            redis, state_url = redis_child(workdir)
            children.append(redis)
            redis.start()
        replicas = []
        kv_sources = {}
        first = options.port + 1 if options.replica_port is None else options.replica_port
        for i in range(1, options.replicas + 1):
            # Bound here (no port to race for between its choice and its use), inherited.
            listener = socket.create_server((options.host, first + i - 1 if first else 0))
            port = listener.getsockname()[1]
            url = f"http://{options.host}:{port}"
            publish = KV_EVENTS_PORT + i - 1 if options.policy == "kv_aware" else None
            command = replica_command(serve_args, listener.fileno(), state_url, publish)
            if publish is not None:
                kv_sources[url] = f"tcp://{options.host}:{publish}"
            replica = Child(f"replica {i} ({url})", command, workdir / f"replica-{i}.log")
            replicas.append((replica, url + "/ready"))
            children.append(replica)
            replica.start(listener)
            print(f"sluice fleet: replica {i} at {url}", flush=True)
        print(f"sluice fleet: {options.replicas} replicas starting; logs in {workdir}", flush=True)
        wait_ready(replicas, READY_TIMEOUT_S)
        one = replicas[0][1].removesuffix("/ready")
        block_size = kv_block_size(one) if kv_sources else None
        model = served_model(one) if kv_sources else None
        command = router_command(
            router,
            host=options.host,
            port=options.port,
            workers=[url.removesuffix("/ready") for _, url in replicas],
            policy=options.policy,
            prometheus_port=options.router_metrics_port or options.port + options.replicas + 1,
            kv_sources=kv_sources,
            kv_block_size=block_size,
            kv_model=model,
            more=options.router_arg,
        )
        front = Child("vllm-router", command, workdir / "router.log")
        children.append(front)
        front.start()
        wait_ready([(front, f"http://{options.host}:{options.port}/health")], 120)
        print(
            f"sluice fleet: vllm-router --policy {options.policy} at http://{options.host}:{options.port}"
            f" in front of {options.replicas} replicas (Ctrl-C stops them)",
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
        stop(children)


def stop(children: Sequence[Child]) -> None:
    """The router first, then every replica at once, each draining (SIGINT, as `sluice serve`
    takes Ctrl-C), Redis last once they are gone."""
    replicas = [child for child in children if "replica" in child.name]
    redis = [child for child in children if child.name == "redis"]
    front = [child for child in children if child not in replicas and child not in redis]
    for group in (front, replicas, redis):
        for child in group:
            child.signal(signal.SIGINT if child in replicas else signal.SIGTERM)
        for child in group:
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


def served_model(replica: str) -> str:
    """The model the replica serves, as its `/v1/models` names it first (the router keeps its
    KV index per model, and refuses static KV-event sources without one)."""
    try:
        with urllib.request.urlopen(replica + "/v1/models", timeout=5) as response:
            return str(json.load(response)["data"][0]["id"])
    except (urllib.error.URLError, OSError, KeyError, IndexError, ValueError) as exc:
        raise SystemExit(f"sluice fleet: {replica}/v1/models names no model: {exc}") from exc
