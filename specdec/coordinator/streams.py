"""A client's stream of one turn, the same for every protocol the coordinator
serves: gRPC's ``Generate`` (:mod:`specdec.coordinator.service`) and the
OpenAI-compatible HTTP API (:mod:`specdec.coordinator.openai_api`) both run
their turns through one :class:`ClientStreams`, so they share its limits and
its drain.

* **Admission**: the coordinator's streams in all (:class:`StreamLimits`) and
  each client's (:class:`ClientLimits`), the same objects for both protocols: a
  client holding its streams over gRPC has none left over HTTP.
* **A context per turn**: every step of the turn runs as a task in one
  ``contextvars`` context of its own, its cleanup too, whichever task iterates
  the stream: the turn's spans are attached and detached in the same context,
  and its caller (what a new session counts against) is set there.
* **Cancellation**: cancelling the task that awaits the stream's next event
  cancels the step in flight, and the cancellation lands in the turn's awaited
  call; the turn then ends the session in both services (:attr:`closing`
  tracks those cleanups for the shutdown).
* **Drain**: after :meth:`shutting_down`, a turn still generating when the
  grace is nearly out ends with :class:`errors.Draining`.

Without authentication a client is its address, spelled by
:func:`client_address` for both protocols, so one address is one client on
both ports.
"""

from __future__ import annotations

import asyncio
import contextvars
import ipaddress
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable

from specdec.coordinator.admission import ClientLimits, StreamLimits
from specdec.serving import auth, errors
from specdec.serving.generation import Delta, GenerateJob, GenerationStats

_END = object()


class ClientStreams:
    """Every client stream of one coordinator. On the event loop only."""

    def __init__(self, engine, streams: StreamLimits | None = None, limits: ClientLimits | None = None):
        self.engine = engine
        self.admission = streams or StreamLimits(max_streams=1 << 30)  # in all
        self.limits = limits or ClientLimits()  # per client
        self.end_streams_at: float | None = None  # loop time: set by :meth:`shutting_down`
        self.drain_grace_s = 0.0
        self.turns: set[asyncio.Future] = set()  # streams in progress, done once their cleanup ran (for the drain)
        self.closing: set[asyncio.Task] = set()  # turns ending (their sessions freed in the services)

    async def shutting_down(self, grace_s: float) -> None:
        """SIGTERM: streams still open shortly before the drain grace runs out
        end with UNAVAILABLE and a reason, not with the transport's own error when
        the server stops. The margin lets the status and the session cleanups go
        out before the server cancels what is left."""
        self.drain_grace_s = grace_s
        self.end_streams_at = asyncio.get_running_loop().time() + grace_s - min(0.5, grace_s / 2)

    def admit(self, request_bytes: int, caller: str) -> Callable[[], None]:
        """Take one of the coordinator's streams and one of ``caller``'s
        (ResourceExhausted, or ClientLimitExceeded, with a retry hint, when at a
        limit). Returns the release of both (call it once or more: it counts once)."""
        stream = self.admission.admit(request_bytes)
        try:
            client = self.limits.admit(caller) if self.limits.active else (lambda: None)
        except BaseException:
            stream()
            raise

        def release() -> None:
            stream()
            client()

        return release

    async def generate(self, job: GenerateJob | Callable[[], Awaitable[GenerateJob]], caller: str,
                       request_bytes: int) -> AsyncIterator[Delta | GenerationStats]:
        """The turn's events, admitted first (see :meth:`admit`); ``caller``: the
        client's name, or its address without authentication. ``job``, or what
        makes it once the turn is admitted (the HTTP API renders a chat there:
        a refused client costs only its refusal); what that raises is the
        first event's error. The authenticated client (:func:`auth.current_client`)
        and the trace context current when this generator starts are the turn's.
        Close it (``aclosing``) when done."""
        release = self.admit(request_bytes, caller)
        done = asyncio.get_running_loop().create_future()
        self.turns.add(done)
        try:
            if not isinstance(job, GenerateJob):
                job = await job()
            async for event in self._run(job, caller):
                if isinstance(event, GenerationStats):  # the turn is complete: its client may send the next at once
                    release()
                yield event
        finally:
            release()
            self.turns.discard(done)
            done.set_result(None)

    async def _run(self, job: GenerateJob, caller: str) -> AsyncIterator[Delta | GenerationStats]:
        loop = asyncio.get_running_loop()
        streamed, stats_sent = 0, False
        context = contextvars.copy_context()
        context.run(auth.enter_peer, caller)  # the turn's own context: what its new session counts against
        events = self.engine.generate(job)
        step: asyncio.Task | None = None
        try:
            while True:
                # Before each round (not once the stats are out: the turn is complete and stored).
                if self.end_streams_at is not None and loop.time() >= self.end_streams_at and not stats_sent:
                    raise errors.Draining(
                        f"the coordinator is shutting down and its drain grace ({self.drain_grace_s:g} s) ran "
                        f"out after {streamed} generated tokens were streamed; the turn did not finish: resume "
                        "it (resume_after = deltas received) on a coordinator sharing this one's --redis "
                        "directory, or send it again")
                step = loop.create_task(_next(events), context=context)
                event = await step  # a cancellation of this call cancels the step: the turn's calls end
                if event is _END:
                    return
                if isinstance(event, Delta):
                    streamed += len(event.token_ids)
                else:
                    stats_sent = True  # the last event
                yield event
        finally:
            if step is not None and not step.done():
                await asyncio.wait([step])  # its cleanup, after the cancellation reached the turn
            closing = loop.create_task(events.aclose(), context=context)
            self.closing.add(closing)
            closing.add_done_callback(self.closing.discard)
            await asyncio.shield(closing)


def client_address(peer: str | tuple | None) -> str:
    """A caller without a name, as per-client limits count it: its address,
    less the port, spelled one way for both protocols. ``peer``: gRPC's
    (``ipv4:10.0.0.7:53412``, ``ipv6:%5B::1%5D:53412``) or an ASGI client's
    ``(host, port)``. An IPv4-mapped IPv6 address (what a server on ``::``
    sees of an IPv4 client) is its IPv4 address: ``ipv4:10.0.0.7`` on both
    ports; an IPv6 address in its compressed form, ``ipv6:%5B2001:db8::1%5D``.
    Anything else (``unix:...``) as given; "" for no peer."""
    if not peer:
        return ""
    if isinstance(peer, tuple):
        host = str(peer[0])
    else:
        kind, _, address = peer.partition(":")
        if kind not in ("ipv4", "ipv6"):
            return peer
        address = urllib.parse.unquote(address)
        if address.startswith("["):  # [host]:port
            host = address[1:].partition("]")[0]
        else:  # host:port
            host = address.rsplit(":", 1)[0] if address.count(":") == 1 else address
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return f"ipv6:%5B{host}%5D" if ":" in host else f"ipv4:{host}"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"ipv4:{ip}" if ip.version == 4 else f"ipv6:%5B{ip}%5D"


async def _next(events):
    """The turn's next event, or _END."""
    return await anext(events, _END)
