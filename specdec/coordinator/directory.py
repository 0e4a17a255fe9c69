"""The session directory: what the coordinator remembers about each session.

A session's KV caches live in the draft and target services; the directory holds
everything needed to *rebuild* them (the token history) and to continue the
conversation (sampling parameters, how far each side is known to be in sync).
Because the history is here, a service that evicted a session costs a re-pre-fill,
never a different output.

Each record has two parts: the session (its committed history, written when a
turn starts and when it ends) and its last turn (the deltas streamed so far,
each appended after its round and *before* it is streamed). So a turn cut
short — the client's connection dropped, or this coordinator died — can be
resumed, by any coordinator sharing the directory, from exactly the delta the
client got last.

Two directories implement :class:`SessionDirectory`: :class:`InMemoryDirectory`
(one coordinator, nothing to install) and
:class:`specdec.coordinator.redis_directory.RedisDirectory` (shared by coordinator
replicas). Writes go through a :class:`Lease`: one request per session at a time,
across every coordinator sharing the directory. Both are asynchronous and run on
the caller's event loop (the coordinator's one loop).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Protocol

from specdec.coordinator.leases import SessionLeases
from specdec.serving import errors
from specdec.serving.names import hidden_in

log = logging.getLogger("specdec.coordinator")

# When a client refused a new session for --client-max-sessions may try again: a
# slot frees when it closes a session, or one of its sessions idles out (--redis-ttl).
SESSION_CAP_RETRY_S = 60.0


@dataclasses.dataclass
class TurnRecord:
    """A session's last turn, as far as it was streamed."""

    number: int  # 1 for the session's first turn
    prompt_ids: list[int]
    max_new_tokens: int
    sampling: dict  # the turn's sampling parameters, seed filled in
    stop: list[str] = dataclasses.field(default_factory=list)
    turn_id: str = ""  # the client's name for it ("" : none given, not resumable)
    # The deltas streamed, in order: (token ids, text) each.
    deltas: list[list] = dataclasses.field(default_factory=list)
    finish_reason: str = ""  # set when the turn finished: its tokens are then in the history

    @property
    def generated(self) -> list[int]:
        return [token for ids, _ in self.deltas for token in ids]

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)


@dataclasses.dataclass
class SessionRecord:
    """One session, as the coordinator knows it between requests."""

    session_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)  # committed history
    owner: str = ""  # the client that created it, when the coordinator authenticates clients
    # Who the session counts against under --client-max-sessions: its creator's
    # token name, or without authentication its address ("": not counted).
    client: str = ""
    # The replicas the session is pinned to (their addresses) and the prefix of
    # ``tokens`` each is known to hold.
    draft_replica: str = ""
    target_replica: str = ""
    draft_synced: int = 0
    target_synced: int = 0
    # Sampling parameters of the last request (seed included), as plain values so
    # the record serialises trivially.
    sampling: dict = dataclasses.field(default_factory=dict)
    gamma_policy: str = ""
    # What adaptive γ saw of this session's acceptance (its regime, and the
    # counts by draft position), for its next turn on any coordinator.
    gamma_state: dict = dataclasses.field(default_factory=dict)
    next_round_id: int = 1  # round ids stay unique across turns (0 means "no id" to the services)
    # The session's name in the draft and target services (set when the record
    # is created): the session id plus a random suffix, so that two coordinators
    # (or one restarted, its directory lost) given the same session id never
    # continue each other's KV state.
    service_session_id: str = ""
    updated_at: float = dataclasses.field(default_factory=time.time)
    turn: TurnRecord | None = None  # stored apart: see the module docstring

    def session_dict(self) -> dict:
        return {f.name: _copy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "turn"}

    def turn_dict(self) -> dict | None:
        return None if self.turn is None else _copy(dataclasses.asdict(self.turn))

    @classmethod
    def from_dicts(cls, session: dict, turn: dict | None) -> SessionRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        record = cls(**{k: _copy(v) for k, v in session.items() if k in known and k != "turn"})
        if turn is not None:
            record.turn = TurnRecord(**_copy(turn))
        return record


@dataclasses.dataclass
class Lease:
    """The right to write one session's record, held by one request. ``token``
    is the fencing token of a shared directory (0 for the in-memory one): every
    write checks it is still the session's current lease, so a coordinator that
    lost its lease (it stalled past the lease time, and another took over)
    cannot overwrite what the new holder wrote."""

    session_id: str
    token: int = 0
    nonce: str = ""  # with the token in a shared directory: unique even if Redis restarted empty


class SessionDirectory(Protocol):
    """The coordinator's store of sessions. Every method runs on the caller's
    event loop (the coordinator's one loop): a directory is used on one loop only."""

    async def get(self, session_id: str) -> SessionRecord | None:
        """The stored record (with its last turn), or None for an unknown (or closed) session."""

    async def owner(self, session_id: str) -> str | None:
        """The client a stored session belongs to ("" : none), or None for an
        unknown session. Read before anything else of the session, its lease
        included: a request naming another client's session is refused having
        held up nothing."""

    async def put(self, record: SessionRecord, lease: Lease | None, keep_deltas: bool = False) -> None:
        """Create or replace the record, its last turn included (``keep_deltas``:
        but not the turn's deltas, which are stored already, all of them).
        ResourceExhausted, nothing written, if it would create a session past
        the cap of ``record.client`` (:func:`over_cap`)."""

    async def add_delta(self, record: SessionRecord, lease: Lease | None) -> None:
        """Append the last of ``record.turn.deltas`` to the stored turn (after
        each round: one delta written, not the whole turn)."""

    async def delete(self, session_id: str, lease: Lease | None) -> bool:
        """Forget the session; True if it existed."""

    def hold(self, session_id: str, cancelled: asyncio.Event | None = None,
             wait_s: float | None = None) -> contextlib.AbstractAsyncContextManager[Lease | None]:
        """Hold the session for one request (``async with directory.hold(...) as
        lease``): yields its lease, or None if the request was cancelled before
        it got it. FailedPrecondition when another request keeps it past ``wait_s``."""

    async def check_cap(self, session_id: str, client: str) -> None:
        """ResourceExhausted (:func:`over_cap`) if ``session_id`` is a new session
        and ``client`` holds its cap already. Asked before the session's lease,
        so that most refusals hold up and leave nothing; the write that would
        create the session checks again (:meth:`put`), atomically."""

    async def check(self) -> None:
        """Raise Unavailable if the directory cannot be reached, or written, now."""

    async def close(self) -> None: ...


class InMemoryDirectory:
    """The default directory: dicts in this process (one coordinator, nothing to
    install). Records are copied in and out so callers never share mutable state
    with the store — the same semantics a networked store has. A session not
    written for ``ttl_s`` (--redis-ttl; None: kept) is forgotten, as Redis
    forgets it; at most ``max_records`` are kept, beyond that the least recently
    written is dropped (a client that never closes its sessions cannot grow the
    coordinator without bound); and at most ``max_per_client`` (0: any number)
    count against one client (:attr:`SessionRecord.client`): creating one more
    is refused (:func:`over_cap`) until one is closed, forgotten or expires.

    The records are ordered by their last write (each delta counts, as it
    refreshes the TTL in Redis): the expired ones are at the front, dropped by
    every method before it looks (:meth:`_expire`, the work of those dropped).

    The methods are coroutines only to match :class:`SessionDirectory`: none of
    them awaits anything, so on the one event loop each runs whole, and the
    dicts need no lock."""

    def __init__(self, max_records: int = 100_000, max_per_client: int = 0, ttl_s: float | None = None) -> None:
        self.max_records, self.max_per_client, self.ttl_s = max_records, max_per_client, ttl_s
        self._by_client: dict[str, set[str]] = {}  # client -> its stored sessions' ids
        # session id -> [session dict, turn dict | None, time.monotonic() of its last write], least recent first
        self._records: collections.OrderedDict[str, list] = collections.OrderedDict()
        self._leases = SessionLeases()

    async def get(self, session_id: str) -> SessionRecord | None:
        self._expire()
        parts = self._records.get(session_id)
        return None if parts is None else SessionRecord.from_dicts(*parts[:2])

    async def owner(self, session_id: str) -> str | None:
        self._expire()
        parts = self._records.get(session_id)
        return None if parts is None else parts[0].get("owner", "")

    async def put(self, record: SessionRecord, lease: Lease | None = None, keep_deltas: bool = False) -> None:
        self._expire()
        record.updated_at = time.time()
        turn = record.turn
        if keep_deltas and turn is not None:  # copy all but the deltas
            record.turn = dataclasses.replace(turn, deltas=[])
            parts = [record.session_dict(), record.turn_dict()]
            record.turn = turn
            # The stored ones, else (forgotten meanwhile) a copy.
            stored = self._records.get(record.session_id, [None, None])[1]
            parts[1]["deltas"] = stored["deltas"] if stored is not None else _copy(turn.deltas)
        else:
            parts = [record.session_dict(), record.turn_dict()]
        self._count(record)
        self._records[record.session_id] = [*parts, time.monotonic()]
        self._records.move_to_end(record.session_id)
        while len(self._records) > self.max_records:
            dropped, (session, *_) = self._records.popitem(last=False)
            self._uncount(session.get("client", ""), dropped)
            log.info("session directory full (%d): forgot the least recently used session, %s",
                     self.max_records, hidden_in(dropped, dropped))

    async def add_delta(self, record: SessionRecord, lease: Lease | None = None) -> None:
        self._expire()
        ids, text = record.turn.deltas[-1]
        parts = self._records.get(record.session_id)
        stored = parts[1] if parts is not None else None
        if stored is not None and len(stored["deltas"]) == len(record.turn.deltas) - 1:
            stored["deltas"].append([list(ids), text])
            parts[2] = time.monotonic()  # written: its idle time starts again
            self._records.move_to_end(record.session_id)
            return
        await self.put(record, lease)  # forgotten meanwhile (expired, or the directory was full), or out of step

    async def delete(self, session_id: str, lease: Lease | None = None) -> bool:
        self._expire()
        parts = self._records.pop(session_id, None)
        if parts is not None:
            self._uncount(parts[0].get("client", ""), session_id)
        return parts is not None

    def _count(self, record: SessionRecord) -> None:
        """Count the session against its client, before it is stored;
        ResourceExhausted if it is new and its client holds its cap already."""
        stored = self._records.get(record.session_id)
        before = stored[0].get("client", "") if stored is not None else ""
        if record.client == before:
            return
        if stored is None and 0 < self.max_per_client <= self.sessions_of(record.client):
            raise over_cap(record.client, self.max_per_client, self.ttl_s)
        self._uncount(before, record.session_id)
        if record.client:
            self._by_client.setdefault(record.client, set()).add(record.session_id)

    def _uncount(self, client: str, session_id: str) -> None:
        held = self._by_client.get(client)
        if held is not None:
            held.discard(session_id)
            if not held:
                del self._by_client[client]

    def _expire(self) -> None:
        """Forget the sessions not written for ``ttl_s``: the first ones, in
        the order of their last write."""
        if not self.ttl_s:
            return
        oldest = time.monotonic() - self.ttl_s
        expired = 0
        while self._records:
            session_id, (session, _, written) = next(iter(self._records.items()))
            if written > oldest:
                break
            del self._records[session_id]
            self._uncount(session.get("client", ""), session_id)
            expired += 1
        if expired:
            log.info("forgot %d session%s idle for %g s (--redis-ttl)", expired, "" if expired == 1 else "s",
                     self.ttl_s)

    def sessions_of(self, client: str) -> int:
        """How many stored sessions count against ``client``."""
        self._expire()
        return len(self._by_client.get(client, ()))

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str, cancelled: asyncio.Event | None = None,
                   wait_s: float | None = None) -> AsyncIterator[Lease | None]:
        async with self._leases.hold(session_id, cancelled) as held:
            yield Lease(session_id) if held else None

    async def check_cap(self, session_id: str, client: str) -> None:
        self._expire()
        if session_id and session_id not in self._records and 0 < self.max_per_client <= self.sessions_of(client):
            raise over_cap(client, self.max_per_client, self.ttl_s)

    async def check(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def __len__(self) -> int:
        self._expire()
        return len(self._records)


def over_cap(client: str, cap: int, ttl_s: float | None) -> errors.ClientLimitExceeded:
    """The refusal of a new session to a client holding ``cap`` (--client-max-sessions),
    in a directory that forgets a session idle for ``ttl_s`` (--redis-ttl; None: never)."""
    expiry = f", or wait for one to expire ({ttl_s:g} s without a turn: --redis-ttl)" if ttl_s else ""
    return errors.ClientLimitExceeded(
        f"client {client!r} has reached its limit of {cap} named sessions (--client-max-sessions {cap}): close "
        f"one it no longer needs (CloseSession){expiry}, then retry; its sessions can still be continued",
        retry_after_s=SESSION_CAP_RETRY_S)


def _copy(value):
    """A copy deep enough for records: lists and dicts of plain values, nested."""
    if isinstance(value, list):
        return [_copy(v) if isinstance(v, (list, dict)) else v for v in value]
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value
