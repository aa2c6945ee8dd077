"""`sluice serve --engine sim-batch` over HTTP: a real uvicorn server on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import InProcessSluice  # tests/conftest.py, the shared server fixtures


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessSluice]:
    args = ["--workers", "2", "--batch-ms", "20", "--max-batch", "4", "--max-delay-ms", "5"]
    log = Path(tmp_path_factory.mktemp("sim-batch")) / "server.log"
    with InProcessSluice(["--engine", "sim-batch", *args], log) as server:
        yield server


def complete(server: InProcessSluice, prompt: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/completions",
        json={"model": "sluice-demo", "prompt": prompt, "max_tokens": 5},
        timeout=30,
    )


def test_a_completion_is_served_as_one_batch_result(batch_server: InProcessSluice) -> None:
    batches = batch_server.metric("sluice_batch_size_count", model="sluice-demo")
    response = complete(batch_server, "hello")
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert response.json()["usage"]["completion_tokens"] == 5
    assert batch_server.metric("sluice_batch_size_count", model="sluice-demo") == batches + 1


def test_a_poison_prompt_fails_with_a_clear_error(batch_server: InProcessSluice) -> None:
    failures = batch_server.metric("sluice_worker_failures_total", model="sluice-demo")
    response = complete(batch_server, "this prompt is POISON")
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["code"] == "generation_failed" and "alone" in error["message"]
    assert batch_server.metric("sluice_worker_failures_total", model="sluice-demo") > failures


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("logprobs", 1),
        ("prompt_logprobs", 0),
        ("n", 2),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_what_fixed_batches_cannot_do_is_refused_naming_the_engine(
    batch_server: InProcessSluice,
    field: str,
    value: object,
) -> None:
    response = httpx.post(
        batch_server.url + "/v1/completions",
        timeout=30,
        json={"model": "sluice-demo", "prompt": "hello", "max_tokens": 5, field: value},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == field
    assert "sim-batch" in error["message"]
