"""The in-memory session directory and the one-request-per-session leases,
on an event loop (each test is a coroutine run by ``asyncio.run``)."""

from __future__ import annotations

import asyncio

import pytest

from specdec.coordinator import leases
from specdec.coordinator.directory import InMemoryDirectory, Lease, SessionRecord, TurnRecord
from specdec.coordinator.leases import SessionLeases
from specdec.serving import errors

from service_harness import on_a_loop


def with_turn(session_id: str, *deltas) -> SessionRecord:
    record = SessionRecord(session_id, tokens=[1])
    record.turn = TurnRecord(1, [5], 10, {"seed": 7}, deltas=[list(d) for d in deltas])
    return record


# ------------------------------------------------------------------ InMemoryDirectory

@on_a_loop
async def test_directory_stores_copies():
    d = InMemoryDirectory()
    record = SessionRecord("a", tokens=[1, 2], draft_synced=1)
    await d.put(record)
    record.tokens.append(3)
    got = await d.get("a")
    assert got.tokens == [1, 2] and got.draft_synced == 1
    got.tokens.append(9)
    assert (await d.get("a")).tokens == [1, 2]
    assert await d.delete("a") is True and await d.get("a") is None and await d.delete("a") is False
    small = InMemoryDirectory(max_records=2)
    for sid in ("x", "y", "x", "z"):  # x rewritten after y: y is the least recent
        await small.put(SessionRecord(sid))
    assert await small.get("y") is None and await small.get("x") is not None and len(small) == 2


@on_a_loop
async def test_deltas_are_appended_one_at_a_time_and_kept_on_request():
    d = InMemoryDirectory()
    record = with_turn("a", [[7], "a"])
    await d.put(record)
    record.turn.deltas.append([[8, 9], "bc"])
    await d.add_delta(record, None)
    assert (await d.get("a")).turn.deltas == [[[7], "a"], [[8, 9], "bc"]]
    record.turn.deltas.append([[10], "d"])
    await d.put(with_turn("a", [[7], "a"]))  # rewritten meanwhile: one delta stored again
    await d.add_delta(record, None)  # out of step: the whole record is written
    assert (await d.get("a")).turn.generated == [7, 8, 9, 10]
    record.tokens = [1, 7, 8, 9, 10]
    record.turn = TurnRecord(1, [5], 10, {"seed": 7}, deltas=[], finish_reason="length")
    await d.put(record, None, keep_deltas=True)  # the stored deltas stay
    got = await d.get("a")
    assert got.tokens == [1, 7, 8, 9, 10] and got.turn.finished and got.turn.generated == [7, 8, 9, 10]
    await d.put(with_turn("b", [[3], "c"]), None, keep_deltas=True)  # none stored: the record's own
    assert (await d.get("b")).turn.generated == [3]


@on_a_loop
async def test_a_session_idle_past_the_ttl_is_forgotten_and_frees_its_clients_slot():
    d = InMemoryDirectory(max_per_client=1, ttl_s=0.5)
    busy = with_turn("busy", [[7], "a"])
    busy.client = "bob"
    await d.put(busy)
    await d.put(SessionRecord("idle", client="alice"))
    with pytest.raises(errors.ResourceExhausted, match=r"or wait for one to expire \(0.5 s without a turn: "
                       r"--redis-ttl\)"):
        await d.put(SessionRecord("new", client="alice"))
    for n in range(4):  # a delta of busy's turn every 0.15 s: each restarts its clock
        await asyncio.sleep(0.15)
        busy.turn.deltas.append([[8 + n], "b"])
        await d.add_delta(busy, None)
    assert await d.get("idle") is None and await d.owner("idle") is None  # idle for 0.6 s: forgotten
    assert d.sessions_of("alice") == 0 and len(d) == 1
    assert (await d.get("busy")).turn.generated == [7, 8, 9, 10, 11]
    await d.check_cap("new", "alice")
    await d.put(SessionRecord("new", client="alice"))  # the slot idle held
    await asyncio.sleep(0.6)
    assert len(d) == 0 and d.sessions_of("alice") == d.sessions_of("bob") == 0
    assert await d.delete("new") is False
    kept = InMemoryDirectory()  # no TTL: kept until closed or forgotten for max_records
    await kept.put(SessionRecord("a"))
    await asyncio.sleep(0.01)
    assert await kept.get("a") is not None


@on_a_loop
async def test_directory_hold_yields_a_lease_or_none_when_cancelled():
    d = InMemoryDirectory()
    async with d.hold("a") as lease:
        assert lease == Lease("a")
    cancelled = asyncio.Event()
    cancelled.set()
    async with d.hold("a", cancelled) as lease:
        assert lease is None
    await d.check()
    await d.close()


# ------------------------------------------------------------------ SessionLeases

async def held(sessions: SessionLeases, session_id: str, cancelled: asyncio.Event | None,
               until: asyncio.Event, got: list) -> None:
    """Hold the session until ``until`` is set; what hold yielded goes in ``got``."""
    async with sessions.hold(session_id, cancelled) as ok:
        got.append(ok)
        await until.wait()


@on_a_loop
async def test_one_request_per_session_and_a_live_one_refuses_the_next_at_once():
    sessions, release, got = SessionLeases(), asyncio.Event(), []
    first = asyncio.create_task(held(sessions, "s", None, release, got))
    await asyncio.sleep(0)
    assert got == [True]
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(errors.FailedPrecondition, match="already generating"):
        async with sessions.hold("s"):
            pass
    assert loop.time() - started < 0.1  # no wait for a live request
    async with sessions.hold("other") as ok:  # other sessions are free
        assert ok
    release.set()
    await first
    async with sessions.hold("s") as ok:  # released: free again
        assert ok
    with pytest.raises(RuntimeError):  # released when the request fails, too
        async with sessions.hold("s"):
            raise RuntimeError
    async with sessions.hold("s") as ok:
        assert ok


@on_a_loop
async def test_one_shot_requests_hold_nothing():
    sessions = SessionLeases()
    async with sessions.hold("") as a, sessions.hold("") as b:
        assert a is True and b is True


async def holder_gone():
    """A request holding session "s" whose client has gone: it is still ending
    until ``release`` is set. Returns (the leases, release, its task)."""
    sessions, release, got = SessionLeases(), asyncio.Event(), []
    gone = asyncio.Event()
    first = asyncio.create_task(held(sessions, "s", gone, release, got))
    await asyncio.sleep(0)
    gone.set()  # after it got the session
    first.got = got  # what it yielded: True once it held the session
    return sessions, release, first


@on_a_loop
async def test_a_cancelled_request_is_waited_for_until_it_ends():
    sessions, release, first = await holder_gone()
    loop = asyncio.get_running_loop()
    loop.call_later(0.2, release.set)
    started = loop.time()
    async with sessions.hold("s") as ok:
        assert ok and first.done() and loop.time() - started >= 0.15
    await first


@on_a_loop
async def test_a_cancelled_request_that_does_not_end_is_waited_for_closing_wait_s(monkeypatch):
    monkeypatch.setattr(leases, "CLOSING_WAIT_S", 0.2)
    sessions, release, first = await holder_gone()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(errors.FailedPrecondition, match="already generating"):
        async with sessions.hold("s"):
            pass
    assert 0.15 <= loop.time() - started < 1.0
    release.set()
    await first


@on_a_loop
async def test_a_waiting_request_cancelled_itself_yields_false_at_once():
    sessions, release, first = await holder_gone()
    mine = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.call_later(0.1, mine.set)
    started = loop.time()
    async with sessions.hold("s", mine) as ok:
        assert ok is False and loop.time() - started < 1.0  # not the 10 s CLOSING_WAIT_S
    assert first.got == [True]
    release.set()
    await first
    async with sessions.hold("s") as ok:  # the one that yielded False held nothing
        assert ok
