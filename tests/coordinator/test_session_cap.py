"""A client holds at most --client-max-sessions named sessions: both session
directories (in memory, and in a real Redis shared by two coordinators'
directories), then real coordinators over gRPC, with bearer tokens and without.

A new session past the cap is refused RESOURCE_EXHAUSTED naming the flag, with
nothing written; continuing one never is; closing one, or its expiry (in
memory as in Redis), frees a slot; another client is not affected."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis
from redis_server import RedisServer
from test_coordinator import fake_services
from test_session_owners import ALICE, BOB

from specdec.coordinator.directory import InMemoryDirectory, SessionRecord, TurnRecord
from specdec.coordinator.redis_directory import RedisDirectory, client_key, session_keys
from specdec.serving import errors
from specdec.serving.client import Client
from specdec.serving.config import CoordinatorConfig

from service_harness import LoopThread

CAP = 2
TTL_S = 2.0  # a short --redis-ttl, for expiry


@pytest.fixture
def server(tmp_path):
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.stop()


async def create(directory, session_id: str, client: str = "alice") -> None:
    """What a Generate does to the directory: the session's record written under its lease."""
    async with directory.hold(session_id) as lease:
        record = await directory.get(session_id) or SessionRecord(session_id, service_session_id=f"{session_id}~x")
        record.client = record.client or client
        record.turn = TurnRecord(1, [5], 10, {"seed": 7}, deltas=[[[7], "a"]])
        await directory.put(record, lease)
        record.turn.deltas.append([[8], "b"])
        await directory.add_delta(record, lease)


async def close(directory, session_id: str) -> bool:
    async with directory.hold(session_id) as lease:
        return await directory.delete(session_id, lease)


async def refused(directory, session_id: str, client: str = "alice") -> str:
    """The refusal of a new session: RESOURCE_EXHAUSTED naming the flag, nothing stored."""
    with pytest.raises(errors.ResourceExhausted) as caught:
        await create(directory, session_id, client)
    assert caught.value.retry_after_s == 60
    assert await directory.get(session_id) is None
    return str(caught.value)


@contextlib.asynccontextmanager
async def opened(kind: str, server=None, count: int = 1, ttl_s: float = 60):
    made = [RedisDirectory(server.url, ttl_s=ttl_s, max_per_client=CAP) if kind == "redis"
            else InMemoryDirectory(max_per_client=CAP, ttl_s=ttl_s) for _ in range(count)]
    try:
        yield made
    finally:
        for d in made:
            await d.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_the_cap_refuses_a_new_session_and_never_a_continued_one(kind, tmp_path):
    srv = RedisServer(tmp_path / "redis").start() if kind == "redis" else None

    async def check() -> None:
        async with opened(kind, srv) as (d,):
            await create(d, "a1")
            await create(d, "a2")
            why = await refused(d, "a3")
            assert "client 'alice' has reached its limit of 2 named sessions" in why
            assert "--client-max-sessions 2" in why and "CloseSession" in why
            with pytest.raises(errors.ResourceExhausted, match="--client-max-sessions 2"):
                await d.check_cap("a3", "alice")  # asked before the lease
            for session_id, client in (("a1", "alice"), ("b1", "bob"), ("", "alice")):
                await d.check_cap(session_id, client)  # an existing session, another client, a one-shot
            await create(d, "a1")  # continued, at the cap
            await create(d, "b1", client="bob")  # another client
            unnamed = SessionRecord("old", service_session_id="old~x")  # counted against no one (made before)
            async with d.hold("old") as lease:
                await d.put(unnamed, lease)
            assert await close(d, "a1")
            await create(d, "a3")  # the slot a1 held
            await refused(d, "a4")
            await create(d, "old")  # an existing session, counted from now on (alice: 3): never refused
            await create(d, "b2", client="bob")
            await refused(d, "b3", client="bob")
            assert await close(d, "a2")
            await refused(d, "a4")  # still 2

    try:
        asyncio.run(check())
    finally:
        if srv is not None:
            srv.stop()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_two_creations_at_the_cap_do_not_both_pass(kind, tmp_path):
    srv = RedisServer(tmp_path / "redis").start() if kind == "redis" else None

    async def check() -> None:
        async with opened(kind, srv, count=2 if srv else 1) as made:
            await create(made[0], "a1")
            outcomes = await asyncio.gather(*(create(made[i % len(made)], f"new{i}") for i in range(6)),
                                            return_exceptions=True)
            assert sum(o is None for o in outcomes) == 1
            assert all(isinstance(o, errors.ResourceExhausted) for o in outcomes if o is not None)

    try:
        asyncio.run(check())
    finally:
        if srv is not None:
            srv.stop()


def test_in_memory_a_session_forgotten_for_max_records_frees_its_slot():
    async def check() -> None:
        d = InMemoryDirectory(max_records=3, max_per_client=CAP)
        await create(d, "a1")
        await create(d, "a2")
        await create(d, "b1", client="bob")
        await create(d, "b2", client="bob")  # a1, the least recently written, is forgotten
        assert await d.get("a1") is None and d.sessions_of("alice") == 1
        await create(d, "a3")  # and now a2
        assert d.sessions_of("alice") == 1 and d.sessions_of("bob") == 2
        assert await close(d, "a3") and d.sessions_of("alice") == 0

    asyncio.run(check())


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_an_idle_session_expires_and_frees_its_slot_as_the_refusal_says(kind, tmp_path):
    srv = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
    ttl_s = 1.5

    async def check() -> None:
        async with opened(kind, srv, ttl_s=ttl_s) as (d,):
            await create(d, "a1")
            await create(d, "a2")
            why = await refused(d, "a3")
            assert "close one it no longer needs (CloseSession), or wait for one to expire (1.5 s without a " \
                   "turn: --redis-ttl), then retry" in why
            await asyncio.sleep(0.8)
            await create(d, "a2")  # continued: its clock starts again
            await asyncio.sleep(0.8)  # a1 idle past the TTL
            assert await d.get("a1") is None and await d.get("a2") is not None
            await create(d, "a3")  # the slot a1 held
            await refused(d, "a4")

    try:
        asyncio.run(check())
    finally:
        if srv is not None:
            srv.stop()


def test_a_coordinator_without_redis_forgets_idle_sessions_after_redis_ttl():
    from specdec.coordinator.engine import make_directory

    d = make_directory(CoordinatorConfig(tokenizer="none", client_max_sessions=CAP, redis_ttl_s=123.0))
    assert isinstance(d, InMemoryDirectory) and d.ttl_s == 123.0 and d.max_per_client == CAP


def test_in_redis_directories_sharing_it_count_together_and_expiry_frees_a_slot(server):
    async def check() -> None:
        async with opened("redis", server, count=2, ttl_s=TTL_S) as (d1, d2):
            await create(d1, "a1")
            await create(d2, "a2")
            await refused(d1, "a3")
            await refused(d2, "a3")
            assert await close(d1, "a2")  # closed through the other
            await create(d2, "a3")
            await refused(d1, "a4")
            await asyncio.sleep(TTL_S + 0.2)  # a1 and a3 idle past the TTL
            await create(d1, "a4")
            await create(d2, "a5")
            await refused(d1, "a6")

    asyncio.run(check())
    raw = redis.Redis.from_url(server.url, decode_responses=True)
    key = client_key("alice")
    members = raw.zrange(key, 0, -1, withscores=True)
    digests = {session_keys(s)["session"].split("{")[1].split("}")[0] for s in ("a4", "a5")}
    assert {m for m, _ in members} == digests  # a1 and a3 trimmed when a4 was counted
    assert all(0 < score / 1000 - time.time() <= TTL_S for _, score in members)  # each scored by its expiry
    assert 0 < raw.pttl(key) <= TTL_S * 1000 and "alice" not in key


def test_in_redis_a_session_evicted_for_memory_frees_its_slot_at_the_cap(server):
    async def check() -> None:
        async with opened("redis", server) as (d,):
            await create(d, "a1")
            await create(d, "a2")
            await refused(d, "a3")
            redis.Redis.from_url(server.url).delete(*session_keys("a1").values())  # as volatile-lru would
            await create(d, "a3")
            await refused(d, "a4")

    asyncio.run(check())


# ---------------------------------------------------------------- over gRPC


@pytest.fixture
def services():
    """The fake draft and target on loopback: their addresses."""
    with fake_services() as addresses:
        yield addresses


def start(loop: LoopThread, services, redis_url: str = "", tokens: bool = True, ttl_s: float = 86400.0):
    from specdec.coordinator.server import start_coordinator

    config = CoordinatorConfig(draft=services[0], target=services[1], host="127.0.0.1", port=0, tokenizer="none",
                               auth_tokens=f"alice:{ALICE},bob:{BOB}" if tokens else "", redis=redis_url,
                               client_max_sessions=CAP, redis_ttl_s=ttl_s)
    return loop.call(start_coordinator(config))


def turn(client: Client, session_id: str = "") -> None:
    client.complete(prompt_ids=[104, 101], max_new_tokens=2, session_id=session_id)


def over_cap(client: Client, session_id: str) -> str:
    with pytest.raises(errors.ResourceExhausted) as caught:
        turn(client, session_id)
    assert caught.value.retry_after_s == 60
    return str(caught.value)


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_coordinator_refuses_a_clients_session_past_the_cap(kind, services, tmp_path):
    srv = RedisServer(tmp_path / "redis").start() if kind == "redis" else None
    loop = LoopThread()
    running = start(loop, services, srv.url if srv else "")
    try:
        address = f"127.0.0.1:{running.port}"
        with Client(address, timeout=30, token=ALICE) as alice, Client(address, timeout=30, token=BOB) as bob:
            turn(alice, "s1")
            turn(alice, "s2")
            why = over_cap(alice, "s3")
            assert "--client-max-sessions 2" in why and "client 'alice'" in why
            turn(alice, "s1")  # continued at the cap
            turn(alice)  # one-shot requests do not count
            turn(bob, "b1")  # another client
            turn(bob, "b2")
            assert alice.close_session("s1")
            turn(alice, "s3")
            over_cap(alice, "s4")
        if srv is not None:  # refused before its lease: nothing of s4 in Redis
            keys = {k.decode() for k in redis.Redis.from_url(srv.url).keys("*")}
            assert not keys & set(session_keys("s4").values()) and client_key("alice") in keys
    finally:
        loop.call(running.stop())
        loop.close()
        if srv is not None:
            srv.stop()


def test_coordinators_sharing_redis_count_together_and_expiry_frees_a_slot(services, server):
    loop = LoopThread()
    running = [start(loop, services, server.url, ttl_s=TTL_S) for _ in range(2)]
    try:
        one, two = (Client(f"127.0.0.1:{r.port}", timeout=30, token=ALICE) for r in running)
        with one, two:
            turn(one, "s1")
            turn(two, "s2")
            over_cap(one, "s3")
            over_cap(two, "s3")
            assert two.close_session("s1")  # made on the other coordinator
            turn(one, "s3")
            over_cap(two, "s4")
            time.sleep(TTL_S + 0.2)  # s2 and s3 idle past --redis-ttl
            turn(two, "s4")
            turn(one, "s5")
            over_cap(two, "s6")
    finally:
        for r in running:
            loop.call(r.stop())
        loop.close()


def test_without_authentication_a_client_is_its_address(services):
    loop = LoopThread()
    running = start(loop, services, tokens=False)
    try:
        with Client(f"127.0.0.1:{running.port}", timeout=30) as anyone:
            turn(anyone, "s1")
            turn(anyone, "s2")
            why = over_cap(anyone, "s3")
            assert "client 'ipv4:127.0.0.1'" in why
            turn(anyone, "s2")
            assert anyone.close_session("s2")
            turn(anyone, "s3")
    finally:
        loop.call(running.stop())
        loop.close()


def test_a_creation_that_passed_the_early_check_is_refused_by_its_first_write(services):
    loop = LoopThread()
    running = start(loop, services)
    try:
        async def passes(session_id: str, client: str) -> None:  # as if another creation came in between
            return None

        running.engine.directory.check_cap = passes
        with Client(f"127.0.0.1:{running.port}", timeout=30, token=ALICE) as alice:
            turn(alice, "s1")
            turn(alice, "s2")
            over_cap(alice, "s3")
            turn(alice, "s1")
        assert len(running.engine.directory) == 2 and running.engine.directory.sessions_of("alice") == 2
    finally:
        loop.call(running.stop())
        loop.close()
