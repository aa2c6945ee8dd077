"""`sluice fleet`: Redis, replicas and vLLM's router in one command, on the sim engine; and the
router's command lines as the router's own parser reads them."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
from conftest import ROOT, require_tool, reserved_port, uncalibrated_config, wait_until

from server.fleet import kv_events_config, router_command

CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def test_the_routers_own_parser_reads_what_the_fleet_passes() -> None:
    from vllm_router.launch_router import parse_router_args

    workers = ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    sources = {url: f"tcp://127.0.0.1:{5557 + i}" for i, url in enumerate(workers)}
    command = router_command(
        "vllm-router",
        host="127.0.0.1",
        port=8000,
        workers=workers,
        policy="kv_aware",
        prometheus_port=8003,
        kv_sources=sources,
        kv_block_size=128,
        kv_model="sluice-demo",
    )
    args = parse_router_args(command[1:])
    assert args.worker_urls == workers and args.policy == "kv_aware"
    assert args.kv_event_source == [f"{url}={endpoint}" for url, endpoint in sources.items()]
    assert args.kv_event_block_size == 128 and args.kv_event_model == "sluice-demo"
    assert args.health_check_endpoint == "/ready"  # a draining replica is passed over
    # The replica's side: vLLM's KV-event publisher on the empty topic, which the router's
    # static sources read.
    assert '"topic": ""' in kv_events_config(5557)


@pytest.mark.system  # Redis, replicas and the router, each a process of its own
def test_one_command_serves_through_the_router_and_ctrl_c_stops_it_all(tmp_path: Path) -> None:
    require_tool("redis-server")
    port = reserved_port()
    config = uncalibrated_config(tmp_path)
    log = open(tmp_path / "fleet.log", "wb")
    command = ["fleet", "--port", str(port), "--replica-port", "0"]
    command += ["--router-metrics-port", str(reserved_port())]
    command += ["--", "--engine", "sim", "--config", str(config)]
    fleet = subprocess.Popen(
        [sys.executable, "-m", "server.cli", *command],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        process_group=0,
    )
    output = tmp_path / "fleet.log"
    try:
        wait_until(lambda: "in front of 2 replicas" in output.read_text(), 180, 0.2)
        replicas = re.findall(r"replica \d at (http://\S+)", output.read_text())
        assert len(replicas) == 2
        children = psutil.Process(fleet.pid).children(recursive=True)
        assert len(children) >= 4  # Redis, two replicas, the router (and engines' helpers)
        from openai import OpenAI

        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        answer = client.chat.completions.create(model="sim", **CHAT)
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
        assert all(httpx.get(url + "/ready").status_code == 200 for url in replicas)
        fleet.send_signal(signal.SIGINT)  # Ctrl-C: the router stops, the replicas drain
        assert fleet.wait(timeout=90) == 0
        wait_until(lambda: not any(child.is_running() for child in children), 30)
        for url in replicas:
            try:
                httpx.get(url + "/health", timeout=2)
            except httpx.ConnectError:
                continue
            raise AssertionError(f"{url} still answers")
    finally:
        if fleet.poll() is None:
            os.killpg(fleet.pid, signal.SIGKILL)
        log.close()
