"""Which draft and target replica one turn runs on, and moving it to another.

A session is pinned to one replica of each role: its KV state lives there, so
it stays while the replica is fit (healthy, still resolved). A turn starts on
the session's pinned replicas; one that is out (it failed a call, its health
check says NOT_SERVING: draining, or it left the DNS name) is replaced by the
least-loaded healthy replica, and so is a replica that fails a call mid-turn.
A replica that takes a session over holds none of it: that side's synced
length drops to 0 and its next call re-pre-fills the whole committed history
(position 0), so a move costs one pre-fill, never a different output.

Load is each replica's turns in flight through this coordinator.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterable

from specdec.coordinator.pools import Replica, ReplicaPool
from specdec.serving import errors

log = logging.getLogger("specdec.coordinator")


@dataclasses.dataclass
class Pinned:
    """One role's replica for one turn. ``replica`` is None for a draft that is
    gone with no healthy one to take over: the turn goes on at γ = 0 and looks
    for one again at each round."""

    pool: ReplicaPool
    replica: Replica | None
    # Called after a move with the role, the new address and why: the turn
    # resets that side's synced length and counts the move.
    on_move: Callable[[str, str, str], None] = lambda role, address, cause: None

    @property
    def role(self) -> str:
        return self.pool.role

    @property
    def client(self):
        """The current replica's ServiceClient (None: no replica)."""
        return None if self.replica is None else self.replica.client

    @property
    def address(self) -> str:
        return "" if self.replica is None else self.replica.address

    def fit(self) -> bool:
        """Whether the current replica may take the next call."""
        if self.replica is None:
            return False
        status = self.pool.get(self.replica.address)
        return status is self.replica and status.healthy and status.resolved

    # A replica that ran a call out of its deadline is out this long: it may
    # answer health checks while every call to it hangs.
    HUNG_HOLD_OUT_S = 30.0

    def failed(self, reason: str, hung: bool = False) -> None:
        """A call to the current replica failed (it died, refused as it drains,
        or ran out its deadline: ``hung``)."""
        if self.replica is not None:
            self.pool.report_failure(self.replica.address, reason, self.HUNG_HOLD_OUT_S if hung else 0.0)

    async def move(self, cause: str, accept: Callable[[Replica], Awaitable[bool]] | None = None,
                   exclude: Iterable[str] = ()) -> bool:
        """Take the least-loaded healthy replica, other than the current one and
        ``exclude``, that ``accept`` takes (awaited: it serves the turn's model);
        False, and no change, if there is none."""
        excluded = set(exclude) | ({self.address} if self.replica is not None else set())
        while True:
            try:
                chosen = await self.pool.pick(exclude=excluded, suspects=False)
            except errors.Unavailable as e:
                log.debug("%s: no replica to move to (%s)", self.role, e)
                return False
            try:
                taken = True if accept is None else await accept(chosen)
            except BaseException:
                self.pool.unpin(chosen.address)
                raise
            if taken:
                break
            self.pool.unpin(chosen.address)
            excluded.add(chosen.address)
        old, self.replica = self.address, chosen
        if old:
            self.pool.unpin(old)
        log.info("%s: moved from %s to %s (%s): it is re-pre-filled from the history", self.role,
                 old or "none", chosen.address, cause)
        self.on_move(self.role, chosen.address, cause)
        return True

    def release(self) -> None:
        if self.replica is not None:
            self.pool.unpin(self.replica.address)
            self.replica = None


async def pin(pool: ReplicaPool, address: str, wait_s: float = 0.0) -> tuple[Pinned, str]:
    """A turn's replica of ``pool``'s role: the session's (``address``) while it
    is fit, else the least-loaded healthy one; and why it changed ("" : it did
    not, "new" : the session had none). Unavailable, naming the role and why
    each replica is out, if none is fit within ``wait_s``."""
    if address:
        replica = pool.pin_if_fit(address)
        if replica is not None:
            return Pinned(pool, replica), ""
        known = pool.get(address)
        cause = "gone" if known is None or not known.resolved else "unhealthy"
    else:
        cause = "new"
    return Pinned(pool, await pool.pick(wait_s=wait_s)), cause
