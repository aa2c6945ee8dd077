"""`ClientWatch`: the client's leaving ends the block it watches and nothing after it; one
watching task per response, however many watches nest in it; other cancellations pass."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from server.http.leaving import ClientWatch, unless_gone


class Client:
    """An ASGI `receive` whose `http.disconnect` comes when `leave` is called."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def receive(self) -> dict[str, Any]:
        return await self.messages.get()

    def leave(self) -> None:
        self.messages.put_nowait({"type": "http.disconnect"})


async def test_the_client_leaving_ends_the_block_and_the_task_goes_on() -> None:
    client, waiting = Client(), asyncio.Event()
    reached: list[str] = []

    async def respond() -> bool:
        with ClientWatch(client.receive) as watch:
            waiting.set()
            await asyncio.Event().wait()  # a dispatch that never comes
            reached.append("after the wait")
        reached.append("after the block")
        await asyncio.sleep(0)  # the task is not cancelled any more: it awaits on
        return watch.left

    task = asyncio.create_task(respond())
    await waiting.wait()
    client.leave()
    assert await task is True
    assert reached == ["after the block"] and task.cancelling() == 0


async def test_a_watch_inside_a_watch_is_the_outer_one() -> None:
    client, inside = Client(), asyncio.Event()

    async def respond() -> list[str]:
        reached = []
        with ClientWatch(client.receive):
            before = len(asyncio.all_tasks())
            with ClientWatch(client.receive):  # (SSEResponse's, inside RunResponse's)
                assert len(asyncio.all_tasks()) == before  # no second watching task
                inside.set()
                await asyncio.Event().wait()
            reached.append("after the inner block")  # not reached: the outer block ends
        return reached

    task = asyncio.create_task(respond())
    await inside.wait()
    client.leave()
    assert await task == []


async def test_a_cancellation_not_the_clients_passes_through() -> None:
    client, waiting = Client(), asyncio.Event()

    async def respond() -> None:
        with ClientWatch(client.receive):
            waiting.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(respond())
    await waiting.wait()
    task.cancel()  # the server's, or the send guard's
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_unless_gone_says_whether_the_wait_finished() -> None:
    client, done = Client(), asyncio.Event()
    done.set()
    assert await unless_gone(done.wait(), client.receive) is True
    client.leave()
    assert await unless_gone(asyncio.Event().wait(), client.receive) is False
