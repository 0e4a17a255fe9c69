"""A named session belongs to the client that made it, and another client
naming it holds nothing up: a real coordinator over gRPC, with bearer tokens
for two clients, in front of the fake draft and target services, its session
directory in memory or in a real Redis. The other client's calls are refused
before they take the session's lease, so not one of the owner's turns finds
the session busy."""

from __future__ import annotations

import asyncio
import threading

import pytest
from redis_server import RedisServer
from test_coordinator import fake_services

from specdec.coordinator.directory import InMemoryDirectory, SessionRecord
from specdec.coordinator.redis_directory import RedisDirectory
from specdec.serving import errors
from specdec.serving.client import Client
from specdec.serving.config import CoordinatorConfig

from service_harness import LoopThread

ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789ab"
TURNS = 40


@pytest.fixture
def services():
    """The fake draft and target on loopback: their addresses."""
    with fake_services() as addresses:
        yield addresses


@pytest.fixture(params=["memory", "redis"])
def coordinator(request, services, tmp_path):
    """A coordinator for alice and bob: its address."""
    from specdec.coordinator.server import start_coordinator

    redis = RedisServer(tmp_path / "redis").start() if request.param == "redis" else None
    loop = LoopThread()
    config = CoordinatorConfig(draft=services[0], target=services[1], host="127.0.0.1", port=0, tokenizer="none",
                               auth_tokens=f"alice:{ALICE},bob:{BOB}", redis=redis.url if redis else "")
    running = loop.call(start_coordinator(config))
    try:
        yield f"127.0.0.1:{running.port}"
    finally:
        loop.call(running.stop())
        loop.close()
        if redis is not None:
            redis.stop()


def keep_naming(address: str, session_id: str, stop: threading.Event, refused: list, other: list) -> None:
    """bob, until ``stop``: close ``session_id``, then continue it, again and again."""
    with Client(address, timeout=30, token=BOB) as bob:
        while not stop.is_set():
            for call in (lambda: bob.close_session(session_id),
                         lambda: bob.complete(prompt_ids=[33], max_new_tokens=2, session_id=session_id)):
                try:
                    call()
                    other.append("served")
                except errors.PermissionDenied as e:
                    refused.append(str(e))
                except errors.SpecdecError as e:
                    other.append(repr(e))


def test_another_client_naming_a_session_fails_none_of_its_owners_turns(coordinator):
    address = coordinator
    with Client(address, timeout=30, token=ALICE) as alice:
        alice.complete(prompt_ids=[104, 101], max_new_tokens=4, session_id="chat")
        stop, refused, other = threading.Event(), [], []
        bob = threading.Thread(target=keep_naming, args=(address, "chat", stop, refused, other))
        bob.start()
        failed = []
        try:
            for _ in range(TURNS):
                try:
                    alice.complete(prompt_ids=[33], max_new_tokens=4, session_id="chat")
                except errors.SpecdecError as e:
                    failed.append(repr(e))
        finally:
            stop.set()
            bob.join(30)
        history = alice.complete(prompt_ids=[33], max_new_tokens=4, session_id="chat").stats.history_tokens
        assert alice.close_session("chat") is True
    assert not failed, f"{len(failed)} of alice's {TURNS} turns failed: {failed[:3]}"
    assert history == 2 + 4 + TURNS * (1 + 4)  # bob closed nothing of it, nor added to it
    assert not other, other[:3]
    assert len(refused) >= 10 and all("belongs to another client" in why for why in refused)


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_both_directories_tell_a_sessions_owner_while_another_request_holds_it(kind, tmp_path):
    redis = RedisServer(tmp_path / "redis").start() if kind == "redis" else None

    async def check() -> None:
        directory = RedisDirectory(redis.url, ttl_s=60) if redis else InMemoryDirectory()
        try:
            assert await directory.owner("chat") is None
            async with directory.hold("open") as lease:
                await directory.put(SessionRecord("open", service_session_id="open~x"), lease)
            async with directory.hold("chat") as lease:
                await directory.put(SessionRecord("chat", owner="alice", service_session_id="chat~x"), lease)
                assert await directory.owner("chat") == "alice"  # read while the session is held
            assert await directory.owner("open") == ""  # made before authentication was on: no owner
        finally:
            await directory.close()

    try:
        asyncio.run(check())
    finally:
        if redis is not None:
            redis.stop()


def test_a_refused_requests_log_line_names_no_session(coordinator, caplog):
    """Refusals are logged at INFO, with the session's name replaced by a short
    hash of it: another client's refused calls do not spell the session's name
    into the logs (nor into the spans)."""
    import hashlib
    import logging

    session_id = "alice-private-conversation-42"
    with Client(coordinator, timeout=30, token=ALICE) as alice:
        alice.complete(prompt_ids=[33], max_new_tokens=2, session_id=session_id)
    caplog.set_level(logging.INFO)
    with Client(coordinator, timeout=30, token=BOB) as bob:
        with pytest.raises(errors.PermissionDenied, match=session_id):  # the caller is told which session
            bob.close_session(session_id)
    refusals = [r.getMessage() for r in caplog.records if "PERMISSION_DENIED" in r.getMessage()]
    assert refusals, caplog.text
    assert session_id not in caplog.text
    assert f"session#{hashlib.sha256(session_id.encode()).hexdigest()[:8]}" in refusals[0]
