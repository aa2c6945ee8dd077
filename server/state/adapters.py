"""LoRA adapters loaded at runtime, on this replica and on every replica that shares the state.

`sluice:adapters` (a hash, name to path) holds the adapters an admin loaded at runtime on any
replica. A load is done on this replica's engine first (so that a bad path is the caller's
400, with the engine's reason), then written there; an unload is taken out of it first (so
that no replica loads it again meanwhile), then done here. Every `SYNC_S`, and once as the
replica starts, each replica loads what the hash holds that it does not serve, and unloads
what it loaded from the hash (or for an admin) that the hash no longer holds: a replica that
starts later serves what the others were given. Adapters of `--lora-modules` are each
replica's own, and never unloaded by another's unload.

Without shared state (or while Redis does not answer) loads and unloads are this replica's
alone; an adapter that cannot be loaded here (its path is not on this host) is logged once
and left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from engine_adapters.protocol import (
    AdapterLoadFailed,
    AdapterNotFound,
    EngineClient,
    EngineError,
)
from server.core.errors import StateUnavailable
from server.state.backend import RedisState

logger = logging.getLogger("sluice.state")
ADAPTERS_KEY = "sluice:adapters"
SYNC_S = 1.0


class RuntimeAdapters:
    """`loaded` is told the name of each adapter this replica's engine loads (an admin's, or
    another replica's): the scheduler times it (`Dispatcher.adapter_loaded`)."""

    def __init__(
        self,
        engine: EngineClient,
        state: RedisState | None = None,
        loaded: Callable[[str], None] | None = None,
    ) -> None:
        self._engine = engine
        self._state = state
        self._loaded = loaded
        self._ours: set[str] = set()  # loaded at runtime here: what an unload elsewhere ends
        self._failed: set[tuple[str, str]] = set()  # could not be loaded here: not tried again
        self._lock = asyncio.Lock()  # one load, unload or sync at a time
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Serve what the other replicas were given (the engine must have started)."""
        if self._state is None:
            return
        await self._state.start()
        await self.sync()
        self._task = asyncio.create_task(self._syncing(), name="adapter-sync")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def load(self, name: str, path: str) -> None:
        """Load here (EngineRequestError: the engine's reason it cannot), then for every
        replica."""
        async with self._lock:
            await self._engine.load_adapter(name, path)
            self._told(name)
            if await self._shared(lambda client: client.hset(ADAPTERS_KEY, name, path)):
                self._ours.add(name)  # (else this replica's alone: no sync unloads it)

    async def unload(self, name: str) -> None:
        """Unload for every replica, then here (EngineRequestError: it is not loaded)."""
        async with self._lock:
            self._ours.discard(name)
            await self._shared(lambda client: client.hdel(ADAPTERS_KEY, name))
            await self._engine.unload_adapter(name)

    async def _shared(self, call: Callable[[Any], Awaitable[object]]) -> bool:
        """Whether the change reached the shared state (False: there is none, or it did not
        answer, and the change is this replica's alone)."""
        state = self._state
        if state is None:
            return False
        try:
            await state.call("adapters", call(state.client))
        except StateUnavailable:
            logger.warning("the state backend is unavailable: the adapter change is this replica's")
            return False
        return True

    async def _syncing(self) -> None:
        while True:
            await asyncio.sleep(SYNC_S)
            await self.sync()

    async def sync(self) -> None:
        """Load what the hash holds and this replica does not serve; unload what it loaded at
        runtime that the hash no longer holds."""
        state = self._state
        if state is None or not state.up:
            return
        try:
            wanted: dict[str, str] = await state.call(
                "adapters", state.client.hgetall(ADAPTERS_KEY)
            )
        except StateUnavailable:
            return
        async with self._lock:
            served = self._engine.model.adapters
            for name in sorted(self._ours - wanted.keys()):
                self._ours.discard(name)
                if name in served:
                    await self._engine.unload_adapter(name)
                    logger.info("LoRA adapter %r unloaded, as on another replica", name)
            for name, path in sorted(wanted.items()):
                if name in served or (name, path) in self._failed:
                    continue
                try:
                    await self._engine.load_adapter(name, path)
                except (AdapterNotFound, AdapterLoadFailed) as exc:  # not on this host: left
                    self._failed.add((name, path))
                    logger.warning("LoRA adapter %r loaded on another replica: %s", name, exc)
                    continue
                except EngineError as exc:  # (no room now, say): tried again at the next sync
                    logger.info("LoRA adapter %r not loaded yet: %s", name, exc)
                    continue
                self._ours.add(name)
                self._told(name)
                logger.info("LoRA adapter %r loaded from %s, as on another replica", name, path)

    def _told(self, name: str) -> None:
        if self._loaded is not None:
            self._loaded(name)
