"""A turn's writes ride out a Redis that cannot be written for a while
(restarted empty, stalled past the lease, full): retried, the lease taken
again and the record re-seeded when nothing another coordinator wrote is
overwritten; past the bound, UNAVAILABLE with a retry-after hint. Against a
real redis-server; the re-seed rule alone first."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time

import pytest
import redis
from redis_server import RedisServer

from specdec.coordinator.directory import SessionRecord, TurnRecord
from specdec.coordinator.outage import Backoff, may_reseed
from specdec.coordinator.redis_directory import RedisDirectory, session_keys
from specdec.serving import errors

from service_harness import on_a_loop


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    if srv.proc is not None:
        srv.proc.send_signal(signal.SIGCONT)  # (a test that failed while it was stopped)
    srv.stop()


@contextlib.asynccontextmanager
async def directory(server, **kwargs):
    d = RedisDirectory(server.url, **{"ttl_s": 60, "lease_s": 0.6, "lease_wait_s": 0.3, **kwargs})
    try:
        yield d
    finally:
        await d.close()


def record(number=2, deltas=((7,), (8, 9)), turn_id="t", session_id="s") -> SessionRecord:
    r = SessionRecord(session_id, tokens=[1, 2, 3], service_session_id="s~x")
    r.turn = TurnRecord(number, [5], 10, {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 7},
                        deltas=[[list(ids), "x"] for ids in deltas], turn_id=turn_id)
    return r


def stored(r: SessionRecord, deltas: int | None = None):
    """``r`` as the re-seed rule reads it back from Redis, its first ``deltas`` deltas."""
    turn = r.turn_dict()
    kept = turn.pop("deltas")[:deltas]
    return r.session_dict(), turn, kept


def test_reseeding_is_allowed_only_over_an_earlier_state_of_the_turn():
    ours = record()
    assert may_reseed(ours, None, None, [])  # Redis lost it all
    assert may_reseed(ours, *stored(ours))
    assert may_reseed(ours, *stored(ours, 1))  # the last delta was lost
    assert may_reseed(ours, *stored(record(number=1)))  # our first write was lost: the turn before, as we found it
    finished_elsewhere = record()
    finished_elsewhere.turn.finish_reason = "length"
    other_history = record(number=1)
    other_history.tokens = [1, 2, 3, 4]
    for session, turn, deltas in (
            stored(record(number=3)),  # a newer turn
            stored(record(turn_id="u")),  # another turn of the same number
            stored(record(deltas=((7,), (8, 10)))),  # other deltas
            stored(record(deltas=((7,), (8, 9), (10,)))),  # more deltas than ours: resumed elsewhere
            stored(finished_elsewhere),
            stored(other_history),
            (None, stored(ours)[1], []),  # a turn without its session
    ):
        assert not may_reseed(ours, session, turn, deltas)


def test_backoff_doubles_to_a_second_and_stops_at_the_bound():
    backoff = Backoff(2.0)
    waits = [backoff.next() for _ in range(6)]
    assert waits[:5] == [0.05, 0.1, 0.2, 0.4, 0.8] and waits[5] == pytest.approx(1.0, abs=0.01)
    backoff.deadline = time.monotonic()
    assert backoff.next() is None


async def later(seconds: float, action) -> None:
    await asyncio.sleep(seconds)
    await asyncio.to_thread(action)


@on_a_loop
async def test_a_write_rides_out_redis_restarting_empty_and_reseeds_the_record(server):
    async with directory(server) as d, d.hold("s") as lease:
        ours = record()
        await d.put(ours, lease)
        first = lease.token
        server.stop()
        ours.turn.deltas.append([[10], "y"])
        started = time.monotonic()
        restart = asyncio.create_task(later(0.8, server.start))
        await d.add_delta(ours, lease)  # held until Redis is back, then re-seeded
        await restart
        assert time.monotonic() - started >= 0.8 and d.writes_failing_since is None
        got = await d.get("s")
        assert got.turn.deltas == ours.turn.deltas and got.tokens == ours.tokens
        assert lease.nonce in redis.Redis.from_url(server.url).get(session_keys("s")["lease"]).decode()
        assert lease.token == first  # Redis counts tokens from 1 again: the nonce tells the holders apart
        ours.turn.deltas.append([[11], "z"])
        await d.add_delta(ours, lease)  # and the turn goes on
        assert (await d.get("s")).turn.generated == [7, 8, 9, 10, 11]


@on_a_loop
async def test_a_write_rides_out_a_stall_past_the_lease(server):
    async with directory(server) as d, d.hold("s") as lease:
        ours = record()
        await d.put(ours, lease)
        first = lease.token
        server.proc.send_signal(signal.SIGSTOP)
        resume = asyncio.create_task(later(1.5, lambda: server.proc.send_signal(signal.SIGCONT)))
        ours.turn.deltas.append([[10], "y"])
        await d.add_delta(ours, lease)  # the lease expired meanwhile (0.6 s): taken again
        await resume
        assert (await d.get("s")).turn.generated == [7, 8, 9, 10] and lease.token == first + 1
        await asyncio.sleep(0.8)  # past the lease: the keeper renews the new one
        assert redis.Redis.from_url(server.url).get(session_keys("s")["lease"]).decode() == \
            f"{lease.token}:{lease.nonce}"


@on_a_loop
async def test_the_keeper_retakes_a_lease_that_vanished_between_writes(server):
    async with directory(server) as d, d.hold("s") as lease:
        ours = record()
        await d.put(ours, lease)
        redis.Redis.from_url(server.url).flushall()  # as an empty restart between two writes
        await asyncio.sleep(0.5)  # a renewal (every 0.2 s) finds it gone and takes it again
        assert (await d.get("s")).turn.deltas == ours.turn.deltas


@on_a_loop
async def test_a_renewal_answered_after_the_hold_released_the_lease_does_not_take_it_back(server):
    raw = redis.Redis.from_url(server.url)
    async with directory(server, lease_s=30) as d:  # (the keeper's renewals, every 10 s, stay out of the way)
        async with d.hold("s") as lease:
            ours = record()
            await d.put(ours, lease)
            ours.turn.finish_reason = "stop"
            await d.put(ours, lease, keep_deltas=True)  # the turn ends
            held = d._held[id(lease)]
        # The keeper had copied the held leases and sent this one's renewal: the
        # hold's release reached Redis first, so the renewal finds no lease.
        await d._renew(held)
        assert raw.get(session_keys("s")["lease"]) is None
        started = time.monotonic()
        async with d.hold("s") as again:  # the client's next turn, sent at once, is not kept waiting
            assert again.token > lease.token
        assert time.monotonic() - started < 0.2


@on_a_loop
async def test_a_lease_taken_again_while_its_hold_ended_is_given_back(server):
    raw = redis.Redis.from_url(server.url)
    async with directory(server, lease_s=30) as d:
        inside, leave, holding = asyncio.Event(), asyncio.Event(), []

        async def turn() -> None:
            async with d.hold("s") as lease:
                await d.put(record(), lease)
                holding.append(d._held[id(lease)])
                inside.set()
                await leave.wait()

        ended = asyncio.create_task(turn())
        await inside.wait()
        raw.delete(session_keys("s")["lease"])  # vanished (a stall past it): the renewal takes it again ...
        reseed = d._reseed

        async def the_hold_ends_first(held):  # ... while the turn ends, its release finding nothing to release
            leave.set()
            await ended
            return await reseed(held)

        d._reseed = the_hold_ends_first
        await d._renew(holding[0])
        assert raw.get(session_keys("s")["lease"]) is None  # given back
        async with d.hold("s", wait_s=0) as again:
            assert again.token


@on_a_loop
async def test_a_turn_another_coordinator_took_over_is_lost(server):
    async with directory(server) as a, directory(server) as b:
        async with a.hold("s") as lease:
            ours = record()
            await a.put(ours, lease)
            raw = redis.Redis.from_url(server.url)
            raw.delete(session_keys("s")["lease"])  # a stalled past its lease: b takes the session
            async with b.hold("s") as theirs:
                await b.put(record(number=3, turn_id="u"), theirs)
            ours.turn.deltas.append([[10], "y"])
            with pytest.raises(errors.FailedPrecondition, match="another coordinator took the session over"):
                await a.add_delta(ours, lease)
        assert (await b.get("s")).turn.turn_id == "u"


@on_a_loop
async def test_past_the_bound_a_write_is_unavailable_with_a_retry_hint(server):
    async with directory(server, outage_s=0.4) as d, d.hold("s") as lease:
        ours = record()
        await d.put(ours, lease)
        server.stop()
        started = time.monotonic()
        ours.turn.deltas.append([[10], "y"])
        with pytest.raises(errors.Unavailable, match="--directory-outage") as raised:
            await d.add_delta(ours, lease)
        assert 1.0 <= time.monotonic() - started < 3 and raised.value.retry_after_s == 1.0
        started = time.monotonic()
        with pytest.raises(errors.Unavailable):  # the turn is ending: its last write is tried once
            await d.put(ours, lease)
        assert time.monotonic() - started < 1.5


@on_a_loop
async def test_check_fails_while_redis_refuses_writes(server):
    raw = redis.Redis.from_url(server.url)
    async with directory(server) as d:
        await d.check()
        raw.config_set("maxmemory-policy", "noeviction")
        raw.config_set("maxmemory", 1)
        try:
            with pytest.raises(errors.Unavailable, match="maxmemory"):
                await d.check()
            assert d.writes_failing_since is not None
        finally:
            raw.config_set("maxmemory", 0)
        await d.check()
        assert d.writes_failing_since is None
