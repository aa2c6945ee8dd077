"""Resumable generations shared by replicas, in Redis: their idempotency keys, their event
logs, and which replica runs each.

`RedisRuns` implements the ports of `server.generations.ports` (`SharedRuns`, `LogMirror`,
`LogFollower`). A generation made with an idempotency key (`Generations.generate`) is recorded here
as well as in its replica's `RunStore`:

- `sluice:idem:{tenant}:KEY` names the generation made under the key (and its request's
  fingerprint); it is set once, atomically, so two replicas given the same key at once make
  one generation between them.
- `sluice:run:{tenant}:ID` holds what any replica needs to follow or continue it: the request
  body, its class and timeout, and `ended` once its last event is logged.
- `…:events` is a Redis Stream of its events, entry `N-0` for event N, each as the replica
  rendered it (`encode`). The replica that runs a generation writes its events there before
  its own readers see them (`RedisMirror`), so whatever a client was sent is in the log.
- `…:lease` names the replica that runs it, for `state.lease_seconds`, renewed by its
  heartbeat. Every write checks it (a replica that lost its lease is fenced off).

Any replica can follow a generation it does not run (`RedisFollower`): it reads the stream into a
local run that its readers read like any other. When the lease has expired (the replica
died), the follower claims it, one replica winning, and continues the generation from the
logged tokens, as a preempted generation is continued (`Generations._takeover`).

Keys expire `resume.retention_seconds` after their last write. If Redis does not answer, new
resumable generations are local to their replica, and a mirror that cannot write lets its
readers go on and catches up when Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import orjson

from engine_adapters.protocol import TokenLogprob
from server.core.errors import GenerationFailed, SluiceError, StateUnavailable, restored
from server.generations.log import Event, EventLog, Kind
from server.generations.ports import RunRecord
from server.observability.metrics import Metrics
from server.state.backend import PROBE_SECONDS, RedisState, tenant_key

logger = logging.getLogger("sluice.state")
READ_BLOCK_MS = 1000  # a follower's wait for news before it checks the lease again
READ_COUNT = 512

# KEYS: idem, run, lease. ARGV: public id, fingerprint, replica, lease ms, retention ms,
# then the record's fields and values. -> {1} made; {0, "ID FINGERPRINT"} the key's run.
OPEN = """
local found = redis.call('GET', KEYS[1])
if found then return {0, found} end
redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[5])
redis.call('HSET', KEYS[2], unpack(ARGV, 6))
redis.call('PEXPIRE', KEYS[2], ARGV[5])
redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[4])
return {1}
"""

# KEYS: run, lease, events, idem (or the run again). ARGV: replica, retention ms, end ("",
# "ended": the last event is in; "refused": ended before dispatch, the key freed), the first
# event's number, the lease ms, then the events. Events already there (a retried write) are
# skipped. A lease that lapsed unclaimed (Redis was out of reach) is taken again.
# -> 1; 0: another replica holds the lease; -1: the run is gone (Redis lost it).
APPEND = """
local holder = redis.call('GET', KEYS[2])
if not holder then
  if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[5])
elseif holder ~= ARGV[1] then
  return 0
end
local top = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', 1)
local last = 0
if #top > 0 then last = tonumber(string.match(top[1][1], '^(%d+)')) end
local seq = tonumber(ARGV[4])
for i = 6, #ARGV do
  if seq > last then redis.call('XADD', KEYS[3], seq .. '-0', 'e', ARGV[i]) end
  seq = seq + 1
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('PEXPIRE', KEYS[3], ARGV[2]) end
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'ended', '1')
  redis.call('DEL', KEYS[2])
  if ARGV[3] == 'refused' and KEYS[4] ~= KEYS[1] then redis.call('DEL', KEYS[4]) end
end
return 1
"""

# KEYS: run, lease, events. ARGV: replica, lease ms. -> the events logged, when the lease is
# now this replica's; -2 the run ended (or is gone); -3 - its ms left: another's lease is
# live.
CLAIM = """
local left = redis.call('PTTL', KEYS[2])
if left >= 0 then return -3 - left end
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'ended') == '1' then
  return -2
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return redis.call('XLEN', KEYS[3])
"""

# KEYS: idem, run, lease, events. ARGV: "ID " (the key's value starts so). Forget a
# generation refused before it began.
FORGET = """
local found = redis.call('GET', KEYS[1])
if found and string.sub(found, 1, #ARGV[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
"""

# KEYS: lease. ARGV: replica. Let the lease go (when it is this replica's).
LET_GO = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _key(record: RunRecord, suffix: str = "") -> str:
    return tenant_key("run", record.tenant, record.public_id + suffix)


def run_keys(record: RunRecord) -> list[str]:
    """The run, its lease, its events."""
    return [_key(record), _key(record, ":lease"), _key(record, ":events")]


def reader_key(record: RunRecord) -> str:
    return _key(record, ":reader")


def record_fields(record: RunRecord) -> list[str]:
    """The record as the run's hash holds it: field, value, field, value, …"""
    return [
        "kind",
        record.kind,
        "request",
        orjson.dumps(record.request).decode(),
        "stream",
        "1" if record.stream else "0",
        "request_id",
        record.request_id,
        "created",
        str(record.created),
        "traffic_class",
        record.traffic_class or "",
        "timeout_s",
        "" if record.timeout_s is None else repr(record.timeout_s),
        "key",
        record.key or "",
        "fingerprint",
        record.fingerprint,
    ]


def record_of(tenant: str, public_id: str, fields: dict[str, str]) -> RunRecord:
    """The record `record_fields` wrote."""
    return RunRecord(
        tenant,
        public_id,
        fields["kind"],
        orjson.loads(fields["request"]),
        fields["stream"] == "1",
        fields["request_id"],
        int(fields["created"]),
        fields["traffic_class"] or None,
        float(fields["timeout_s"]) if fields["timeout_s"] else None,
        fields["key"] or None,
        fields["fingerprint"],
    )


def idem_key(tenant: str, key: str) -> str:
    return tenant_key("idem", tenant, key)


def encode(event: Event, dispatched: bool) -> str:
    """An event as JSON, with whether its run had been dispatched (a refusal has not)."""
    wire: dict[str, Any] = {"k": int(event.kind), "s": event.sse.decode()}
    if event.index:
        wire["i"] = event.index
    if event.text:
        wire["t"] = event.text
    if event.tokens:
        wire["n"] = event.tokens
    if event.token_ids:
        wire["ids"] = list(event.token_ids)
    for name, value in (("f", event.fields), ("final", event.final), ("body", event.body)):
        if value is not None:
            wire[name] = value
    if event.logprobs is not None:
        wire["l"] = [asdict(logprob) for logprob in event.logprobs]
    if event.error is not None:
        wire["err"] = [event.error.status, event.error.to_body(), event.error.retry_after]
    if not dispatched:
        wire["undispatched"] = True
    return orjson.dumps(wire).decode()


def decode(raw: str) -> tuple[Event, bool]:
    """The event `encode` wrote, and whether its run had been dispatched."""
    wire = orjson.loads(raw)
    logprobs = wire.get("l")
    error = wire.get("err")
    return Event(
        Kind(wire["k"]),
        wire["s"].encode(),
        wire.get("i", 0),
        wire.get("t", ""),
        wire.get("n", 0),
        wire.get("f"),
        None
        if logprobs is None
        else [
            TokenLogprob(p["token"], p["logprob"], tuple(tuple(t) for t in p["top"]))
            for p in logprobs
        ],
        wire.get("ids", ()),
        wire.get("final"),
        wire.get("body"),
        None if error is None else restored(error[0], error[1], error[2]),
    ), not wire.get("undispatched", False)


class RedisRuns:
    """Resumable generations shared by replicas, in Redis (see the module's docstring): the
    `SharedRuns` port."""

    def __init__(
        self, state: RedisState, retention_s: float, grace_s: float, metrics: Metrics
    ) -> None:
        self.state = state
        self.metrics = metrics
        self.retention_ms = int(retention_s * 1000)
        self.grace_ms = int(grace_s * 1000)
        self.mirrors: set[RedisMirror] = set()
        self._open: Any = None
        self._append: Any = None
        self._claim: Any = None
        self._let_go: Any = None
        self._forget: Any = None

    @property
    def up(self) -> bool:
        return self.state.up

    async def start(self) -> None:
        await self.state.start()
        self._open = self.state.script(OPEN)
        self._append = self.state.script(APPEND)
        self._claim = self.state.script(CLAIM)
        self._let_go = self.state.script(LET_GO)
        self._forget = self.state.script(FORGET)
        for how in ("continued", "afresh"):
            self.metrics.state_takeovers.labels(how)  # from zero

    async def stop(self) -> None:
        """Give running mirrors one last chance to write what they hold."""
        mirrors = [mirror.stop() for mirror in list(self.mirrors)]
        if mirrors:
            await asyncio.gather(*mirrors, return_exceptions=True)

    async def open(self, record: RunRecord, key: str, fingerprint: str) -> tuple[str, str] | None:
        """Record a new generation under `key`, this replica holding its lease. None: made;
        else (the id, the fingerprint) of the generation already made under the key.
        StateUnavailable: nothing is recorded."""
        run, lease, _ = run_keys(record)
        state = self.state
        answer = await state.call(
            "open",
            self._open(
                keys=[idem_key(record.tenant, key), run, lease],
                args=[
                    record.public_id,
                    fingerprint,
                    state.replica,
                    state.lease_ms,
                    self.retention_ms,
                    *record_fields(record),
                ],
            ),
        )
        if answer[0] == 1:
            state.run_leases.add(lease)
            return None
        public_id, _, earlier = str(answer[1]).partition(" ")
        return public_id, earlier

    async def record(self, record: RunRecord) -> None:
        """Record a new generation made without a key, this replica holding its lease.
        StateUnavailable: nothing is recorded (or what is expires unused)."""
        run, lease, _ = run_keys(record)
        state, fields = self.state, record_fields(record)
        await state.call(
            "open",
            state.client.pipeline(transaction=True)
            .hset(run, mapping=dict(zip(fields[::2], fields[1::2], strict=True)))
            .pexpire(run, self.retention_ms)
            .set(lease, state.replica, px=state.lease_ms)
            .execute(),
        )
        state.run_leases.add(lease)

    async def forget(self, record: RunRecord) -> None:
        """Drop a generation recorded by `open` or `record` that was refused before it began:
        its key is free for a retry."""
        keys = run_keys(record)
        self.state.run_leases.discard(keys[1])
        if record.key is None:
            try:
                await self.state.call("release", self.state.client.delete(*keys))
            except StateUnavailable:  # its lease lapses, and the record expires, unused
                pass
            return
        try:
            await self.state.call(
                "release",
                self._forget(
                    keys=[idem_key(record.tenant, record.key), *keys],
                    args=[record.public_id + " "],
                ),
            )
        except StateUnavailable:
            # The key stays taken; a retry follows the record, which holds no events, until
            # its lease expires, then claims it and starts the generation afresh.
            pass

    async def find(self, tenant: str, public_id: str) -> RunRecord | None:
        probe = RunRecord(tenant, public_id, "", None, False, "", 0)
        fields = await self.state.call("find", self.state.client.hgetall(run_keys(probe)[0]))
        return record_of(tenant, public_id, fields) if fields else None

    def mirror(self, record: RunRecord) -> RedisMirror:
        return RedisMirror(self, record)

    def follow(self, record: RunRecord) -> RedisFollower:
        return RedisFollower(self, record)

    async def append(self, record: RunRecord, first: int, events: Sequence[str], end: str) -> int:
        """Log events `first`, `first` + 1, …; `end` "ended"/"refused" with the last. 1
        written; 0 the lease is another replica's (this one was fenced off); -1 the record is
        gone (Redis lost it)."""
        run, lease, events_key = run_keys(record)
        state = self.state
        written = int(
            await state.call(
                "append",
                self._append(
                    keys=[
                        run,
                        lease,
                        events_key,
                        idem_key(record.tenant, record.key) if record.key else run,
                    ],
                    args=[state.replica, self.retention_ms, end, first, state.lease_ms, *events],
                ),
            )
        )
        if end or written != 1:
            state.run_leases.discard(lease)
        return written

    async def claim(self, record: RunRecord) -> int:
        """Take over a generation whose lease expired: the events logged; -2 the generation
        ended, or is gone; -3 - its ms left while another replica's lease is live."""
        state, keys = self.state, run_keys(record)
        count = int(
            await state.call("claim", self._claim(keys=keys, args=[state.replica, state.lease_ms]))
        )
        if count >= 0:
            state.run_leases.add(keys[1])
        return count

    async def let_go(self, record: RunRecord) -> None:
        """Give the lease up at once (the replica is stopping): another replica can claim it."""
        lease = run_keys(record)[1]
        self.state.run_leases.discard(lease)
        await self.state.call("release", self._let_go(keys=[lease], args=[self.state.replica]))

    async def read(
        self, record: RunRecord, after: int, block_ms: int | None
    ) -> list[tuple[int, Event, bool]]:
        """The events after number `after`: waiting up to `block_ms` for one; None: all
        there are, at once."""
        events_key = run_keys(record)[2]
        if block_ms is None:
            entries = await self.state.call(
                "read", self.state.client.xrange(events_key, f"{after + 1}-0", "+")
            )
        else:
            answer = await self.state.call(
                "read",
                self.state.reader.xread(
                    {events_key: f"{after}-0"}, count=READ_COUNT, block=block_ms
                ),
                limit_s=block_ms / 1000 + self.state.config.timeout_s,
            )
            entries = [entry for _, stream in answer or () for entry in stream]
        return [
            (int(entry_id.split("-", 1)[0]), *decode(fields["e"])) for entry_id, fields in entries
        ]

    async def being_read(self, record: RunRecord) -> bool:
        """Whether a follower on some replica has a reader (within the grace period)."""
        return bool(await self.state.call("find", self.state.client.exists(reader_key(record))))

    async def reading(self, record: RunRecord) -> None:
        """A follower has a reader now."""
        await self.state.call(
            "renew", self.state.client.set(reader_key(record), 1, px=self.grace_ms)
        )


class RedisMirror:
    """Writes a run's events to its shared log, ahead of its readers: the log shows them to
    its readers once they are written (`EventLog.durable`). If a write fails, the readers go
    on from the local log and the mirror catches up when Redis answers again. If the lease
    was lost to another replica, the run is cancelled here; if Redis lost the record
    (restarted empty), the run goes on here alone. The `LogMirror` port."""

    def __init__(self, shared: RedisRuns, record: RunRecord, written: int = 0) -> None:
        self.shared = shared
        self.record = record
        self.written = written
        self._task: asyncio.Task[None] | None = None

    def start(self, log: EventLog, cancel: Callable[[SluiceError], None]) -> None:
        log.durable = self.written
        self.shared.mirrors.add(self)
        self._task = asyncio.get_running_loop().create_task(self._mirror(log, cancel))
        self._task.add_done_callback(lambda _: self.shared.mirrors.discard(self))

    async def stop(self) -> None:
        """Until what the mirror holds is written, for a second at most."""
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), PROBE_SECONDS)
            except TimeoutError:
                self._task.cancel()

    async def read_elsewhere(self) -> bool | None:
        """Whether a replica following the run has a reader (None: no answer in time)."""
        try:
            return await self.shared.being_read(self.record)
        except StateUnavailable:
            return None

    async def _mirror(self, log: EventLog, cancel: Callable[[SluiceError], None]) -> None:
        while True:
            while self.written == len(log):
                if log.concluded:
                    return
                await log.changed()
            upto = next((i for i in range(self.written, len(log)) if log[i].local), None)
            handed_over = upto is not None
            if upto is None:
                upto = len(log)
            end = (
                "" if not log.concluded or handed_over else "ended" if log.dispatched else "refused"
            )
            try:
                kept = await self.shared.append(
                    self.record,
                    self.written + 1,
                    [
                        encode(event, log.dispatched or event.kind is not Kind.FAILED)
                        for event in log[self.written : upto]
                    ],
                    end,
                )
                if kept == 1 and handed_over:
                    await self.shared.let_go(self.record)
            except StateUnavailable:
                log.durable = None  # its readers go on; the log catches up later
                await asyncio.sleep(PROBE_SECONDS)
                continue
            if kept == 1 and handed_over:
                self.written = upto
                log.durable = None  # what follows is this replica's alone
                log.wake()
                return
            if kept == -1:  # (Redis restarted empty): the generation goes on, here alone
                logger.warning(
                    "generation %s is no longer in the shared state: it goes on "
                    "on this replica alone",
                    self.record.public_id,
                )
                log.durable = None
                log.wake()
                return
            if kept == 0:
                logger.warning(
                    "generation %s was taken over by another replica", self.record.public_id
                )
                cancel(
                    GenerationFailed("another replica took this generation over; resume it there")
                )
                return
            self.written = upto
            if log.durable is not None or self.written == len(log):
                log.durable = self.written
            log.wake()


class RedisFollower:
    """Reads another replica's generation into a local log, and claims it when that
    replica's lease has expired (it died). `into` returns whether the run is now this
    replica's to continue (False: its log concluded). The `LogFollower` port."""

    def __init__(self, shared: RedisRuns, record: RunRecord) -> None:
        self.shared = shared
        self.record = record

    async def into(self, log: EventLog, reading: Callable[[], bool]) -> bool:
        seen = 0
        block_ms = READ_BLOCK_MS
        while True:
            if reading():
                await self.shared.reading(self.record)
            news = await self.shared.read(self.record, seen, block_ms)
            block_ms = READ_BLOCK_MS
            for seq, event, dispatched in news:
                if seq != seen + 1:  # (never: the log is written in order)
                    raise RuntimeError(f"event {seq} follows {seen}")
                seen = seq
                _follow(log, event, dispatched)
                if log.concluded:
                    return False
            if news:
                continue
            claimed = await self.shared.claim(self.record)
            if claimed <= -3:  # its replica holds it: read until the lease lapses
                block_ms = min(READ_BLOCK_MS, -3 - claimed + 5)
                continue
            if claimed == -2:  # ended, and the end is on its way; or expired meanwhile
                if not await self.shared.find(self.record.tenant, self.record.public_id):
                    raise GenerationFailed("the generation's log expired")
                continue
            # The events the dead replica logged after the last read, then ours.
            try:
                rest = await self.shared.read(self.record, seen, None)
            except StateUnavailable:  # not renewed: it lapses for another replica to claim
                self.shared.state.run_leases.discard(run_keys(self.record)[1])
                raise
            for seq, event, dispatched in rest:
                seen = seq
                _follow(log, event, dispatched)
            return True

    def mirror(self, written: int) -> RedisMirror:
        return RedisMirror(self.shared, self.record, written)


def _follow(log: EventLog, event: Event, dispatched: bool) -> None:
    """An event of the run as another replica logged it."""
    log.dispatched = log.dispatched or dispatched
    log.append(event)
