"""The Vercel AI SDK's default OpenAI model (`openai(model)`, which calls the Responses API)
against Sluice, as a Node user calls it: `generateText` and `streamText`, run by
tests/node/vercel_ai_sdk.mjs (the SDK at the versions tests/node/package-lock.json pins,
installed by scripts/install-test-deps.sh, which `make test` runs).

What the SDK reports (text, token usage, finish reason, the stream's text deltas) is checked
against the response Sluice stored under the id the SDK read (`GET /v1/responses/{id}`, with
the official `openai` client): on the real vLLM engine (the session's demo-model server), and
on the sim engine, whose model also stops by itself."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import (
    ROOT,
    InProcessSluice,
    SluiceProcess,
    missing,
    require_tool,
    sim_sluice,
)

# Node runs the client: a process of its own, as Chromium is for the chat page's test.
pytestmark = pytest.mark.system
NODE_CLIENTS = ROOT / "tests" / "node"
SCRIPT = NODE_CLIENTS / "vercel_ai_sdk.mjs"
NODE_TIMEOUT_S = 120.0
# The SDK's finish reasons for a response's status.
FINISH_REASONS = {"completed": "stop", "incomplete": "length"}


def run_ai_sdk(base_url: str, model: str, max_output_tokens: int, temperature: float) -> Any:
    """generateText's and streamText's results, as the Node script prints them."""
    node = require_tool("node")
    if not (NODE_CLIENTS / "node_modules" / "ai").is_dir():
        missing("tests/node's npm packages are not installed (run scripts/install-test-deps.sh)")
    done = subprocess.run(
        [
            node,
            str(SCRIPT),
            base_url + "/v1",
            model,
            "tell me a story",
            str(max_output_tokens),
            str(temperature),
        ],
        cwd=NODE_CLIENTS,
        capture_output=True,
        text=True,
        timeout=NODE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def check_against_the_stored_response(base_url: str, result: dict[str, Any]) -> None:
    """What the SDK reported is the stored response's: its text, usage and status."""
    import openai  # (~1 s to import: here, not when every pytest-xdist worker collects)

    assert result["text"] and result["warnings"] == []
    stored = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    response = stored.responses.retrieve(result["responseId"])
    assert response.output_text == result["text"]
    assert result["finishReason"] == FINISH_REASONS[response.status or ""]
    usage = response.usage
    assert usage is not None
    assert result["usage"] == {
        "inputTokens": usage.input_tokens,
        "outputTokens": usage.output_tokens,
        "totalTokens": usage.total_tokens,
    }
    assert 0 < usage.input_tokens and 0 < usage.output_tokens


def check_the_stream(streamed: dict[str, Any]) -> None:
    """One text part, its deltas making the text, between the stream's start and finish."""
    deltas, types = streamed["deltas"], streamed["partTypes"]
    assert "".join(deltas) == streamed["text"]
    assert types[:3] == ["start", "start-step", "text-start"]
    assert types[-3:] == ["text-end", "finish-step", "finish"]
    assert types[3:-3] == ["text-delta"] * len(deltas)


def test_generate_text_and_stream_text_on_vllm(vllm_server: SluiceProcess) -> None:
    """Greedy, so the streamed text is the generated one; 32 tokens, so the stream has many
    deltas (a random-weight model runs to its limit: finish reason "length")."""
    result = run_ai_sdk(vllm_server.url, "sluice-demo", 32, 0)
    generated, streamed = result["generateText"], result["streamText"]
    for each in (generated, streamed):
        check_against_the_stored_response(vllm_server.url, each)
    check_the_stream(streamed)
    assert len(streamed["deltas"]) >= 4
    assert streamed["text"] == generated["text"]
    assert streamed["usage"] == generated["usage"]
    assert generated["responseId"] != streamed["responseId"]


@pytest.fixture(scope="module")
def stopping_sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    """The sim engine, its model stopping by itself (a chance of 1 in 20 each token)."""
    root = tmp_path_factory.mktemp("vercel-sim")
    with sim_sluice(root, "--sim-eos-probability", "0.05") as server:
        yield server


def test_generate_text_and_stream_text_on_sim(stopping_sim: InProcessSluice) -> None:
    result = run_ai_sdk(stopping_sim.url, "sim", 400, 1)
    for each in result.values():
        check_against_the_stored_response(stopping_sim.url, each)
    check_the_stream(result["streamText"])
