"""When the vLLM engine dies: /ready fails, in-flight streams end with an error event and
[DONE], new requests get 503, and the process exits non-zero for its orchestrator.

The engine killed is the session's server's (`vllm_server`), after every other test of its
xdist group, the takeover test's use of it included (`ends_shared_server`, `ENDED_IN_ORDER`
in tests/conftest.py)."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator

import httpx
import psutil
import pytest
from conftest import SluiceProcess, wait_until


@pytest.fixture
def doomed_server(vllm_server: SluiceProcess) -> Iterator[SluiceProcess]:
    """The session's server, once its other tests are done with it: it exits 8 s after its
    engine's death (`--engine-death-exit-seconds`)."""
    try:
        yield vllm_server
    finally:
        vllm_server.stop()


def _engine_core(server: SluiceProcess) -> psutil.Process:
    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if "EngineCore" in " ".join([child.name(), *child.cmdline()]):
            return child
    raise AssertionError("no EngineCore process under the server")


@pytest.mark.ends_shared_server("vllm_server")
def test_engine_death_is_visible_and_fatal(doomed_server: SluiceProcess) -> None:
    events: list[str] = []
    first_token = threading.Event()

    def stream() -> None:
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            doomed_server.url + "/v1/chat/completions",
            json=body,
            headers={"X-Request-Timeout-Ms": "600000"},
            timeout=60,
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 3:
                        first_token.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first_token.wait(60)
    _engine_core(doomed_server).send_signal(signal.SIGKILL)
    reader.join(60)
    assert not reader.is_alive()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_unavailable"
    # The process notices: not ready, new requests refused, then it exits non-zero.
    wait_until(
        lambda: httpx.get(doomed_server.url + "/ready").status_code == 503,
        10,
        message="/ready fails",
    )
    refused = httpx.post(
        doomed_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "anyone?"}], "max_tokens": 4},
    )
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "engine_unavailable"
    assert "retry-after" in refused.headers
    assert doomed_server.proc.wait(timeout=60) != 0
    log = doomed_server.log()
    assert "engine died" in log
    assert "nanobind: leaked" not in log  # triton's report at interpreter teardown, skipped
