"""vLLM's router (`vllm-router`, the real binary) in front of two Sluice replicas on the real
vLLM engine, sharing one Redis: every API through it, a stored response and a batch found from
either replica, a keyed stream resumed through it, and routing by prefix (`cache_aware` from
Sluice's render endpoint, `kv_aware` from the engines' own KV events).

The session's vLLM server is one replica; the second is the session's spare replica (two seats:
the preemption test's server too; the takeover test kills it afterwards, tests/conftest.py).
Both publish vLLM's KV events (their `--kv-events-config`). Assertions on text hold on any CPU:
the demo model's greedy text is decisive (docs/testing.md), and a resumed stream is compared
with the same generation's replay, not with a second generation.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import pytest
from conftest import RouterProcess, SharedServer, SluiceProcess, parse_sse, wait_until

# `anthropic` and `openai` (~1.3 s and ~0.5 s to import) where they are called: every pytest-xdist
# worker collects this module, and `make test-quick` runs none of it.
if TYPE_CHECKING:
    from openai import OpenAI

MODEL = "sluice-demo"
# Long enough for two of the CPU backend's 128-token KV blocks, and the same on every run: a
# conversation whose second turn finds its first turn's blocks cached on the replica it lands on.
SYSTEM = " ".join(f"rule {i}: answer plainly and briefly." for i in range(60))


@pytest.fixture(scope="module")
def second_replica(spare_replica: SharedServer) -> SluiceProcess:
    """Another replica beside the session's vLLM server, on its Redis."""
    return spare_replica.get()


@pytest.fixture(scope="module")
def replicas(vllm_server: SluiceProcess, second_replica: SluiceProcess) -> list[SluiceProcess]:
    return [vllm_server, second_replica]


@pytest.fixture(scope="module")
def router(
    replicas: list[SluiceProcess], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RouterProcess]:
    workers = [replica.url for replica in replicas]
    log = tmp_path_factory.mktemp("router") / "router.log"
    with RouterProcess(workers, log, policy="cache_aware") as front:
        yield front


def client(router: RouterProcess) -> OpenAI:
    from openai import OpenAI

    return OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"question {turn}"})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {turn}"})
    return messages


def test_chat_and_completions_answer_through_the_router(router: RouterProcess) -> None:
    openai = client(router)
    whole = openai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert whole.choices[0].message.content and whole.usage and whole.usage.completion_tokens
    chunks = list(
        openai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert streamed and usage is not None and usage.completion_tokens == 8
    completion = openai.completions.create(model=MODEL, prompt="Once upon", max_tokens=6)
    assert completion.choices[0].text and completion.usage and completion.usage.completion_tokens


def test_anthropic_messages_answer_through_the_router(router: RouterProcess) -> None:
    from anthropic import Anthropic

    anthropic = Anthropic(base_url=router.url, api_key="unused", max_retries=0)
    message = anthropic.messages.create(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hello"}]
    )
    assert message.content and message.usage.output_tokens > 0
    with anthropic.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hello"}]
    ) as stream:
        text = "".join(stream.text_stream)
    assert text


def test_a_stored_response_is_retrieved_through_the_router_and_from_either_replica(
    router: RouterProcess, replicas: list[SluiceProcess]
) -> None:
    openai = client(router)
    created = openai.responses.create(model=MODEL, input="hello", max_output_tokens=8)
    # (the demo model's gibberish rarely ends by itself: most stop at max_output_tokens)
    assert created.status in {"completed", "incomplete"} and created.output_text
    # Through the router (it asks each replica in turn), and from each replica directly: the
    # one that did not run it finds it in Redis.
    found = openai.responses.retrieve(created.id)
    assert found.id == created.id and found.output_text == created.output_text
    for replica in replicas:
        direct = httpx.get(f"{replica.url}/v1/responses/{created.id}", timeout=10)
        assert direct.status_code == 200 and direct.json()["id"] == created.id


def test_a_batch_runs_through_the_router(
    router: RouterProcess, replicas: list[SluiceProcess]
) -> None:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "max_tokens": 6,
                "messages": [{"role": "user", "content": f"q {i}"}],
            },
        }
        for i in range(3)
    ]
    body = "".join(json.dumps(line) + "\n" for line in lines).encode()
    # The router refuses multipart bodies: the file goes to a replica (docs/operations.md),
    # and every replica finds it in Redis.
    from openai import OpenAI

    direct = OpenAI(base_url=replicas[1].url + "/v1", api_key="unused", max_retries=0)
    file = direct.files.create(file=("input.jsonl", body), purpose="batch")
    openai = client(router)
    batch = openai.batches.create(
        input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    done: list = []

    def completed() -> bool:
        done[:] = [openai.batches.retrieve(batch.id)]
        return done[0].status in {"completed", "failed", "expired"}

    wait_until(completed, 180, 0.5, "the batch to end")
    assert done[0].status == "completed" and done[0].output_file_id
    output = openai.files.content(done[0].output_file_id).text.splitlines()
    assert sorted(json.loads(line)["custom_id"] for line in output) == ["req-0", "req-1", "req-2"]


def test_a_conversation_is_made_and_continued_through_the_router(
    router: RouterProcess, replicas: list[SluiceProcess]
) -> None:
    """Two turns on one conversation, each sent to the router (which may place them on either
    replica): the second sees the first's items, which either replica reads from Redis."""
    openai = client(router)
    made = openai.conversations.create(metadata={"topic": "fleet"})
    turns = []
    for question in ("first question", "second question"):
        turns.append(
            openai.responses.create(
                model=MODEL, input=question, conversation=made.id, max_output_tokens=6
            )
        )
    first, second = (turn.usage for turn in turns)
    assert first is not None and second is not None
    assert second.input_tokens > first.input_tokens + first.output_tokens  # it saw the first
    # (The router drops a GET's query: the items come in the default order, newest first.)
    listed = openai.conversations.items.list(made.id).data
    assert [
        (item.role, "".join(part.text for part in item.content))  # type: ignore[union-attr]
        for item in reversed(listed)
    ] == [
        ("user", "first question"),
        ("assistant", turns[0].output_text),
        ("user", "second question"),
        ("assistant", turns[1].output_text),
    ]
    for replica in replicas:
        direct = httpx.get(f"{replica.url}/v1/conversations/{made.id}", timeout=10)
        assert direct.status_code == 200 and direct.json()["metadata"] == {"topic": "fleet"}


def test_a_keyed_stream_resumes_through_the_router(router: RouterProcess) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 48,
        "stream": True,
    }
    key = {"Idempotency-Key": "fleet-resume-1"}
    lines: list[str] = []
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=key, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            lines.append(line)
            if len(parse_sse(lines)) >= 4:
                break  # the client leaves mid-stream
    head = parse_sse(lines)
    # The router forwards a POST's headers but neither a GET's headers nor its query: the
    # request sent again with its key and the last event id resumes after that event.
    resumed = {**key, "Last-Event-ID": str(head[-1][0])}
    with httpx.stream(
        "POST", router.url + "/v1/chat/completions", json=body, headers=resumed, timeout=60
    ) as response:
        assert response.status_code == 200 and response.headers["idempotent-replayed"] == "true"
        tail = parse_sse(list(response.iter_lines()))
    assert tail[0][0] > head[-1][0] and tail[-1][1] == "[DONE]"
    # The key's replay (the same request once more, from the first event) is the whole
    # generation: what the client had, then what it resumed, is exactly that.
    replay = parse_sse(
        httpx.post(
            router.url + "/v1/chat/completions", json=body, headers=key, timeout=60
        ).text.splitlines()
    )
    assert text_of(head) + text_of(tail) == text_of(replay)


def text_of(events: list[tuple[int | None, str]]) -> str:
    return "".join(
        choice["delta"].get("content") or ""
        for _, data in events
        if data != "[DONE]"
        for choice in json.loads(data)["choices"]
    )


@pytest.mark.parametrize("policy", ["cache_aware", "kv_aware"])
def test_a_conversations_next_turn_lands_where_its_prefix_is_cached(
    policy: str, replicas: list[SluiceProcess], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """cache_aware: the router's prefix tree, from the token ids Sluice's render endpoint
    gives it; kv_aware: the blocks each engine reports holding (vLLM's KV events)."""
    workers = [replica.url for replica in replicas]
    sources = (
        {replica.url: replica.kv_events for replica in replicas} if policy == "kv_aware" else None
    )  # type: ignore[attr-defined]
    log = tmp_path_factory.mktemp(policy) / "router.log"
    with RouterProcess(
        workers, log, policy=policy, kv_sources=sources, kv_block_size=128, kv_model=MODEL
    ) as front:
        openai = client(front)
        for salt in range(3):  # three conversations: the router places each on one replica
            system = {"role": "system", "content": f"conversation {policy} {salt}. " + SYSTEM}
            first = openai.chat.completions.create(
                model=MODEL, messages=[system, {"role": "user", "content": "q"}], max_tokens=4
            )
            assert first.usage is not None
            later = [
                system,
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "a"},
            ]
            later.append({"role": "user", "content": "and then?"})

            def cached(messages: list[dict[str, str]] = later) -> int:
                answer = openai.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=4
                )
                details = answer.usage.prompt_tokens_details if answer.usage else None
                return (details.cached_tokens or 0) if details else 0

            # kv_aware learns of the first turn's blocks from the engine's events, a moment
            # after the first turn ended: the next turn may come before them, never long.
            wait_until(lambda: cached() >= 256, 30, 0.5, f"{policy}: the second turn cached")
