"""Riding out a shared session directory that cannot be written for a while
(Redis restarting, stalled, or refusing writes): the rules, apart from Redis.

A turn in flight holds its session's lease and, in its record, everything the
directory should hold: the committed history and every delta of the turn. So
when a write fails the coordinator retries it (:class:`Backoff`), pausing the
stream meanwhile (a delta reaches the client only once it is recorded); and when
the directory answers again without the lease (it expired during a stall, or
Redis came back empty) the coordinator takes the lease again and writes its
record whole — but only where that overwrites nothing another coordinator wrote
(:func:`may_reseed`). Past the bound the turn ends with UNAVAILABLE, resumable
from what the directory holds.
"""

from __future__ import annotations

import dataclasses
import time

from specdec.coordinator.directory import Lease, SessionRecord

FIRST_RETRY_S = 0.05  # the first wait before a failed write is tried again ...
MAX_RETRY_S = 1.0  # ... doubling up to this


class Backoff:
    """The waits between one write's tries: 50 ms doubling to 1 s, for ``bound_s``
    after its first failure."""

    def __init__(self, bound_s: float):
        self.bound_s, self.wait, self.deadline = bound_s, FIRST_RETRY_S, None

    def next(self) -> float | None:
        """How long to wait before the next try; None once past the bound."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.bound_s
        if now >= self.deadline:
            return None
        wait = min(self.wait, self.deadline - now)
        self.wait = min(2 * self.wait, MAX_RETRY_S)
        return wait


@dataclasses.dataclass
class HeldLease:
    """A lease a request holds in the shared directory: renewed in the
    background, re-taken (its token changed in place) if it vanishes."""

    key: str  # the lease's key in Redis
    lease: Lease
    # The record last written under the lease (the turn's own, live): what a
    # re-taken lease re-seeds the directory with. None before the first write.
    record: SessionRecord | None = None
    riding: bool = False  # a write is retrying under it: that write re-takes the lease, not the renewals
    gave_up: bool = False  # a write outlasted the bound: the turn is ending, later writes try once
    # The request's hold ended (set before its lease is released): a renewal in
    # flight then never takes the lease again, and gives back one it just took.
    released: bool = False

    def adopt(self, stored: str) -> bool:
        """Whether the lease key's value ``stored`` ("token:nonce") is this
        lease's own, under a token whose reply was lost (a re-take that timed
        out here but ran in Redis); the lease then takes that token."""
        token, _, nonce = stored.partition(":")
        if nonce != self.lease.nonce or not token.isdigit():
            return False
        self.lease.token = int(token)
        return True


def may_reseed(record: SessionRecord, session: dict | None, turn: dict | None, deltas: list) -> bool:
    """Whether a coordinator whose lease vanished (no one holds it now) may take
    it again and write ``record`` — what it holds — over what is stored
    (``session``, ``turn`` and ``deltas``, parsed). Only where what is stored is
    an earlier state of ``record``, so nothing another coordinator wrote is lost:

    * nothing (Redis restarted empty, or lost the session);
    * this very turn (its number and turn id), not finished otherwise than in
      ``record``, its stored deltas a prefix of ours (an append-only file that
      lost its last second; writes that never arrived);
    * the turn before it, the history as this turn found it (this turn's first
      write never arrived).

    Anything else (a newer turn, other deltas, another history) was written by
    another coordinator that took the session over: the turn is lost to it."""
    ours = record.turn
    if session is None:
        return turn is None and not deltas
    if ours is None or turn is None:
        return False
    if turn.get("number") == ours.number - 1:
        return session.get("tokens") == record.tokens
    same = (turn.get("number"), turn.get("turn_id")) == (ours.number, ours.turn_id)
    ended_elsewhere = turn.get("finish_reason", "") not in ("", ours.finish_reason)
    return same and not ended_elsewhere and deltas == ours.deltas[:len(deltas)]  # (longer: not a prefix)
