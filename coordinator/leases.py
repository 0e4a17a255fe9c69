"""One request per session at a time, in this coordinator.

A request whose client has gone (its ``cancelled`` event set) but which is
still ending (its round in flight, EndSession on both services) is waited for,
up to ``CLOSING_WAIT_S``: "stop, then send the next message" is how chat
clients work, and they cannot know when the cleanup is over.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from specdec.serving import errors

CLOSING_WAIT_S = 10.0  # a new request waits this long for a cancelled one on its session to end


class SessionLeases:
    def __init__(self) -> None:
        # Sessions with a request in progress -> that request's cancellation event.
        self._busy: dict[str, threading.Event] = {}
        self._released = threading.Condition()

    @contextlib.contextmanager
    def hold(self, session_id: str, cancelled: threading.Event | None = None) -> Iterator[bool]:
        """Hold the session for one request; yields False if this request was
        itself cancelled before it got the session (nothing to do then).
        FailedPrecondition while another live request holds it. A one-shot
        request (no session id) holds nothing."""
        if not session_id:
            yield True
            return
        got = self._claim(session_id, cancelled or threading.Event())
        try:
            yield got
        finally:
            if got:
                self._release(session_id)

    def _claim(self, session_id: str, cancelled: threading.Event) -> bool:
        with self._released:
            deadline = time.monotonic() + CLOSING_WAIT_S
            while session_id in self._busy and not cancelled.is_set():
                remaining = deadline - time.monotonic()
                if not self._busy[session_id].is_set() or remaining <= 0:
                    raise errors.FailedPrecondition(
                        f"session {session_id!r} is already generating: one request per session at a time")
                self._released.wait(min(remaining, 0.5))  # also notice our own cancellation
            if cancelled.is_set():
                return False
            self._busy[session_id] = cancelled
            return True

    def _release(self, session_id: str) -> None:
        with self._released:
            self._busy.pop(session_id, None)
            self._released.notify_all()
