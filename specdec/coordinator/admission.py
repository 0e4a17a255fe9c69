"""What the coordinator admits: its streams in all, and each client's.

A coordinator serves at most ``--max-streams`` Generate streams at once, and
at most ``--max-stream-memory`` MiB of them (:class:`StreamLimits`): each
stream is charged what it holds -- its request, decoded, and a few kB of turn
state -- so a flood of large requests is refused before it fills the process,
however few streams it is. Beyond either bound a Generate is refused with
RESOURCE_EXHAUSTED and a retry hint (another coordinator may have room).

A turn whose target has no KV room for it (every target replica of the pair
answers RESOURCE_EXHAUSTED: its KV budget or its session cap) waits for room
rather than failing at once, as a serving engine queues a request its KV cache
cannot take yet (:class:`KVWaits`): up to ``--kv-wait`` seconds, with at most
``--kv-wait-turns`` turns waiting at once; beyond either the client gets the
target's RESOURCE_EXHAUSTED, with its retry hint.

Per-client limits: concurrent streams and request rate.

A client is its authenticated name (``--auth-tokens``) or, without
authentication, its peer address. Over ``--client-max-streams`` streams at
once, or past its request rate (a token bucket: ``--client-rate`` requests per
second on average, ``--client-burst`` at once), a client's next request is
refused with RESOURCE_EXHAUSTED and a retry hint; the other clients are not
slowed down by its flood.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from collections.abc import Callable

from specdec.serving import errors

MAX_TRACKED_CLIENTS = 10_000  # least recently seen forgotten beyond (their buckets refill anyway)
# What a stream holds besides its request: the turn's state, its round machine,
# the session record and the stream's grpc buffers. scripts/many_streams.py
# measures the coordinator's memory per stream: 82 kB at the peak of 1,024
# streams of 24 tokens on the bundled pair.
STREAM_BASE_BYTES = 96 << 10
# A request is held as received and as decoded (text, ids, stop strings).
REQUEST_COPIES = 2


class KVWaits:
    """Turns waiting for a target's KV room: at most ``max_turns`` at once, each
    for up to ``wait_s`` seconds (0: none waits). Each wait is a short sleep,
    longer each time (20 ms doubling to 0.5 s), after which the call is sent
    again: room comes from other turns ending, on this coordinator or another.
    On the event loop only: no lock."""

    FIRST_S, LONGEST_S = 0.02, 0.5

    def __init__(self, wait_s: float, max_turns: int):
        self.wait_s, self.max_turns = wait_s, max_turns
        self.waiting = 0

    async def wait(self, attempt: int) -> bool:
        """Sleep before sending the call again (``attempt``: the waits before
        this one, in this call); False, at once, when too many turns wait."""
        if self.waiting >= self.max_turns:
            return False
        self.waiting += 1
        try:
            await asyncio.sleep(min(self.LONGEST_S, self.FIRST_S * 2 ** attempt))
        finally:
            self.waiting -= 1
        return True


class StreamLimits:
    """The coordinator's streams in all: at most ``max_streams`` at once, and at
    most ``max_bytes`` charged to them (0: no memory bound). On the event loop
    only: no lock."""

    def __init__(self, max_streams: int, max_bytes: int = 0):
        self.max_streams, self.max_bytes = max_streams, max_bytes
        self.streams = 0
        self.bytes = 0

    def admit(self, request_bytes: int) -> Callable[[], None]:
        """Charge one stream holding a request of ``request_bytes``;
        ResourceExhausted, with when to retry, beyond a bound. Returns the
        stream's release (call it once or more: it counts once)."""
        cost = STREAM_BASE_BYTES + REQUEST_COPIES * request_bytes
        if self.streams >= self.max_streams:
            raise errors.ResourceExhausted(
                f"the coordinator is serving {self.streams} streams, its limit (--max-streams "
                f"{self.max_streams}): retry in a moment, or on another coordinator", retry_after_s=1.0)
        if self.max_bytes and self.bytes + cost > self.max_bytes:
            raise errors.ResourceExhausted(
                f"the coordinator's streams hold {self.bytes >> 20} MiB and this request needs "
                f"{-(-cost >> 20)} MiB more, past its limit (--max-stream-memory {self.max_bytes >> 20} MiB): "
                "retry in a moment, or on another coordinator", retry_after_s=1.0)
        self.streams += 1
        self.bytes += cost
        released = []

        def release() -> None:
            if not released:
                released.append(True)
                self.streams -= 1
                self.bytes -= cost

        return release


@dataclasses.dataclass
class _Client:
    tokens: float
    at: float
    streams: int = 0


class ClientLimits:
    """``max_streams`` 0 and ``rate`` 0 mean no limit of that kind."""

    def __init__(self, max_streams: int = 0, rate: float = 0.0, burst: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_streams, self.rate = max_streams, rate
        self.burst = max(1.0, burst or rate)
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: collections.OrderedDict[str, _Client] = collections.OrderedDict()

    @property
    def active(self) -> bool:
        return bool(self.max_streams or self.rate)

    def admit(self, client: str) -> Callable[[], None]:
        """Take one of ``client``'s streams; ClientLimitExceeded, with when to
        retry, if it is at a limit. Returns the stream's release (call it once
        or more: it counts once)."""
        if not self.active:
            return lambda: None
        state = self._admit(client)
        released = []

        def release() -> None:
            with self._lock:
                if not released:
                    released.append(True)
                    state.streams -= 1  # this client's record: kept while it has streams open

        return release

    def _admit(self, client: str) -> _Client:
        now = self._clock()
        with self._lock:
            state = self._clients.pop(client, None) or _Client(self.burst, now)
            self._clients[client] = state  # most recent last
            self._forget_idle()
            if self.max_streams and state.streams >= self.max_streams:
                raise errors.ClientLimitExceeded(
                    f"client {client!r} has {state.streams} streams open, its limit (--client-max-streams "
                    f"{self.max_streams}): retry when one ends", retry_after_s=1.0)
            if self.rate:
                state.tokens = min(self.burst, state.tokens + (now - state.at) * self.rate)
                state.at = now
                if state.tokens < 1.0:
                    wait = (1.0 - state.tokens) / self.rate
                    raise errors.ClientLimitExceeded(
                        f"client {client!r} is past its request rate (--client-rate {self.rate:g}/s, burst "
                        f"{self.burst:g}): retry in {wait:.1f} s", retry_after_s=wait)
                state.tokens -= 1.0
            state.streams += 1
            return state

    def _forget_idle(self) -> None:
        """Beyond MAX_TRACKED_CLIENTS, forget the least recently seen clients
        that have no stream open (one with streams is never forgotten)."""
        excess = len(self._clients) - MAX_TRACKED_CLIENTS
        for name in [n for n, s in self._clients.items() if s.streams == 0][:max(0, excess)]:
            del self._clients[name]
