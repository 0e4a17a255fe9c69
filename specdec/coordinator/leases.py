"""One request per session at a time, in this coordinator.

A request whose client has gone (its ``cancelled`` event set) but which is
still ending (its round in flight, EndSession on both services) is waited for,
up to ``CLOSING_WAIT_S``: "stop, then send the next message" is how chat
clients work, and they cannot know when the cleanup is over.

Everything here runs on the coordinator's one event loop: the table of busy
sessions needs no lock, since nothing else runs between a check and the write
that follows it (there is no ``await`` between them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from specdec.serving import errors

CLOSING_WAIT_S = 10.0  # a new request waits this long for a cancelled one on its session to end


@dataclasses.dataclass
class _Holder:
    """The request holding a session."""

    cancelled: asyncio.Event  # set when its client has gone (it is ending)
    released: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set when it let go


class SessionLeases:
    def __init__(self) -> None:
        self._busy: dict[str, _Holder] = {}  # sessions with a request in progress

    @contextlib.asynccontextmanager
    async def hold(self, session_id: str, cancelled: asyncio.Event | None = None) -> AsyncIterator[bool]:
        """Hold the session for one request; yields False if this request was
        itself cancelled before it got the session (nothing to do then).
        FailedPrecondition while another live request holds it. A one-shot
        request (no session id) holds nothing."""
        if not session_id:
            yield True
            return
        got = await self._claim(session_id, cancelled or asyncio.Event())
        try:
            yield got
        finally:
            if got:
                self._busy.pop(session_id).released.set()

    async def _claim(self, session_id: str, cancelled: asyncio.Event) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSING_WAIT_S
        while session_id in self._busy and not cancelled.is_set():
            holder = self._busy[session_id]
            remaining = deadline - loop.time()
            if not holder.cancelled.is_set() or remaining <= 0:
                raise errors.FailedPrecondition(
                    f"session {session_id!r} is already generating: one request per session at a time")
            # Wake when the ending request lets go, or when this one is cancelled itself.
            await _first_of(holder.released, cancelled, timeout=remaining)
        if cancelled.is_set():
            return False
        self._busy[session_id] = _Holder(cancelled)
        return True


async def _first_of(*events: asyncio.Event, timeout: float) -> None:
    """Wait until any of ``events`` is set, or ``timeout`` seconds have passed."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
