"""The Coordinator gRPC servicer: thin. Decode the request, run the engine's
generator one step at a time on a worker thread, encode each event.

Why step-by-step on a thread: the round loop is synchronous (it is the same code
the in-process decoder runs) and each step blocks on Propose/Verify calls. Running
steps on an executor keeps the event loop free for health checks and other
streams; awaiting between steps is where a client's cancellation lands, and the
engine's generator is then closed (after the step in flight finishes) so the
services free the session.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import logging
import threading

from coordinator.admission import ClientLimits
from coordinator.engine import Coordinator
from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import auth, errors
from specdec.serving import convert as conv
from specdec.serving.generation import Delta

log = logging.getLogger("specdec.coordinator")

_END = object()


class CoordinatorServicer(pb_grpc.CoordinatorServicer):
    def __init__(self, engine: Coordinator, executor: concurrent.futures.Executor, max_streams: int | None = None,
                 limits: ClientLimits | None = None):
        self.engine = engine
        self.executor = executor
        self.max_streams = max_streams  # beyond: RESOURCE_EXHAUSTED (the executor's threads are all busy)
        self.limits = limits or ClientLimits()  # per client
        self.cleanups: set[asyncio.Future] = set()  # of requests that ended early, still running
        self.end_streams_at: float | None = None  # loop time: set by :meth:`shutting_down`
        self.drain_grace_s = 0.0
        self.streams = 0  # Generate calls in progress (on the event loop: no lock)

    async def shutting_down(self, grace_s: float) -> None:
        """SIGTERM: streams still open shortly before the drain grace runs out
        end with UNAVAILABLE and a reason, not with grpc's "Cancelling all calls"
        when the server stops. The margin lets the status and the session
        cleanups go out before the server cancels what is left."""
        self.drain_grace_s = grace_s
        self.end_streams_at = asyncio.get_running_loop().time() + grace_s - min(0.5, grace_s / 2)

    async def Generate(self, request, context):
        job = conv.job_from_proto(request)
        if self.max_streams is not None and self.streams >= self.max_streams:  # more would wait for a thread
            raise errors.ResourceExhausted(
                f"the coordinator is serving {self.streams} streams, its limit (--max-workers "
                f"{self.max_streams}): retry in a moment, or on another coordinator", retry_after_s=1.0)
        release = self.limits.admit(auth.current_client() or _peer_host(context.peer())) if self.limits.active \
            else (lambda: None)
        self.streams += 1
        counted = True
        try:
            async for reply in self._generate(job):
                if reply.HasField("stats"):  # the turn is complete: its client may send the next at once
                    self.streams, counted = self.streams - 1, False
                    release()
                yield reply
        finally:
            release()
            if counted:
                self.streams -= 1

    async def _generate(self, job):
        loop = asyncio.get_running_loop()
        gone = threading.Event()  # set when the client has gone
        steps = self.engine.generate(job, gone)
        # Every step runs in this call's context, so the round loop's spans are
        # children of this call's server span (a worker thread has its own context).
        context = contextvars.copy_context()
        step = None
        finished = False
        streamed, stats_sent = 0, False
        try:
            while True:
                # (Not once the stats are out: the turn is complete and stored.)
                if self.end_streams_at is not None and loop.time() >= self.end_streams_at and not stats_sent:
                    raise errors.Draining(
                        f"the coordinator is shutting down and its drain grace ({self.drain_grace_s:g} s) ran "
                        f"out after {streamed} generated tokens were streamed; the turn did not finish: resume "
                        "it (resume_after = deltas received) on a coordinator sharing this one's --redis "
                        "directory, or send it again")
                step = self.executor.submit(context.run, next, steps, _END)
                # shield: a cancellation must not abandon the step running on the thread
                event = await asyncio.shield(asyncio.wrap_future(step))
                if event is _END:
                    finished = True
                    return
                if isinstance(event, Delta):
                    streamed += len(event.token_ids)
                else:
                    stats_sent = True  # the last event
                yield conv.event_to_proto(event)
        except (asyncio.CancelledError, GeneratorExit):  # the client has gone
            gone.set()  # no round starts for it now; its session's next request waits for the cleanup
            raise
        finally:
            if not finished:  # cancelled, or the stream failed: free the services' state
                cleanup = loop.run_in_executor(self.executor, _close_after, step, steps, context)
                self.cleanups.add(cleanup)
                cleanup.add_done_callback(self.cleanups.discard)
                try:
                    await asyncio.shield(cleanup)
                except asyncio.CancelledError:
                    pass  # the cleanup goes on in its thread

    async def CloseSession(self, request, context):
        # In this call's context: the engine reads the authenticated client from it.
        existed = await asyncio.get_running_loop().run_in_executor(
            self.executor, contextvars.copy_context().run, self.engine.close_session, request.session_id
        )
        return pb.CloseSessionResponse(existed=existed)


def _peer_host(peer: str) -> str:
    """A caller without a name: its address, less the port ("ipv4:10.0.0.7:53412" -> "ipv4:10.0.0.7")."""
    return peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer


def _close_after(step: concurrent.futures.Future | None, steps, context: contextvars.Context) -> None:
    """Wait for the step in flight, then close the generator: its cleanup ends the
    session in both services (a generator cannot be closed while it runs). It
    closes in the steps' context, which the step in flight still holds until then."""
    if step is not None:
        concurrent.futures.wait([step])
    context.run(steps.close)
