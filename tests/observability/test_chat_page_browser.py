"""The chat page at / in a real headless Chromium: tokens stream in, Stop aborts the engine request.

Chromium is the Debian package, driven by Playwright for Python (which never downloads a
browser here: it is given /usr/bin/chromium). The sim engine is slowed to ~25 tokens/s so the
page is seen mid-stream. It takes a screenshot mid-stream, into the test's tmp_path; with
`SLUICE_UPDATE_SCREENSHOT=1` into docs/chat-page.png (shown in docs/operations.md and
docs/observability.md), to update that picture after the page changes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import InProcessSluice, uncalibrated_config

from .conftest import REPO_ROOT, require_tool, run_sluice, wait_until

pytestmark = pytest.mark.browser

DOCS_SCREENSHOT = REPO_ROOT / "docs" / "chat-page.png"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PAGE_TIMEOUT_MS = 30_000
METRICS_TIMEOUT_S = 15.0


@pytest.fixture
def slow_sluice(tmp_path: Path) -> Iterator[InProcessSluice]:
    # One engine step per token at 40 ms: a 1,500-token answer would take a minute.
    # Uncalibrated (the probe would take ~13 s at 40 ms a step): the page sets its own deadline.
    config = uncalibrated_config(tmp_path)
    with run_sluice(
        tmp_path,
        "--served-model-name",
        "sluice-demo",
        "--sim-step-base-ms",
        "40",
        "--config",
        str(config),
    ) as s:
        yield s


def _screenshot_path(tmp_path: Path) -> Path:
    """docs/chat-page.png when SLUICE_UPDATE_SCREENSHOT asks for it; else the test's own
    directory, so that a run leaves the work tree as it found it."""
    if os.environ.get("SLUICE_UPDATE_SCREENSHOT") == "1":
        return DOCS_SCREENSHOT
    return tmp_path / "chat-page.png"


def _sync_playwright() -> object:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        message = "the playwright package is not installed (pip install playwright)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return sync_playwright


def test_tokens_stream_into_the_page_and_stop_aborts_the_engine_request(
    slow_sluice: InProcessSluice, tmp_path: Path
) -> None:
    chromium = require_tool("chromium")
    sync_playwright = _sync_playwright()
    server = slow_sluice
    aborts_before = server.metric("sluice_engine_aborts_total")

    with sync_playwright() as playwright:  # type: ignore[operator]
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 640})
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            page.goto(f"{server.url}/")
            page.wait_for_function("document.querySelector('#model').options.length > 0")
            assert page.input_value("#model") == "sluice-demo"

            page.fill("#max-tokens", "1500")
            # A minute of answer: more than the interactive default deadline (30 s), which the
            # calibrated scheduler would refuse as unmeetable. The page sets its own.
            page.fill("#timeout-ms", "600000")
            page.fill("#prompt", "How does a sluice gate control the flow of water?")
            page.click("#send")

            # Tokens arrive over time: the reply grows while the request is still streaming.
            reply = "document.querySelector('.msg.assistant')"
            page.wait_for_function(f"{reply} && {reply}.textContent.length > 0")
            first_length = len(page.text_content(".msg.assistant") or "")
            page.wait_for_function(
                f"{reply}.textContent.length > {first_length} "
                "&& Number(document.querySelector('#chunks').textContent) >= 5 "
                "&& document.body.dataset.state === 'streaming'"
            )
            assert page.text_content("#ttft").endswith(" ms")  # type: ignore[union-attr]
            assert page.text_content("#itl").endswith(" ms")  # type: ignore[union-attr]
            assert page.text_content("#status") == "streaming"
            assert page.is_enabled("#stop") and not page.is_enabled("#send")

            # The engine holds the request while the page streams it.
            wait_until(
                lambda: server.metric("sluice_engine_unfinished_requests") >= 1,
                timeout_s=METRICS_TIMEOUT_S,
                what="the engine to hold the page's request",
            )
            page.wait_for_function("Number(document.querySelector('#chunks').textContent) >= 40")
            page.screenshot(path=str(_screenshot_path(tmp_path)))

            page.click("#stop")
            page.wait_for_function("document.body.dataset.state === 'idle'")
            assert page.text_content("#status") == "stopped"
            stopped_length = len(page.text_content(".msg.assistant") or "")
            assert stopped_length > first_length
        finally:
            browser.close()

    # Closing the connection made Sluice abort the engine request.
    wait_until(
        lambda: (
            server.metric("sluice_engine_unfinished_requests") == 0
            and server.metric("sluice_engine_aborts_total") > aborts_before
        ),
        timeout_s=METRICS_TIMEOUT_S,
        what="sluice_engine_unfinished_requests to return to 0 and an engine abort",
    )
    assert server.metric("sluice_cancellations_total", stage="running") >= 1


def test_chromium_authenticates_the_websocket_with_the_bearer_subprotocol(tmp_path: Path) -> None:
    """`new WebSocket(url, ["sluice.bearer." + key])`: a browser's way to send a key."""
    chromium = require_tool("chromium")
    sync_playwright = _sync_playwright()
    key = "sk-browser-5e1d"
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with (
        run_sluice(tmp_path, env={"SLUICE_API_KEYS": f"{key}:acme"}) as server,
        sync_playwright() as playwright,
    ):  # type: ignore[operator]
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = browser.new_page()
            page.goto(f"{server.url}/")
            result = page.evaluate(
                """([url, key, request]) => new Promise((resolve) => {
                const ws = new WebSocket(url, ["sluice.bearer." + key]);
                ws.onopen = () => ws.send(JSON.stringify(
                    {type: "generate", id: "b", request: request}));
                ws.onmessage = (event) => {
                    const message = JSON.parse(event.data);
                    if (message.type !== "delta") {
                        resolve({protocol: ws.protocol, type: message.type});
                        ws.close();
                    }
                };
                ws.onerror = () => resolve({protocol: null, type: "socket error"});
            })""",
                [server.url.replace("http://", "ws://") + "/v1/ws", key, request],
            )
        finally:
            browser.close()
    assert result == {"protocol": f"sluice.bearer.{key}", "type": "final"}
