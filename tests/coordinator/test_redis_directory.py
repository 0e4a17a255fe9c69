"""The Redis session directory against a real redis-server: records, hashed
keys, the sliding TTL, the lease with its fencing token, and an outage.

The directory runs on its caller's event loop: each test is a coroutine, run by
``asyncio.run`` (see :func:`on_a_loop`), that makes its directories on that loop
and closes them there."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis
from redis_server import RedisServer

from specdec.coordinator.directory import Lease, SessionRecord, TurnRecord
from specdec.coordinator.redis_directory import RedisDirectory, session_keys
from specdec.serving import errors
from specdec.serving.config import redacted_url as redacted

from service_harness import on_a_loop


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


@contextlib.asynccontextmanager
async def directories(server):
    """Two coordinators' directories on one Redis, closed at the end."""
    made = [RedisDirectory(server.url, ttl_s=60, lease_s=0.6, lease_wait_s=0.3) for _ in range(2)]
    try:
        yield made
    finally:
        for d in made:
            await d.close()


def record(tokens=(1, 2, 3), session_id="chat\n1") -> SessionRecord:
    r = SessionRecord(session_id, tokens=list(tokens), service_session_id="chat~x")
    r.turn = TurnRecord(1, [5], 10, {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 7},
                        deltas=[[[7], "a"]], turn_id="t")
    return r


@on_a_loop
async def test_records_round_trip_under_hashed_keys_with_a_ttl(server):
    async with directories(server) as (d, _):
        async with d.hold("chat\n1") as lease:
            await d.put(record(), lease)
            got = await d.get("chat\n1")
            assert got.tokens == [1, 2, 3] and got.turn.generated == [7] and got.turn.turn_id == "t"
            got.turn.deltas.append([[8, 9], "bc"])
            await d.add_delta(got, lease)
            stale = await d.get("chat\n1")
            got.turn.deltas.append([[10], "d"])
            await d.put(record(), lease)  # the stored turn rewritten meanwhile: one delta again
            await d.add_delta(got, lease)  # out of step: the whole record is written
            assert (await d.get("chat\n1")).turn.generated == [7, 8, 9, 10]
            assert stale.turn.generated == [7, 8, 9]
        final = await d.get("chat\n1")
        assert final.turn.generated == [7, 8, 9, 10] and final.tokens == [1, 2, 3]
    raw = redis.Redis.from_url(server.url)
    keys = {k.decode() for k in raw.keys("*")}
    names = session_keys("chat\n1")
    assert keys == {names["session"], names["turn"], names["deltas"], names["fence"]}  # the lease went with the request
    assert all("chat" not in k for k in keys)  # no client-given id in Redis
    assert 50_000 < raw.pttl(session_keys("chat\n1")["session"]) <= 60_000


@on_a_loop
async def test_the_lease_is_exclusive_renewed_while_held_and_fences_writes(server):
    async with directories(server) as (a, b):
        async with a.hold("s") as lease:
            await a.put(record(session_id="s"), lease)
            await asyncio.sleep(1.0)  # past the 0.6 s lease: renewed in the background, on this loop
            with pytest.raises(errors.FailedPrecondition, match="busy on another coordinator"):
                async with b.hold("s"):
                    pass
            with pytest.raises(errors.FailedPrecondition, match="lost the session's lease"):
                await b.put(record(session_id="s"), Lease("s", lease.token + 1))  # a token that is not the holder's
        async with b.hold("s") as newer:
            assert newer.token > lease.token
            with pytest.raises(errors.FailedPrecondition, match="lost the session's lease"):
                await a.put(record([9], "s"), lease)  # the old holder, back from a stall: refused
            await b.delete("s", newer)
        assert await b.get("s") is None


@on_a_loop
async def test_a_lease_from_before_redis_restarted_empty_never_matches_a_new_one(server):
    """Redis forgot everything (FLUSHALL, as an empty restart): tokens count from
    1 again, so a stalled holder's token comes round again; its writes are still
    refused, because each lease also carries its holder's nonce."""
    async with directories(server) as (a, b):
        old = await a._acquire("s", 0.0, None)  # held by a coordinator that then stalls
        redis.Redis.from_url(server.url).flushall()
        async with b.hold("s") as new:
            assert new.token == old.token == 1 and new.nonce != old.nonce
            with pytest.raises(errors.FailedPrecondition, match="lost the session's lease"):
                await a.put(record([9], "s"), old)
            await b.put(record(session_id="s"), new)
        assert (await b.get("s")).tokens == [1, 2, 3]


@on_a_loop
async def test_a_dead_holder_frees_the_session_after_the_lease_time(server):
    async with directories(server) as (_, b):
        dead = RedisDirectory(server.url, ttl_s=60, lease_s=0.6)
        holding = dead.hold("s")
        await holding.__aenter__()
        dead._keeper.cancel()  # it stops renewing: as if the process died
        started = time.monotonic()
        async with b.hold("s", wait_s=3.0) as lease:
            assert lease.token == 2 and time.monotonic() - started < 1.5
        await dead.close()


@on_a_loop
async def test_an_outage_is_a_fast_unavailable_and_recovers(server):
    async with directories(server) as (d, _):
        server.stop()
        started = time.monotonic()
        for call in (lambda: d.get("s"), d.check):
            with pytest.raises(errors.Unavailable, match="session directory"):
                await call()
        assert time.monotonic() - started < 2.5
        server.start()
        await d.check()
        assert await d.get("s") is None


def test_urls_are_checked_and_passwords_kept_out_of_messages():
    with pytest.raises(ValueError, match="redis://"):
        RedisDirectory("http://localhost:6379", ttl_s=1)
    assert redacted("redis://user:secret@host:6380/0") == "redis://user:***@host:6380/0"
    assert redacted("rediss://:secret@host/0") == "rediss://***@host/0"
    assert redacted("unix:///tmp/redis.sock") == "unix:///tmp/redis.sock"


@on_a_loop
async def test_operations_are_timed_and_failures_counted(server):
    from specdec.telemetry.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics()
    d = RedisDirectory(server.url, ttl_s=60, lease_s=0.6, lease_wait_s=0.1, metrics=metrics)
    other = RedisDirectory(server.url, ttl_s=60, lease_s=0.6)
    try:
        async with other.hold("m"):
            with pytest.raises(errors.FailedPrecondition):
                async with d.hold("m"):
                    pass
        assert metrics.registry.get_sample_value("specdec_lease_conflicts_total") == 1
        assert metrics.registry.get_sample_value("specdec_directory_seconds_count", {"op": "lease"}) >= 1
        server.stop()
        with pytest.raises(errors.Unavailable):
            await d.get("m")
        assert metrics.registry.get_sample_value("specdec_directory_errors_total", {"op": "read"}) == 1
    finally:
        await d.close()
        await other.close()
