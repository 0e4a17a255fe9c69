"""The per-service session store: which sessions a draft or target service holds.

Each session is one :class:`specdec.models.runner.Sequence` (its tokens and KV
cache on the service's device) plus the record of its last round, so that a
retried call (same ``round_id``) is answered from the record instead of being
applied twice.

Memory is bounded three ways: a cap on sessions and a cap on tokens held over
all sessions, the KV budget (least recently used sessions are evicted first),
and an idle TTL. Tokens are counted in whole KV blocks (``granule`` positions
each, as the model's paged store holds them), so the budget is block-exact.
Sessions in the middle of a call are never evicted: a call that would take the
budget past its cap with only such sessions left is refused
(RESOURCE_EXHAUSTED), never let grow the device's memory.
Eviction is always safe: an evicted session answers NOT_FOUND and the
coordinator re-pre-fills it from the token history it keeps (position 0 starts
a session afresh), so eviction costs time, never output.

The store lives on the event loop thread; calls on one session are serialised by
a per-session lock held for the whole call (including streaming), while model
work itself runs on the service's executor.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any, Generic, TypeVar

from specdec.serving.errors import (
    Draining,
    InvalidRequest,
    PositionMismatch,
    ResourceExhausted,
    SessionNotFound,
)
from specdec.serving.names import shown

log = logging.getLogger(__name__)

S = TypeVar("S")  # the per-session state: a Sequence in the services


def tokens_held(seq) -> int:
    """A plain sequence's size: its tokens."""
    return len(seq.tokens)


def no_headroom(block_size: int) -> int:
    return 0


@dataclasses.dataclass(frozen=True)
class SessionKind(Generic[S]):
    """What a service's sessions are, given by the service when it starts:
    ``new_state(model)`` makes an empty session's state on the loaded model
    (a :class:`~specdec.models.runner.ModelRunner`); ``size(state)`` is how many
    tokens it holds (what the KV budget bounds); ``kv_headroom(block_size)`` is
    how many KV positions beyond the budget the service's own work on its
    sessions may hold (drafting ahead), which its model's pool must add."""

    new_state: Callable[[Any], S]
    size: Callable[[S], int] = tokens_held
    kv_headroom: Callable[[int], int] = no_headroom


@dataclasses.dataclass
class Session(Generic[S]):
    id: str
    state: S
    last_used: float
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    # The last completed round: its id, a key of its request, and its result.
    round_id: int = 0
    round_key: Hashable = None
    round_result: Any = None
    tokens: int = 0  # held tokens as last accounted (see SessionStore._account)
    reserved: int = 0  # tokens the call in flight may add (counted against the budget meanwhile)

    def replay(self, round_id: int, key: Hashable) -> Any | None:
        """The recorded result if ``round_id`` is the last completed round, else None.
        ``round_id`` 0 means "no id": never replayed. Reusing an id for a different
        request is a caller bug and is refused rather than answered wrongly."""
        if round_id == 0 or round_id != self.round_id:
            return None
        if key != self.round_key:
            raise InvalidRequest(
                f"session {shown(self.id)!r}: round_id {round_id} was already used for a different request"
            )
        return self.round_result

    def record(self, round_id: int, key: Hashable, result: Any) -> None:
        if round_id:
            self.round_id, self.round_key, self.round_result = round_id, key, result


@dataclasses.dataclass
class StoreStats:
    active_sessions: int
    cached_tokens: int
    evictions: int  # evicted by the session or token cap
    expirations: int  # dropped after the idle TTL
    created: int
    budget_tokens: int = 0  # max_cached_tokens: the KV budget
    refusals: int = 0  # calls refused because the sessions in use hold the budget


class SessionStore(Generic[S]):
    """Sessions by id with LRU eviction and an idle TTL.

    ``new_state`` makes an empty per-session state; ``size`` says how many tokens
    a state holds (what ``max_cached_tokens`` bounds, counted in whole
    ``granule``-token blocks).
    """

    def __init__(
        self,
        new_state: Callable[[], S],
        *,
        max_sessions: int,
        max_cached_tokens: int,
        ttl_s: float,
        size: Callable[[S], int] = tokens_held,
        clock: Callable[[], float] = time.monotonic,
        granule: int = 1,
    ):
        self._new_state = new_state
        self._granule = granule
        self._raw_size = size
        self._size = lambda state: self._whole(size(state))
        self._clock = clock
        self.max_sessions = max_sessions
        self.max_cached_tokens = max_cached_tokens
        self.ttl_s = ttl_s
        self._sessions: collections.OrderedDict[str, Session[S]] = collections.OrderedDict()  # LRU first
        self._tokens = 0
        self._reserved = 0  # what calls in flight may add
        self.evictions = 0
        self.expirations = 0
        self.created = 0
        self.refusals = 0
        self.accept_new = True  # False while the service drains: only the sessions it holds go on

    # ------------------------------------------------------------------ queries

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def cached_tokens(self) -> int:
        return self._tokens

    def stats(self) -> StoreStats:
        return StoreStats(len(self._sessions), self._tokens, self.evictions, self.expirations, self.created,
                          self.max_cached_tokens, self.refusals)

    def quiet_for(self) -> float:
        """Seconds since a call last used one of the held sessions: 0 while a call
        holds one, infinite when none is held."""
        if any(s.lock.locked() for s in self._sessions.values()):
            return 0.0
        if not self._sessions:
            return float("inf")
        # The max, not the LRU order: a call's end updates last_used without reordering.
        return self._clock() - max(s.last_used for s in self._sessions.values())

    # ------------------------------------------------------------------ use

    @contextlib.asynccontextmanager
    async def open(self, session_id: str, position: int, *, reserve: int = 0) -> AsyncIterator[Session[S]]:
        """Hold ``session_id`` for one call that rolls back to ``position`` and then
        grows the session by up to ``reserve`` tokens.

        Position 0 starts the session if it is unknown (a fresh start or a
        re-pre-fill after eviction); otherwise an unknown session is
        :class:`SessionNotFound`. A position beyond what the session holds is
        :class:`PositionMismatch`. On exit the session's size is re-accounted and
        the caps are enforced on the *other* sessions."""
        if not session_id:
            raise InvalidRequest("session_id is empty")
        if self._whole(position + reserve) > self.max_cached_tokens:
            raise ResourceExhausted(
                f"session {shown(session_id)!r} would hold {position + reserve} tokens, more than this "
                f"service's cap of {self.max_cached_tokens} cached tokens"
            )
        self.sweep()
        while True:
            session = self._sessions.get(session_id)
            if session is None:
                if position != 0:
                    raise SessionNotFound(
                        f"session {shown(session_id)!r} is not held by this service (never started, ended, "
                        f"evicted or expired); start it again at position 0"
                    )
                if not self.accept_new:
                    raise Draining(f"session {shown(session_id)!r} cannot start: this service is shutting down "
                                      "and only finishes the sessions it holds")
                session = self._create(session_id)
            await session.lock.acquire()
            if self._sessions.get(session_id) is session:
                break
            session.lock.release()  # ended or evicted while we waited: look again
        try:
            held = self._raw_size(session.state)
            if position > held:
                raise PositionMismatch(shown(session_id), position, held)
            session.last_used = self._clock()
            self._sessions.move_to_end(session_id)
            # make room now for what this call will add, evicting idle others
            extra = max(0, self._whole(position + reserve) - self._whole(held))
            self._enforce_caps(keep=session, extra=extra)
            if self._tokens + self._reserved + extra > self.max_cached_tokens:
                self._refuse(session, extra)
            session.reserved = extra
            self._reserved += extra
            try:
                yield session
            finally:
                self._reserved -= session.reserved
                session.reserved = 0
                session.last_used = self._clock()
                self._account(session)
                self._enforce_caps(keep=session)
        finally:
            session.lock.release()

    def end(self, session_id: str) -> bool:
        """Forget a session (its KV cache goes with it). True if it was held."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self._tokens -= session.tokens
        return True

    def holds(self, session: Session[S]) -> bool:
        """Whether ``session`` is still held (not ended, evicted or replaced)."""
        return self._sessions.get(session.id) is session

    def sweep(self) -> int:
        """Drop sessions idle for longer than the TTL; returns how many."""
        deadline = self._clock() - self.ttl_s
        dropped = 0
        for sid in list(self._sessions):  # oldest first
            s = self._sessions[sid]
            if s.last_used > deadline:
                break
            if s.lock.locked():
                continue
            self.end(sid)
            self.expirations += 1
            dropped += 1
            log.info("session %r expired after %.0f s idle", shown(sid), self.ttl_s)
        return dropped

    async def expire_forever(self) -> None:
        """Expire idle sessions even when no call arrives to trigger it (the
        service runs it as a task while it serves)."""
        period = max(0.5, min(self.ttl_s / 4, 30.0))
        while True:
            await asyncio.sleep(period)
            self.sweep()

    # ------------------------------------------------------------------ internals

    def _whole(self, tokens: int) -> int:
        """``tokens`` rounded up to whole blocks."""
        return -(-tokens // self._granule) * self._granule

    def _refuse(self, session: Session[S], extra: int) -> None:
        """What is left of the budget is held by sessions in calls: refuse this one."""
        self.refusals += 1
        in_use = self._tokens + self._reserved
        if session.tokens == 0 and self._size(session.state) == 0:  # created for this call: not kept
            self.end(session.id)
        raise ResourceExhausted(
            f"session {shown(session.id)!r} needs {extra} more tokens of KV cache, but sessions in use hold {in_use} "
            f"of this service's budget of {self.max_cached_tokens} tokens (--max-cached-tokens); "
            "try again when other generations finish")

    def _create(self, session_id: str) -> Session[S]:
        session = Session(id=session_id, state=self._new_state(), last_used=self._clock())
        self._sessions[session_id] = session
        self.created += 1
        self._enforce_caps(keep=session)
        return session

    def _account(self, session: Session[S]) -> None:
        if self._sessions.get(session.id) is not session:
            return  # ended or evicted meanwhile: no longer counted
        size = self._size(session.state)
        self._tokens += size - session.tokens
        session.tokens = size

    def _enforce_caps(self, keep: Session[S], extra: int = 0) -> None:
        """Evict least recently used sessions (never ``keep``, never one with a
        call in flight) until both caps hold."""
        for sid in list(self._sessions):
            over_sessions = len(self._sessions) > self.max_sessions
            over_tokens = self._tokens + self._reserved + extra > self.max_cached_tokens
            if not (over_sessions or over_tokens):
                return
            s = self._sessions[sid]
            if s is keep or s.lock.locked():
                continue
            self.end(sid)
            self.evictions += 1
            log.info("evicted session %r (%d tokens): %s cap reached", shown(sid), s.tokens,
                     "session" if over_sessions else "cached-token")
