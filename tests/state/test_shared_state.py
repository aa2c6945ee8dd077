"""Tenant quotas shared by replicas through a real `redis-server`: two real Sluice servers
(sim engine, in this process), one Redis, the limits holding for both together, and what
happens when a replica (a process of its own, killed or sent SIGTERM) dies or Redis stops."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import websockets
from conftest import InProcessSluice, RedisProcess, SluiceProcess, all_ready, parse_sse, wait_until

pytestmark = pytest.mark.system

Replica = SluiceProcess | InProcessSluice
KEY = {"Authorization": "Bearer acme-key"}
LEASE_SECONDS = 2
# A Redis call slower than this counts as Redis down (250 ms by default). With both cores busy
# beside the suite, calls took longer, replicas marked Redis down, and a tenant's limit did
# not hold across them: these tests are about what replicas share, not how fast Redis is.
STATE_TIMEOUT_MS = 1000
# The replica killed below takes longer leases, so that "still held" is checked well within
# them on a loaded machine; the leases' length is the taker's.
DOOMED_LEASE_SECONDS = 6


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    with RedisProcess(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Replicas' configuration. No start-up calibration (~2 s a replica, seven starts): the
    scheduler starts from the sim engine's speed (a step of ~2 ms) as its prior instead, so a
    long answer is not refused as unmeetable before the first is measured."""
    path = tmp_path_factory.mktemp("replicas") / "sluice.yaml"
    path.write_text(f"""
tenants:
  acme: {{api_keys: [acme-key], max_concurrent: 4}}
  beta: {{api_keys: [beta-key], tokens_per_minute: 100}}
state: {{lease_seconds: {LEASE_SECONDS}, timeout_ms: {STATE_TIMEOUT_MS}}}
estimates: {{calibrate: false, decode_tokens_per_s: 400}}
""")
    return path


@pytest.fixture(scope="module")
def replicas(redis: RedisProcess, config: Path) -> Iterator[list[InProcessSluice]]:
    with all_ready([_replica_here(config, redis) for _ in range(2)]) as servers:
        _count_two(servers)
        yield servers


def _replica(config: Path, redis: RedisProcess) -> SluiceProcess:
    """A replica in a process of its own (to be killed or sent SIGTERM)."""
    return SluiceProcess(_replica_args(config, redis), _replica_log(config))


def _replica_here(config: Path, redis: RedisProcess) -> InProcessSluice:
    """A replica in this process (its own metrics registry and replica id)."""
    return InProcessSluice(_replica_args(config, redis), _replica_log(config))


def _replica_args(config: Path, redis: RedisProcess) -> list[str]:
    return ["--engine", "sim", "--config", str(config), "--state-url", redis.url]


def _replica_log(config: Path) -> Path:
    return config.parent / f"replica-{time.monotonic_ns()}.log"


def _count_two(replicas: list[Replica]) -> None:
    wait_until(
        lambda: all(s.metric("sluice_state_replicas") == 2 for s in replicas),
        DOOMED_LEASE_SECONDS + 3,
        message="each replica counts two",
    )


async def _hold(
    client: httpx.AsyncClient, server: Replica, max_tokens: int
) -> tuple[int, httpx.Headers, str]:
    """A streamed chat's status, headers and (refused) body, read to its end."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    # A deadline of its own: with both cores busy and four workers beside it, one of these was
    # once refused with 503 (its body unrecorded): most likely 200 tokens predicted past the
    # default 30 s from the starved in-process sim engines' steps, where these tests are about
    # limits.
    headers = {**KEY, "X-Request-Timeout-Ms": "600000"}
    async with client.stream(
        "POST", server.url + "/v1/chat/completions", json=body, headers=headers
    ) as response:
        text = "".join([line async for line in response.aiter_lines()])
        return response.status_code, response.headers, text


def _eight_at_once(
    replicas: list[Replica],
) -> list[tuple[int, httpx.Headers, str]]:
    """Eight concurrent chats of the tenant limited to four, four on each replica, each long
    enough (200 tokens of the sim engine's steps) to be in flight while the others arrive."""

    async def send() -> list[tuple[int, httpx.Headers, str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(_hold(client, replicas[i % 2], 200) for i in range(8)))

    return asyncio.run(send())


def _four_run_four_refused(results: list[tuple[int, httpx.Headers, str]], why: str) -> None:
    """Four of `_eight_at_once` ran and four were refused (429, saying `why`)."""
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * 4 + [429] * 4, [text[:200] for _, _, text in results]
    for status, headers, text in results:
        if status == 429:
            assert why in text and int(headers["retry-after"]) >= 1


def test_a_tenant_limit_holds_across_replicas(
    replicas: list[Replica],
) -> None:
    _four_run_four_refused(_eight_at_once(replicas), "across all replicas")
    # tokens_per_minute too: 100 tokens a minute for two replicas together.
    beta = {"Authorization": "Bearer beta-key"}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    statuses = [
        httpx.post(
            replicas[i % 2].url + "/v1/chat/completions", json=chat, headers=beta, timeout=30
        )
        for i in range(3)
    ]
    assert [r.status_code for r in statuses] == [200, 200, 429]
    assert "tokens per minute across all replicas" in statuses[2].text
    assert int(statuses[2].headers["retry-after"]) > 1


def test_a_killed_replicas_holdings_expire(
    redis: RedisProcess, replicas: list[Replica], config: Path
) -> None:
    longer = config.with_name("doomed.yaml")
    longer.write_text(
        config.read_text().replace(
            f"lease_seconds: {LEASE_SECONDS}", f"lease_seconds: {DOOMED_LEASE_SECONDS}"
        )
    )
    doomed = _replica(longer, redis)
    doomed.wait_ready(60)
    survivor = replicas[1]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    async def hold_four_then_kill() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            holding = [asyncio.create_task(_hold(client, doomed, 5000)) for _ in range(4)]
            # Dispatched by the scheduler, and each lease taken (the engine waits for both;
            # a request can show as running before its lease's round trip has returned).
            await asyncio.to_thread(
                wait_until,
                lambda: (
                    doomed.metric("sluice_running_requests") == 4
                    and doomed.metric("sluice_state_backend_seconds_count", operation="acquire")
                    == 4
                ),
                30,
                message="the four run, their leases taken",
            )
            doomed.proc.kill()  # SIGKILL: nothing released, nothing renewed
            await asyncio.gather(*holding, return_exceptions=True)

    asyncio.run(hold_four_then_kill())
    refused = httpx.post(survivor.url + "/v1/chat/completions", json=chat, headers=KEY, timeout=30)
    assert refused.status_code == 429  # the dead replica's four leases still count
    wait_until(
        lambda: (
            httpx.post(
                survivor.url + "/v1/chat/completions", json=chat, headers=KEY, timeout=30
            ).status_code
            == 200
        ),
        DOOMED_LEASE_SECONDS + 3,
        message="the dead replica's leases expired",
    )
    doomed.stop()


def _rest(
    server: SluiceProcess, sent: list[tuple[int | None, str]]
) -> list[tuple[int | None, str]]:
    """The rest of the generation whose events `sent` a client had, resumed on `server` after
    the last numbered one: numbered on from it, none twice, none missing, to `[DONE]`."""
    last = [seq for seq, _ in sent if seq is not None][-1]
    generation = orjson.loads(sent[0][1])["id"]
    resumed = httpx.get(
        f"{server.url}/v1/chat/completions/{generation}/stream",
        headers={**KEY, "Last-Event-ID": str(last)},
        timeout=60,
    )
    assert resumed.status_code == 200, resumed.text
    rest = parse_sse(resumed.text.splitlines())
    assert [seq for seq, _ in rest] == list(range(last + 1, last + 1 + len(rest)))
    assert rest[-1][1] == "[DONE]"
    return rest


def _tokens(events: list[tuple[int | None, str]]) -> list[int]:
    """The token ids the chunks carry (return_token_ids)."""
    return [
        t
        for _, data in events
        if data.startswith('{"id"')
        for choice in orjson.loads(data)["choices"]
        for t in choice.get("token_ids") or ()
    ]


def _as_read(stream: str) -> tuple[str, int | None, list[str]]:
    """What any reader of a resumable stream gets, however its events were merged: the text,
    the number of the last event, and the chunks past the text (finish, usage, [DONE]). A
    reader that falls behind gets the pieces waiting as one event under the last one's
    number, so the bytes of two readers differ by how each kept up; their numbers only rise."""
    events = parse_sse(stream.splitlines())
    ids = [seq for seq, _ in events]
    assert all(seq is not None for seq in ids) and ids == sorted(set(ids)), ids
    return _text(events), ids[-1], [data for _, data in events if '"content"' not in data]


def _text(events: list[tuple[int | None, str]]) -> str:
    """The generated text the chunks carry."""
    return "".join(
        choice["delta"].get("content") or ""
        for _, data in events
        if data.startswith('{"id"')
        for choice in orjson.loads(data)["choices"]
    )


def _post(server: SluiceProcess, body: dict, key: str) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/chat/completions",
        json=body,
        headers={**KEY, "Idempotency-Key": key},
        timeout=60,
    )


def test_an_idempotency_key_replays_on_the_other_replica(
    replicas: list[Replica],
) -> None:
    first, other = replicas
    whole = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    made = _post(first, whole, "whole-1")
    replayed = _post(other, whole, "whole-1")
    assert made.status_code == replayed.status_code == 200
    assert replayed.json() == made.json()
    assert replayed.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in made.headers
    reused = _post(other, {**whole, "max_tokens": 17}, "whole-1")
    assert reused.status_code == 422
    assert reused.json()["error"]["code"] == "idempotency_key_reused"

    streamed = {**whole, "stream": True, "stream_options": {"include_usage": True}}
    made = _post(first, streamed, "stream-1")
    replayed = _post(other, streamed, "stream-1")
    assert _as_read(made.text) == _as_read(replayed.text)
    assert made.text.endswith("data: [DONE]\n\n")

    async def both_at_once() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            answers = await asyncio.gather(
                *(
                    client.post(
                        server.url + "/v1/chat/completions",
                        json={**streamed, "max_tokens": 60},
                        headers={**KEY, "Idempotency-Key": "raced"},
                    )
                    for server in replicas
                )
            )
        return [answer.text for answer in answers]

    # The same key at the same moment on both: one generation, read by both.
    one, two = both_at_once_texts = asyncio.run(both_at_once())
    assert _as_read(one) == _as_read(two) and "[DONE]" in one, both_at_once_texts


def _killed_mid_stream(
    config: Path, redis: RedisProcess, body: dict, key: str
) -> list[tuple[int | None, str]]:
    """The events a client had of a generation whose replica was SIGKILLed after 40."""
    doomed = _replica(config, redis)  # (leases of LEASE_SECONDS)
    doomed.wait_ready(60)
    before: list[str] = []
    with httpx.stream(
        "POST",
        doomed.url + "/v1/chat/completions",
        json=body,
        headers={**KEY, "Idempotency-Key": key},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        while sum(line.startswith("data: ") for line in before) < 40:
            before.append(next(lines))
        doomed.proc.kill()  # SIGKILL: no drain, nothing written after this
    doomed.stop()
    return parse_sse(before)


def test_a_killed_replicas_generation_continues_on_the_other(
    redis: RedisProcess, replicas: list[Replica], config: Path
) -> None:
    """SIGKILL mid-stream; the client resumes on the other replica with Last-Event-ID and
    gets every remaining token once."""
    survivor = replicas[0]
    max_tokens = 400
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    sent = _killed_mid_stream(config, redis, body, "doomed-1")
    rest = _rest(survivor, sent)
    chunks = [orjson.loads(data) for _, data in sent + rest[:-1]]
    assert {chunk["id"] for chunk in chunks} == {chunks[0]["id"]}
    assert len(_tokens(sent + rest)) == max_tokens  # every token once
    assert chunks[-1]["usage"]["completion_tokens"] == max_tokens
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert survivor.metric("sluice_state_takeovers_total", how="continued") == 1


def test_a_generation_that_cannot_be_continued_ends_for_every_replica(
    redis: RedisProcess, replicas: list[Replica], config: Path
) -> None:
    """Two choices cannot be continued alone: the replica that claims the generation ends it
    with an error event in the shared log, which every replica then reads."""
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 400,
        "n": 2,
        "stream": True,
    }
    sent = _killed_mid_stream(config, redis, body, "two-choices")
    claimed, elsewhere = (_rest(server, sent) for server in replicas)
    assert claimed == elsewhere  # the same ending, event for event, ids included
    error = orjson.loads(claimed[-2][1])["error"]
    assert error["code"] == "generation_failed" and "new idempotency key" in error["message"]


def test_a_websocket_generation_resumes_on_the_other_replica(
    replicas: list[Replica],
) -> None:
    max_tokens = 200
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    first, other = (
        server.url.replace("http://", "ws://") + "/v1/ws?api_key=acme-key" for server in replicas
    )

    async def read() -> tuple[list[dict], list[dict]]:
        async with websockets.connect(first) as ws:
            await ws.send(
                orjson.dumps(
                    {"type": "generate", "id": "a", "request": request, "idempotency_key": "ws-1"}
                ).decode()
            )
            head = [orjson.loads(await ws.recv()) for _ in range(5)]
            # The client's connection drops. (A closing handshake begun while the generation
            # streams is not answered by the server: it would wait out websockets'
            # close_timeout, 10 s.)
            ws.transport.abort()
        async with websockets.connect(other) as ws:
            await ws.send(
                orjson.dumps(
                    {
                        "type": "resume",
                        "id": "b",
                        "after": head[-1]["seq"],
                        "generation": head[0]["generation"],
                    }
                ).decode()
            )
            tail = [orjson.loads(await ws.recv())]
            while tail[-1]["type"] == "delta":
                tail.append(orjson.loads(await ws.recv()))
        return head, tail

    head, tail = asyncio.run(read())
    seqs = [message["seq"] for message in head + tail]
    # Each message is numbered by the last event it carries: pieces a busy reader found
    # waiting together go as one message (coalesced), so numbers rise but may skip. The
    # token count below says none was lost or repeated across the two replicas.
    assert seqs == sorted(set(seqs)), seqs
    assert tail[-1]["type"] == "final", tail[-1]
    assert tail[-1]["usage"]["completion_tokens"] == max_tokens
    assert sum(m["tokens"] for m in head + tail if m["type"] == "delta") == max_tokens


def test_a_reader_on_another_replica_keeps_a_generation_alive(
    redis: RedisProcess, replicas: list[Replica], config: Path
) -> None:
    """The replica running a generation with no reader of its own cancels it after the grace
    period, unless a replica following it has one."""
    brief = config.with_name("brief-grace.yaml")
    brief.write_text(config.read_text() + "resume: {grace_seconds: 1}\n")
    max_tokens = 1500  # some seconds of the sim engine: well past the grace period
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with _replica_here(brief, redis) as owner:
        lines: list[str] = []
        with httpx.stream(
            "POST",
            owner.url + "/v1/chat/completions",
            json=body,
            headers={**KEY, "Idempotency-Key": "read-elsewhere"},
            timeout=60,
        ) as response:
            for line in response.iter_lines():
                lines.append(line)
                if line.startswith("data: "):
                    break  # the owner's only reader leaves
        generation = orjson.loads(parse_sse(lines)[0][1])["id"]
        elsewhere = httpx.get(
            f"{replicas[0].url}/v1/chat/completions/{generation}/stream", headers=KEY, timeout=60
        )
    events = parse_sse(elsewhere.text.splitlines())
    assert not [data for _, data in events if '"error"' in data]
    assert orjson.loads(events[-2][1])["usage"]["completion_tokens"] == max_tokens


def test_a_stopping_replica_hands_its_generations_over(
    redis: RedisProcess, replicas: list[Replica], config: Path
) -> None:
    """SIGTERM: a generation still running when the drain ends is let go at once (its lease
    here outlasts the test, so only letting go lets the other replica take it), the stream
    ending with an error event of this replica's own, without an id; resumed on the other
    replica, nothing is lost."""
    held = config.with_name("handing-over.yaml")
    held.write_text(
        config.read_text().replace(f"lease_seconds: {LEASE_SECONDS}", "lease_seconds: 600")
    )
    stopping = SluiceProcess(
        [
            "--engine",
            "sim",
            "--config",
            str(held),
            "--state-url",
            redis.url,
            "--drain-seconds",
            "0",
        ],
        config.parent / f"stopping-{time.monotonic_ns()}.log",
    )
    stopping.wait_ready(60)
    max_tokens = 1500
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    lines: list[str] = []
    with httpx.stream(
        "POST",
        stopping.url + "/v1/chat/completions",
        json=body,
        headers={**KEY, "Idempotency-Key": "handed-over"},
        timeout=60,
    ) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data: ") and sum(line.startswith("data: ") for line in lines) == 20:
                stopping.proc.send_signal(signal.SIGTERM)  # once
    assert stopping.proc.wait(timeout=30) == 0
    stopping.stop()
    sent = parse_sse(lines)
    (last_seq, _), (no_id, error), (no_id_either, done) = sent[-3:]
    assert no_id is None and no_id_either is None and done == "[DONE]"
    assert orjson.loads(error)["error"]["code"] == "shutting_down"
    assert last_seq is not None
    rest = _rest(replicas[1], sent[:-2])
    assert len(_tokens(sent + rest)) == max_tokens
    assert orjson.loads(rest[-2][1])["usage"]["completion_tokens"] == max_tokens


def test_a_redis_outage_mid_stream(redis: RedisProcess, replicas: list[Replica]) -> None:
    """Redis stops while a resumable generation streams from one replica and is followed on
    the other: the follower's stream ends with an error of its own (no id: resume later), the
    running replica's goes on to the end. Redis comes back empty; nothing breaks."""
    max_tokens = 1500
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def read(
        client: httpx.AsyncClient, method: str, url: str, started: asyncio.Event, **kwargs: object
    ) -> list[tuple[int | None, str]]:
        lines: list[str] = []
        async with client.stream(
            method, url, headers={**KEY, "Idempotency-Key": "outage"}, **kwargs
        ) as response:  # type: ignore[arg-type]
            assert response.status_code == 200
            async for line in response.aiter_lines():
                lines.append(line)
                if sum(line.startswith("data: ") for line in lines) == 10:
                    started.set()
        return parse_sse(lines)

    async def outage() -> tuple[list, list]:
        async with httpx.AsyncClient(timeout=60) as client:
            running, following = asyncio.Event(), asyncio.Event()
            owner = asyncio.create_task(
                read(client, "POST", replicas[0].url + "/v1/chat/completions", running, json=body)
            )
            await running.wait()
            # The same key on the other replica: it follows the generation.
            follower = asyncio.create_task(
                read(client, "POST", replicas[1].url + "/v1/chat/completions", following, json=body)
            )
            await following.wait()
            await asyncio.to_thread(redis.stop)
            followed = await follower
            await asyncio.to_thread(redis.start)  # empty: the generation's record is gone
            return await owner, followed

    try:
        owned, followed = asyncio.run(outage())
    finally:
        if not redis.answers():
            redis.start()
    # The running replica's log could not catch up: it let the shared copy go.
    wait_until(
        lambda: "is no longer in the shared state" in replicas[0].log(),
        10,
        message="the mirror gave the lost record up",
    )
    assert orjson.loads(owned[-2][1])["usage"]["completion_tokens"] == max_tokens
    assert owned[-1][1] == "[DONE]"
    # Each event once, in order (text that waited for the owner's reader while the shared
    # state lagged comes merged, numbered as its last event).
    ids = [seq for seq, _ in owned]
    assert ids == sorted(set(ids)) and ids[0] == 1
    (_, error), (no_id, done) = followed[-2:]
    assert orjson.loads(error)["error"]["code"] == "engine_unavailable"
    assert followed[-2][0] is None and no_id is None and done == "[DONE]"
    assert _text(owned).startswith(_text(followed[:-2]))  # what it had followed
    _count_two(replicas)


def test_redis_stopped_and_started_mid_run(redis: RedisProcess, replicas: list[Replica]) -> None:
    _count_two(replicas)  # (the replica killed above no longer counts)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    statuses: list[int] = []

    def chats(count: int) -> None:
        for i in range(count):
            statuses.append(
                httpx.post(
                    replicas[i % 2].url + "/v1/chat/completions", json=chat, headers=KEY, timeout=30
                ).status_code
            )

    chats(10)
    redis.stop()
    chats(20)  # each replica finds Redis gone on its next call, and falls back
    assert all(s.metric("sluice_state_backend_up") == 0 for s in replicas)
    # A resumable generation made now is its replica's alone: resumed there, unknown elsewhere.
    streamed = {**chat, "stream": True}
    made = _post(replicas[0], streamed, "during-the-outage")
    assert made.status_code == 200 and made.text.endswith("data: [DONE]\n\n")
    generation = orjson.loads(parse_sse(made.text.splitlines())[0][1])["id"]
    here, elsewhere = (
        httpx.get(f"{server.url}/v1/chat/completions/{generation}/stream", headers=KEY, timeout=30)
        for server in replicas
    )
    # (resumed after its end, the text that waited comes merged into one chunk)
    resumed = parse_sse(here.text.splitlines())
    sent = parse_sse(made.text.splitlines())
    assert _text(resumed) == _text(sent) and resumed[-2:] == sent[-2:]
    assert elsewhere.status_code == 404
    # Without Redis, each replica holds half the limit: 2 + 2 of the eight.
    _four_run_four_refused(_eight_at_once(replicas), "this replica's share")
    redis.start()
    chats(10)
    wait_until(
        lambda: all(s.metric("sluice_state_backend_up") == 1 for s in replicas),
        5,
        message="both replicas see Redis again",
    )
    chats(10)
    assert statuses == [200] * 50  # no request failed for Redis' sake
    _four_run_four_refused(_eight_at_once(replicas), "across all replicas")
