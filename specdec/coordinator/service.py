"""The Coordinator gRPC servicer: thin. Decode the request, drive the engine's
asynchronous generator on the server's event loop, encode each event.

A stream holds no thread: while its round's calls are awaited, the loop serves
other streams and health checks. A client that goes away cancels its call, and
the cancellation lands in the turn's awaited call; the turn then ends the
session in both services before the call is done.

Admission (:mod:`specdec.coordinator.admission`): this coordinator's streams
are bounded in number and in memory, and each client's in number and rate;
beyond, a Generate is refused with RESOURCE_EXHAUSTED and a retry hint.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging

from specdec.coordinator.admission import ClientLimits, StreamLimits
from specdec.coordinator.engine import Coordinator
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import auth, errors
from specdec.serving import convert as conv
from specdec.serving.generation import Delta, GenerationStats

log = logging.getLogger("specdec.coordinator")


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, engine: Coordinator, streams: StreamLimits | None = None, limits: ClientLimits | None = None):
        self.engine = engine
        self.admission = streams or StreamLimits(max_streams=1 << 30)  # in all
        self.limits = limits or ClientLimits()  # per client
        self.end_streams_at: float | None = None  # loop time: set by :meth:`shutting_down`
        self.drain_grace_s = 0.0
        self.turns: set[asyncio.Task] = set()  # Generate handlers in progress, for the drain
        self.closing: set[asyncio.Task] = set()  # turns ending (their sessions freed in the services)

    async def shutting_down(self, grace_s: float) -> None:
        """SIGTERM: streams still open shortly before the drain grace runs out
        end with UNAVAILABLE and a reason, not with grpc's "Cancelling all calls"
        when the server stops. The margin lets the status and the session
        cleanups go out before the server cancels what is left."""
        self.drain_grace_s = grace_s
        self.end_streams_at = asyncio.get_running_loop().time() + grace_s - min(0.5, grace_s / 2)

    async def Generate(self, request, context):
        job = conv.job_from_proto(request)
        stream = self.admission.admit(request.ByteSize())
        caller = auth.current_client() or _peer_host(context.peer())  # what per-client limits count
        try:
            client = self.limits.admit(caller) if self.limits.active else (lambda: None)
        except BaseException:
            stream()
            raise
        task = asyncio.current_task()
        self.turns.add(task)
        try:
            async for event in self._generate(job, caller):
                if isinstance(event, GenerationStats):  # the turn is complete: its client may send the next at once
                    stream()
                    client()
                yield conv.event_to_proto(event)
        finally:
            self.turns.discard(task)
            stream()
            client()

    async def _generate(self, job, caller: str):
        loop = asyncio.get_running_loop()
        streamed, stats_sent = 0, False
        # Every step of the turn runs in one context of its own (each a task in
        # it), its cleanup too, even when grpc drops this stream and Python
        # finalises it from another task: the turn's spans are attached and
        # detached in the same context.
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

    async def CloseSession(self, request, context):
        return conv.close_session_response(await self.engine.close_session(request.session_id))


_END = object()


async def _next(events):
    """The turn's next event, or _END."""
    return await anext(events, _END)


def _peer_host(peer: str) -> str:
    """A caller without a name: its address, less the port ("ipv4:10.0.0.7:53412" -> "ipv4:10.0.0.7")."""
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer
