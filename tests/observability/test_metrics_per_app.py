"""Each app records into a registry of its own: two servers in one process keep apart counts."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import InProcessSluice, uncalibrated_config

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_two_servers_in_one_process_count_only_their_own_requests(tmp_path: Path) -> None:
    config = uncalibrated_config(tmp_path)  # what they count, not how fast
    args = ["--engine", "sim", "--config", str(config)]
    first = InProcessSluice(args, tmp_path / "first.log")
    second = InProcessSluice(args, tmp_path / "second.log")
    try:
        first.wait_ready(60)
        second.wait_ready(60)
        for _ in range(3):
            assert httpx.post(first.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert httpx.post(second.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert first.metric("sluice_requests_total", outcome="completed") == 3
        assert first.metric("sluice_generated_tokens_total") == 12
        assert second.metric("sluice_requests_total", outcome="completed") == 1
        assert second.metric("sluice_generated_tokens_total") == 4
    finally:
        first.stop()
        second.stop()
