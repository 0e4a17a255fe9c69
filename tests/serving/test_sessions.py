"""The per-service session store: caps, LRU, TTL, positions, round-id replay."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from specdec.serving.errors import (
    Draining,
    InvalidRequest,
    PositionMismatch,
    ResourceExhausted,
    SessionNotFound,
)
from specdec.serving.sessions import SessionStore


@dataclasses.dataclass
class FakeSeq:
    tokens: list


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_store(**kw):
    clock = Clock()
    opts = dict(max_sessions=3, max_cached_tokens=100, ttl_s=60.0)
    opts.update(kw)
    return SessionStore(lambda: FakeSeq([]), clock=clock, **opts), clock


def run(coro):
    return asyncio.run(coro)


async def grow(store, sid, position, add):
    """One call: roll back to ``position`` and append ``add`` tokens."""
    async with store.open(sid, position, reserve=add) as s:
        del s.state.tokens[position:]
        s.state.tokens.extend(range(add))
        return s


def test_position_zero_starts_a_session_and_others_are_not_found():
    store, _ = make_store()

    async def go():
        with pytest.raises(SessionNotFound, match="'a'.*position 0"):
            await grow(store, "a", 3, 1)
        await grow(store, "a", 0, 5)
        assert "a" in store and store.cached_tokens == 5
        await grow(store, "a", 5, 2)  # continue
        assert store.cached_tokens == 7
        await grow(store, "a", 3, 1)  # roll back to 3, append 1
        assert store.cached_tokens == 4

    run(go())


def test_position_beyond_held_names_both_numbers():
    store, _ = make_store()

    async def go():
        await grow(store, "a", 0, 4)
        with pytest.raises(PositionMismatch) as e:
            await grow(store, "a", 9, 1)
        assert "position 9" in str(e.value) and "only 4 tokens" in str(e.value)
        assert (e.value.position, e.value.held) == (9, 4)

    run(go())


def test_lru_eviction_by_session_count():
    store, _ = make_store(max_sessions=3)

    async def go():
        for sid in "abc":
            await grow(store, sid, 0, 1)
        await grow(store, "a", 1, 1)  # a is now the most recently used
        await grow(store, "d", 0, 1)  # evicts b, the least recently used
        assert [s in store for s in "abcd"] == [True, False, True, True]
        assert store.evictions == 1 and len(store) == 3
        with pytest.raises(SessionNotFound):
            await grow(store, "b", 1, 1)

    run(go())


def test_lru_eviction_by_cached_tokens():
    store, _ = make_store(max_sessions=10, max_cached_tokens=20)

    async def go():
        await grow(store, "a", 0, 8)
        await grow(store, "b", 0, 8)
        await grow(store, "c", 0, 8)  # 24 > 20: a goes
        assert "a" not in store and store.cached_tokens == 16
        with pytest.raises(ResourceExhausted, match="cap of 20"):
            await grow(store, "d", 0, 21)  # could never fit
        assert store.stats().evictions == 1

    run(go())


def test_tokens_are_counted_in_whole_kv_blocks():
    """With blocks of 8 positions, a session of 9 tokens holds 16 of the budget:
    eviction and refusal are exact to the block the store allocates."""
    store, _ = make_store(max_sessions=10, max_cached_tokens=32, granule=8)

    async def go():
        await grow(store, "a", 0, 9)
        assert store.cached_tokens == 16
        await grow(store, "b", 0, 8)
        assert store.cached_tokens == 24
        await grow(store, "c", 0, 3)  # 24 + 8 = 32: fits
        assert len(store) == 3 and store.cached_tokens == 32
        await grow(store, "c", 3, 6)  # c grows to 9 tokens, 16: a (least recent) goes
        assert "a" not in store and store.cached_tokens == 24
        with pytest.raises(ResourceExhausted, match="would hold 33 tokens, more than this service's cap of 32"):
            await grow(store, "d", 0, 33)

    run(go())


def test_idle_ttl_expires_sessions():
    store, clock = make_store(ttl_s=60)

    async def go():
        await grow(store, "old", 0, 2)
        clock.now = 50
        await grow(store, "new", 0, 2)
        clock.now = 70  # old idle 70 s, new 20 s
        assert store.sweep() == 1
        assert "old" not in store and "new" in store and store.expirations == 1
        assert store.cached_tokens == 2

    run(go())


def test_round_id_replay_and_misuse():
    store, _ = make_store()

    async def go():
        async with store.open("a", 0, reserve=3) as s:
            assert s.replay(1, "k") is None
            s.state.tokens.extend([1, 2, 3])
            s.record(1, "k", "result-1")
        async with store.open("a", 0) as s:
            assert s.replay(1, "k") == "result-1"  # a retry: answered from the record
            with pytest.raises(InvalidRequest, match="round_id 1"):
                s.replay(1, "other request")
            assert s.replay(2, "k") is None  # a new round
            assert s.replay(0, "k") is None  # 0: no round id, never replayed
            s.record(0, "k", "ignored")
            assert s.round_result == "result-1"

    run(go())


def test_end_frees_and_calls_on_a_session_are_serialised():
    store, _ = make_store()
    order = []

    async def call(tag, pause):
        async with store.open("a", 0):
            order.append(f"{tag}-in")
            await asyncio.sleep(pause)
            order.append(f"{tag}-out")

    async def go():
        await grow(store, "a", 0, 3)
        await asyncio.gather(call("x", 0.05), call("y", 0))
        assert order == ["x-in", "x-out", "y-in", "y-out"]
        assert store.end("a") and not store.end("a")
        assert store.cached_tokens == 0 and len(store) == 0

    run(go())


def test_busy_sessions_are_not_evicted():
    store, _ = make_store(max_sessions=1)

    async def go():
        async with store.open("a", 0) as a:
            a.state.tokens.append(1)
            await grow(store, "b", 0, 1)  # over the cap, but a is in use
            assert "a" in store and "b" in store
        await grow(store, "c", 0, 1)
        assert len(store) == 1 and "c" in store

    run(go())


def test_a_draining_store_refuses_new_sessions_and_says_how_quiet_it_is():
    """While a service drains it finishes the sessions it holds (their calls go
    on) and starts none; quiet_for() tells it when their generations have ended."""
    store, clock = make_store()

    async def go():
        assert store.quiet_for() == float("inf")  # nothing held
        await grow(store, "a", 0, 5)
        clock.now = 3.0
        await grow(store, "b", 0, 2)
        clock.now = 4.5
        assert store.quiet_for() == 1.5  # since b's call
        store.accept_new = False
        await grow(store, "a", 5, 2)  # a held session goes on
        assert store.quiet_for() == 0.0
        with pytest.raises(Draining, match="'c' cannot start: this service is shutting down"):
            await grow(store, "c", 0, 1)
        assert "c" not in store
        async with store.open("b", 2):
            assert store.quiet_for() == 0.0  # a call in flight
        store.end("a")
        store.end("b")
        assert store.quiet_for() == float("inf")

    run(go())
