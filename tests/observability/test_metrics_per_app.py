"""Each app records into a registry of its own: two servers in one process keep apart counts."""

from __future__ import annotations

from pathlib import Path

import httpx
from conftest import all_ready, sim_sluice

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_two_servers_in_one_process_count_only_their_own_requests(tmp_path: Path) -> None:
    # Uncalibrated: what they count, not how fast.
    started = [sim_sluice(tmp_path, log=f"{name}.log") for name in ("first", "second")]
    with all_ready(started) as (first, second):
        for _ in range(3):
            assert httpx.post(first.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert httpx.post(second.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert first.metric("sluice_requests_total", outcome="completed") == 3
        assert first.metric("sluice_generated_tokens_total") == 12
        assert second.metric("sluice_requests_total", outcome="completed") == 1
        assert second.metric("sluice_generated_tokens_total") == 4
