"""The chat page at / in a real headless Chromium: tokens stream in, Stop aborts the engine request
(and the stopped turn is not added to its conversation); conversations are made, continued,
listed again after a reload (their ids in the browser's localStorage, their titles and items
read from the Conversations API), renamed and deleted.

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
from typing import Any

import httpx
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
    conversation = None

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
            # The turn was made on a conversation (made for it), and a stopped turn is not
            # added to it: the page shows it as dropped.
            assert page.locator(".msg.dropped").count() == 2
            conversation = page.get_attribute("#conversation-list li.current", "data-id")
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
    assert conversation is not None and items(server, conversation) == []


def items(server: InProcessSluice, conversation: str) -> list[tuple[str, str]]:
    """(role, text) of the conversation's message items, oldest first, from the API."""
    url = f"{server.url}/v1/conversations/{conversation}/items?order=asc&limit=100"
    answer = httpx.get(url, timeout=10)
    answer.raise_for_status()
    return [
        (item["role"], "".join(part["text"] for part in item["content"]))
        for item in answer.json()["data"]
        if item["type"] == "message"
    ]


def shown(page: Any) -> list[tuple[str, str]]:
    """(role, text) of the messages the page shows."""
    return [
        (role, text)
        for role, text in page.evaluate(
            "[...document.querySelectorAll('.msg')].map((m) => [m.classList[1], m.textContent])"
        )
    ]


def titles(page: Any) -> list[str]:
    return page.eval_on_selector_all(
        "#conversation-list .title", "(ts) => ts.map((t) => t.textContent)"
    )


def send(page: Any, text: str) -> None:
    """A turn sent from the page, once it has ended."""
    count = page.locator(".msg").count()
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_function(
        f"document.querySelectorAll('.msg').length === {count + 2} "
        "&& document.body.dataset.state === 'idle'"
    )
    assert (page.text_content("#status") or "").startswith("done"), page.text_content("#status")


def load(page: Any, url: str) -> None:
    page.goto(url)
    page.wait_for_function(
        "document.querySelector('#model').options.length > 0 "
        "&& document.body.dataset.conversations === 'loaded'"
    )


def test_conversations_are_made_continued_listed_again_renamed_and_deleted(tmp_path: Path) -> None:
    chromium = require_tool("chromium")
    sync_playwright = _sync_playwright()
    with (
        run_sluice(tmp_path, "--served-model-name", "sluice-demo") as server,
        sync_playwright() as playwright,
    ):  # type: ignore[operator]
        browser = playwright.chromium.launch(
            executable_path=chromium, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 640})
            page.set_default_timeout(PAGE_TIMEOUT_MS)
            load(page, f"{server.url}/")
            assert titles(page) == [] and shown(page) == []
            page.fill("#max-tokens", "6")

            # The first turn makes a conversation, titled by it; the second continues it.
            send(page, "first question")
            send(page, "second question")
            [first] = page.eval_on_selector_all(
                "#conversation-list li", "(li) => li.map((l) => l.dataset.id)"
            )
            assert titles(page) == ["first question"]
            turns = shown(page)
            assert [role for role, _ in turns] == ["user", "assistant", "user", "assistant"]
            assert turns[0][1] == "first question" and turns[2][1] == "second question"
            assert items(server, first) == turns

            # Reloaded: the conversation is listed again and opened, its items read back.
            load(page, f"{server.url}/")
            assert titles(page) == ["first question"] and shown(page) == turns
            assert page.get_attribute("#conversation-list li.current", "data-id") == first

            # Renamed: its metadata's title.
            page.click("#conversation-list li .rename")
            page.fill("#conversation-list li input", "Boats")
            page.press("#conversation-list li input", "Enter")
            page.wait_for_function(
                "document.querySelector('#conversation-list .title')?.textContent === 'Boats'"
            )
            answer = httpx.get(f"{server.url}/v1/conversations/{first}", timeout=10).json()
            assert answer["metadata"] == {"title": "Boats"}

            # A new one, listed first; the first opened again from the list.
            page.click("#new-conversation")
            assert shown(page) == []
            send(page, "other topic")
            assert titles(page) == ["other topic", "Boats"]
            page.click("#conversation-list li:nth-child(2) .title")
            page.wait_for_function("document.querySelectorAll('.msg').length === 4")
            assert shown(page) == turns

            # Deleted (once confirmed): gone from the page, the API and the saved ids.
            page.once("dialog", lambda dialog: dialog.accept())
            page.click("#conversation-list li:nth-child(2) .delete")
            page.wait_for_function(
                "document.querySelectorAll('#conversation-list li').length === 1"
            )
            assert titles(page) == ["other topic"] and shown(page) == []
            assert (
                httpx.get(f"{server.url}/v1/conversations/{first}", timeout=10).status_code == 404
            )
            load(page, f"{server.url}/")
            assert titles(page) == ["other topic"]
            saved = page.evaluate("Object.values(localStorage)")
            assert len(saved) == 1 and first not in saved[0]
        finally:
            browser.close()


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
