"""The Coordinator gRPC servicer: thin. Decode the request, drive the engine's
asynchronous generator on the server's event loop, encode each event.

A stream holds no thread: while its round's calls are awaited, the loop serves
other streams and health checks. A client that goes away cancels its call, and
the cancellation lands in the turn's awaited call; the turn then ends the
session in both services before the call is done.

Admission (:mod:`specdec.coordinator.admission`): this coordinator's streams
are bounded in number and in memory, and each client's in number and rate;
beyond, a Generate is refused with RESOURCE_EXHAUSTED and a retry hint. The
turn itself -- admission, its own context, cancellation, the drain -- runs in
:class:`specdec.coordinator.streams.ClientStreams`, shared with the HTTP API.
"""

from __future__ import annotations

import contextlib
import logging

from specdec.coordinator.admission import ClientLimits, StreamLimits
from specdec.coordinator.engine import Coordinator
from specdec.coordinator.streams import ClientStreams, client_address
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import auth
from specdec.serving import convert as conv

log = logging.getLogger("specdec.coordinator")


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    """``streams``: the coordinator's :class:`ClientStreams`, shared with its
    HTTP API (one is made from ``admission`` and ``limits`` when none is given)."""

    def __init__(self, engine: Coordinator, streams: StreamLimits | None = None, limits: ClientLimits | None = None,
                 clients: ClientStreams | None = None):
        self.engine = engine
        self.streams = clients or ClientStreams(engine, streams, limits)

    async def shutting_down(self, grace_s: float) -> None:
        await self.streams.shutting_down(grace_s)

    async def Generate(self, request, context):
        job = conv.job_from_proto(request)
        caller = auth.current_client() or (client_address(context.peer()) if context is not None else "")
        async with contextlib.aclosing(self.streams.generate(job, caller, request.ByteSize())) as events:
            async for event in events:
                yield conv.event_to_proto(event)

    async def CloseSession(self, request, context):
        return conv.close_session_response(await self.engine.close_session(request.session_id))

