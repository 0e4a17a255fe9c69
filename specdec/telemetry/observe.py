"""Telemetry glue: where the round, the RPCs and the services meet traces
(:mod:`specdec.telemetry.tracing`) and metrics (:mod:`specdec.telemetry.metrics`).

Five pieces, so that servicers and the round loop carry no instrumentation code
of their own:

* :class:`RoundObserver` — ``run_rounds`` wraps each round in ``observer.round()``:
  a span per round (γ, accepted, bytes, the time split) and the coordinator's
  per-round metrics.
* :class:`ClientCalls` — the coordinator's calls to the draft and target: a
  CLIENT span per call carrying W3C trace context, and for each Propose/Verify
  the client-observed time with the ``ServerTiming`` in the reply: network +
  serialisation = observed − (queue + compute + copy), on the RPC's client span,
  on the current round and in the metrics.
* :class:`ServerObserver` — on every server: a SERVER span per call, child of
  the caller's W3C context, with the reply's ``ServerTiming``; counts model
  work, latency and errors by gRPC code.
* :func:`later` — telemetry work a round puts off until the coordinator next
  waits on a service, so that it does not delay the next round.
* :class:`ServiceTelemetry` — the ``--trace-file`` / ``--metrics-port`` flags and
  what a service process starts from them.

Everything degrades to (almost) nothing: with tracing off and no metrics port,
the services install no interceptor, the coordinator's calls get a shared null
call and ``observer.round()`` hands back a shared no-op scope.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import os
import time
import types
import urllib.parse
from typing import Iterator, Mapping

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from specdec.telemetry import light_spans, tracing
from specdec.serving.errors import ErrorInterceptor, answer_failure, rpc_status, status_for
from specdec.telemetry.metrics import (
    ROUND_PHASES,
    CoordinatorMetrics,
    MetricsServer,
    RpcMetrics,
    ServiceMetrics,
)

log = logging.getLogger(__name__)

SIDES = ("draft", "target")


# ====================================================================== per-RPC timing


@dataclasses.dataclass
class RpcRecord:
    """One Propose or Verify as the coordinator saw it, with the server's own account."""

    side: str  # "draft" | "target"
    observed_s: float  # call start to last response, at the client
    queue_s: float = 0.0
    compute_s: float = 0.0
    copy_s: float = 0.0
    computed_tokens: int = 0
    bytes_out: int = 0
    bytes_in: int = 0

    @classmethod
    def of_call(cls, side: str, observed_s: float, timing, bytes_out: int, bytes_in: int) -> "RpcRecord":
        """From a reply's ServerTiming (``specdec.v1.ServerTiming``)."""
        return cls(side, observed_s, timing.queue_s, timing.compute_s, timing.copy_s, timing.computed_tokens,
                   bytes_out, bytes_in)

    @property
    def server_s(self) -> float:
        return self.queue_s + self.compute_s + self.copy_s

    @property
    def network_s(self) -> float:
        """Network + serialisation: what the client waited beyond the server's work
        (clamped at 0: the two clocks are read at slightly different moments)."""
        return max(0.0, self.observed_s - self.server_s)


_CURRENT_ROUND: contextvars.ContextVar["RoundScope | None"] = contextvars.ContextVar("specdec_round", default=None)


# ====================================================================== work put off


# Inside a coordinator's generation: telemetry work (ending spans, the round's
# attributes and metrics) waiting for the next moment the generation waits on
# a service anyway. See later().
_LATER: contextvars.ContextVar[collections.deque | None] = contextvars.ContextVar("specdec_later", default=None)
# About two rounds' worth. Rounds that send no Propose (γ = 0) have no wait to
# hide their work in: beyond this, work is done at once, so that spans and
# metrics never wait long, nor pile up past the span processor's queue.
LATER_MAX_ITEMS = 8


def later(fn, *args) -> None:
    """Call ``fn(*args)`` now or, inside a coordinator's generation
    (:func:`observe_generation`), once its next Propose is on its way
    (:meth:`Call.while_waiting`) or the generation ends, whichever comes first.

    Why: a round's telemetry is ~100 µs of the coordinator's CPU after the
    target's reply (the round's attributes, three spans ended), and the next
    round waits for it. Done while the draft computes the next proposal, it
    costs the round nothing. Each call carries its own timestamps, and the time
    the work takes is taken out of the draft's times (:meth:`Call.while_waiting`):
    it is coordinator time, as it was in line."""
    work = _LATER.get()
    if work is None:
        fn(*args)
        return
    work.append((fn, args))
    if len(work) > LATER_MAX_ITEMS:
        _run_later(work)


def _run_later(work: collections.deque) -> None:
    while work:
        fn, args = work.popleft()
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 -- telemetry lost is logged, never the generation's failure
            log.exception("telemetry work put off until now failed")


_END = object()


def _putting_off(events: Iterator, work: collections.deque) -> Iterator:
    """``events``, with :func:`later` putting work into ``work`` while they make
    each event -- only then: between events the caller's context is its own."""
    while True:
        token = _LATER.set(work)
        try:
            event = next(events, _END)
        finally:
            _LATER.reset(token)
        if event is _END:
            return
        yield event


class ClientCalls:
    """The coordinator's calls to one service (``side``: "draft" | "target").

    Each call gets a CLIENT span named and attributed as OpenTelemetry's gRPC
    instrumentation names them (``/specdec.v1.DraftService/Propose``, ``rpc.*``),
    with its W3C trace context in the call's metadata, so the service's SERVER
    span is its child. A call whose reply carries the server's ``ServerTiming``
    gets its :class:`RpcRecord` on that span, on the current round and in the
    metrics (:meth:`Call.record`).

    Why not the instrumentation's client interceptor: the coordinator's channels
    are synchronous, and grpc's intercepted-channel wrappers plus the interceptor
    cost more CPU per call than the span itself (``docs/benchmarks.md``, tracing
    overhead). Here a call costs one ``start_span`` and one ``inject``; with
    tracing off and no metrics, nothing but a shared null call."""

    def __init__(self, side: str, service: str, metrics: CoordinatorMetrics | None = None):
        self.side, self.service, self.metrics = side, service, metrics
        self._untraced = Call(self, trace.INVALID_SPAN, None) if metrics is not None else _NULL_CALL

    @contextlib.contextmanager
    def call(self, method: str) -> Iterator["Call"]:
        """Around one attempt of ``method``: pass ``call.metadata`` to the stub.
        An ``RpcError`` leaving the block marks the span failed with its code."""
        if not tracing.enabled():
            yield self._untraced
            return
        span = light_spans.start_span(
            f"/{self.service}/{method}", kind=trace.SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": self.service, "rpc.method": method,
                        "rpc.grpc.status_code": grpc.StatusCode.OK.value[0]})
        carrier: dict[str, str] = {}
        # Not made current: Propose's stream is read inside a generator, and a
        # context attached there would leak into the round loop between yields.
        propagate.inject(carrier, context=trace.set_span_in_context(span))
        try:
            yield Call(self, span, tuple(carrier.items()))
        except grpc.RpcError as e:
            code, details = rpc_status(e)
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))
            raise
        except GeneratorExit:  # the reader stopped mid-stream: grpc cancels the call
            span.set_attribute("rpc.grpc.status_code", grpc.StatusCode.CANCELLED.value[0])
            raise
        except Exception as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        finally:
            later(span.end, time.time_ns())


class Call:
    """One call in progress (see :meth:`ClientCalls.call`)."""

    __slots__ = ("_calls", "span", "metadata")

    def __init__(self, calls: ClientCalls | None, span, metadata: tuple | None):
        self._calls, self.span, self.metadata = calls, span, metadata

    def while_waiting(self) -> float:
        """The call is on its way and the caller is about to wait for its reply:
        the moment for telemetry work put off (:func:`later`). Returns the
        seconds that work took, also added to the round's ``paused_s``: they
        are the coordinator's, not the call's (a reply may have come meanwhile),
        so the caller takes them out of the call's times."""
        work = _LATER.get()
        if not work:
            return 0.0
        start = time.perf_counter()
        _run_later(work)
        spent = time.perf_counter() - start
        scope = _CURRENT_ROUND.get()
        if scope is not None:
            scope.paused_s += spent
        return spent

    def record(self, rec: RpcRecord) -> None:
        """The completed call, with the server's own account of it."""
        if self._calls is None:  # tracing off, no metrics: nobody reads it
            return
        if self.span.is_recording():
            # The split only: the server's parts are on its SERVER span, the bytes
            # on the round span (each attribute costs CPU to set and to export).
            self.span.set_attributes({"specdec.observed_s": rec.observed_s, "specdec.server_s": rec.server_s,
                                      "specdec.network_s": rec.network_s})
        scope = _CURRENT_ROUND.get()
        if scope is not None:
            scope.calls.append(rec)
        metrics = self._calls.metrics
        if metrics is not None:
            metrics.observe_call(rec.side, rec.network_s, rec.bytes_out, rec.bytes_in)


_NULL_CALL = Call(None, trace.INVALID_SPAN, None)


def _has_timing(message) -> bool:
    """Whether a reply carries a set ``ServerTiming`` (None: a reply written with
    ``context.write``)."""
    return _has_timing_field(type(message)) and message.HasField("timing")


@functools.lru_cache(maxsize=64)
def _has_timing_field(message_type: type) -> bool:
    """Per message type, not per message: the coordinator streams a reply a round
    whose type has no such field, and an exception per reply costs CPU."""
    descriptor = getattr(message_type, "DESCRIPTOR", None)
    return descriptor is not None and "timing" in getattr(descriptor, "fields_by_name", {})


# ====================================================================== rounds


class RoundScope:
    """One round in progress: its span, the RPCs made inside it, its start, and
    the time it spent on earlier rounds' telemetry (``paused_s``)."""

    __slots__ = ("index", "span", "calls", "start", "paused_s", "_observer")

    def __init__(self, observer: "RoundObserver", index: int, span):
        self._observer, self.index, self.span = observer, index, span
        self.calls: list[RpcRecord] = []
        self.start = time.perf_counter()
        self.paused_s = 0.0

    def done(self, result) -> None:
        """The round's :class:`specdec.core.rounds.RoundResult`: annotate and count it
        (:func:`later`)."""
        later(self._record, result, time.perf_counter() - self.start)

    def _record(self, result, wall: float) -> None:
        phases = round_phases(result, self.calls, wall)
        if self.span.is_recording():
            self.span.set_attributes(round_attributes(self.index, result, self.calls, phases, wall))
        metrics = self._observer.metrics
        if metrics is not None:
            metrics.observe_round(gamma=result.gamma, accepted=result.accepted,
                                  wall_s=wall, phases=phases)


class _NullScope:
    calls: tuple = ()  # never current: nothing records into it
    paused_s = 0.0

    def done(self, result) -> None:
        pass


_NULL_SCOPE = _NullScope()


class RoundObserver:
    """What ``run_rounds`` reports each round to. Without metrics it only traces
    (the in-process decoder's default); with tracing off as well it does nothing."""

    def __init__(self, metrics: CoordinatorMetrics | None = None):
        self.metrics = metrics
        self._open: contextvars.ContextVar = contextvars.ContextVar("specdec_open_round", default=None)

    def round_started(self, index: int) -> None:
        traced = tracing.enabled()
        if not traced and self.metrics is None:
            return
        span = light_spans.start_span("specdec.round") if traced else trace.INVALID_SPAN
        use = trace.use_span(span) if traced else contextlib.nullcontext()
        use.__enter__()
        scope = RoundScope(self, index, span)
        self._open.set((scope, use, _CURRENT_ROUND.set(scope), traced))

    def _close(self, error: BaseException | None) -> RoundScope | None:
        opened = self._open.get()
        if opened is None:
            return None
        self._open.set(None)
        scope, use, token, traced = opened
        _CURRENT_ROUND.reset(token)
        use.__exit__(type(error) if error else None, error, None)
        if traced:
            later(scope.span.end, time.time_ns())
        return scope

    def round_finished(self, result) -> None:
        opened = self._open.get()
        if opened is not None:
            opened[0].done(result)
        self._close(None)

    def round_failed(self, error: BaseException) -> None:
        self._close(error)


TRACE_ONLY = RoundObserver()


def round_phases(result, calls: list[RpcRecord], wall_s: float) -> dict[str, float]:
    """Split a round into the disjoint phases of :data:`specdec.telemetry.metrics.ROUND_PHASES`.

    A side with recorded RPCs is split into its server's compute, queue and copy
    times and the network remainder; a side without (the in-process decoder) is
    all compute. The coordinator phase is what is left of the round's wall time."""
    phases = dict.fromkeys(ROUND_PHASES, 0.0)
    observed = {"draft": result.draft_s, "target": result.verify_s}
    for side in SIDES:
        mine = [c for c in calls if c.side == side]
        if not mine:
            phases[side] += observed[side]
            continue
        for c in mine:
            phases[side] += c.compute_s
            phases["queue"] += c.queue_s
            phases["copy"] += c.copy_s
            phases["network"] += c.network_s
    phases["coordinator"] = max(0.0, wall_s - sum(phases.values()))
    return phases


def round_attributes(index: int, result, calls: list[RpcRecord], phases: Mapping[str, float],
                     wall_s: float) -> dict:
    """The round span's attributes (what ``specdec trace-report`` reads back)."""
    attrs = {
        "specdec.round": index,
        "specdec.core.gamma": result.gamma,
        "specdec.accepted": result.accepted,
        "specdec.tokens": len(result.tokens),
        "specdec.bytes_out": sum(c.bytes_out for c in calls),
        "specdec.bytes_in": sum(c.bytes_in for c in calls),
        "specdec.round_s": wall_s,
        "specdec.coordinator_s": phases["coordinator"],
    }
    for side in SIDES:
        mine = [c for c in calls if c.side == side]
        if mine:
            attrs[f"specdec.{side}.compute_s"] = sum(c.compute_s for c in mine)
            attrs[f"specdec.{side}.queue_s"] = sum(c.queue_s for c in mine)
            attrs[f"specdec.{side}.network_s"] = sum(c.network_s for c in mine)
            copy_s = sum(c.copy_s for c in mine)
            if copy_s:  # absent = 0: never set on CPU, and each attribute costs CPU to export
                attrs[f"specdec.{side}.copy_s"] = copy_s
        else:  # in process: all of it is compute
            attrs[f"specdec.{side}.compute_s"] = phases[side]
    if result.finish_reason:
        attrs["specdec.finish_reason"] = result.finish_reason
    return attrs


# ====================================================================== generations


def observe_generation(events: Iterator, *, metrics: CoordinatorMetrics | None, model: str, max_tokens: int,
                       temperature: float, input_tokens: int, conversation_id: str,
                       extra: Mapping[str, object] | None = None) -> Iterator:
    """Pass the coordinator's events through inside the generation span; the final
    event (``coordinator.engine.Stats``: it has ``generated_tokens`` and
    ``finish_reason``) sets the usage attributes and the request metrics."""
    work: collections.deque = collections.deque()  # telemetry put off (later()) until the next Propose
    with tracing.generation_span(
            model=model, max_tokens=max_tokens, temperature=temperature, input_tokens=input_tokens,
            conversation_id=conversation_id, extra=extra) as span:
        try:
            # closing(): the engine's cleanup (EndSession, directory write) runs when
            # this generator is closed, not whenever the garbage collector frees it.
            with contextlib.closing(events):
                for event in _putting_off(events, work):
                    _observe_event(event, span, metrics, input_tokens)
                    yield event
        finally:
            _run_later(work)  # the rounds' spans end before the generation's


def _observe_event(event, span, metrics: CoordinatorMetrics | None, input_tokens: int) -> None:
    streamed = getattr(event, "token_ids", None)  # a Delta: tokens streamed to the client
    if streamed is not None and metrics is not None:
        metrics.observe_streamed(len(streamed))
    generated = getattr(event, "generated_tokens", None)
    if generated is not None:
        finish = getattr(event, "finish_reason", "") or "length"
        if span.is_recording():
            tracing.record_usage(span, output_tokens=generated, finish_reason=finish,
                                 **{"specdec.core.rounds": event.rounds,
                                    "specdec.drafted_tokens": event.drafted_tokens,
                                    "specdec.accepted_tokens": event.accepted_tokens})
        if metrics is not None:
            metrics.observe_request(prompt_tokens=input_tokens, finish_reason=finish)


# ====================================================================== services


# Probes call these every few seconds: a root trace each would bury the
# requests' traces at the collector.
UNTRACED_SERVICES = frozenset({"grpc.health.v1.Health"})


class ServerObserver(ErrorInterceptor):
    """Every service's own account of each call: the SERVER span, child of the
    caller's W3C trace context, with the reply's ServerTiming and the error
    code; metrics get latency, errors by code and model work. It is also the
    server's error interceptor (an exception leaving a handler is answered with
    its status, as :class:`specdec.serving.errors.ErrorInterceptor` does): a call then
    passes one wrapper, not two (~75 µs of a service's CPU per call, and again
    per streamed message).

    The span is named and attributed as OpenTelemetry's gRPC instrumentation
    names it (``/specdec.v1.TargetService/Verify``, ``rpc.*``). In the
    coordinator it is current while the handler runs (the generation span is
    its child). With ``span_after_reply`` (the draft and target services, whose
    handlers make no spans) it is made once the reply has gone, with the call's
    own start and end times (:class:`_LateSpan`): the W3C context read and the
    span's making are then off the round's critical path.

    Why not the instrumentation's aio server interceptor: with it, a service
    spent ~390 µs more CPU per sampled call than with tracing off and ~265 µs
    per unsampled one (metadata copied twice, the peer address parsed, a proxy
    around the servicer context, and a second wrapper around every call;
    ``scripts/bench_server_calls.py``, this project's 2-vCPU machine). The
    SERVER span is a :mod:`specdec.telemetry.light_spans` span: ~40 µs of this
    observer's own work per sampled call in process, against ~73 with the
    SDK's."""

    def __init__(self, metrics: RpcMetrics | None, traced: bool | None = None, span_after_reply: bool = False):
        self.metrics = metrics
        self.traced = tracing.enabled() if traced is None else traced
        self.span_after_reply = span_after_reply
        self._attributes: dict[str, dict] = {}  # full method (also the span's name) -> its rpc.* attributes

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:
            return handler
        full_method = handler_call_details.method
        if handler.response_streaming:
            behavior = handler.unary_stream
            # A coroutine that writes its replies with context.write() (health's
            # Watch) is awaited like a unary handler; it returns None.
            wrap = self._stream if inspect.isasyncgenfunction(behavior) else self._unary
            return grpc.unary_stream_rpc_method_handler(
                wrap(behavior, full_method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return grpc.unary_unary_rpc_method_handler(
            self._unary(handler.unary_unary, full_method),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

    def _unary(self, behavior, full_method: str):
        method = full_method.rsplit("/", 1)[-1]

        async def unary(request, context):
            start = time.perf_counter()
            span, token = trace.INVALID_SPAN, None
            try:  # the observer's own failures too are answered (INTERNAL), not left to grpc (UNKNOWN)
                span, token = self._start_span(full_method, context)
                response = await behavior(request, context)
                self._answered(span, method, request, response.timing if _has_timing(response) else None, 1,
                               response)
                self._finished(method, start, None)
            except BaseException as exc:
                self._failed(span, method, start, exc, context)
                await answer_failure(context, exc, full_method)
                raise
            finally:
                _end_span(span, token)
            return response

        return unary

    def _stream(self, behavior, full_method: str):
        method = full_method.rsplit("/", 1)[-1]

        async def stream(request, context):
            start = time.perf_counter()
            span, token = trace.INVALID_SPAN, None
            count, timing = 0, None
            try:
                span, token = self._start_span(full_method, context)
                async for message in behavior(request, context):
                    count += 1
                    if _has_timing(message):
                        timing = message.timing
                    yield message
                self._answered(span, method, request, timing, count, None)
                self._finished(method, start, None)
            except BaseException as exc:
                self._failed(span, method, start, exc, context)
                await answer_failure(context, exc, full_method)
                raise
            finally:
                _end_span(span, token)

        return stream

    def _start_span(self, full_method: str, context):
        """The call's SERVER span, made current (the token undoes that), or the
        invalid span and no token when tracing is off."""
        if not self.traced:
            return trace.INVALID_SPAN, None
        attributes = self._attributes.get(full_method)
        if attributes is None:
            service, _, method = full_method.lstrip("/").partition("/")
            attributes = self._attributes[full_method] = {} if service in UNTRACED_SERVICES else {
                "rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                "rpc.grpc.status_code": grpc.StatusCode.OK.value[0]}
        if not attributes:  # health checks: counted, not traced
            return trace.INVALID_SPAN, None
        metadata = context.invocation_metadata()
        if self.span_after_reply:
            return _LateSpan(full_method, attributes, metadata, context.peer()), None
        span, parent = _server_span(full_method, attributes, metadata, context.peer())
        return span, otel_context.attach(trace.set_span_in_context(span, parent))

    def _answered(self, span, method: str, request, timing, count: int, response) -> None:
        """A call answered: ``timing`` is the reply's ServerTiming (None if it has
        none), ``count`` the messages sent, ``response`` the reply of a unary call."""
        if timing is not None and span.is_recording():
            span.set_attributes({
                "specdec.serving.server.queue_s": timing.queue_s,
                "specdec.serving.server.compute_s": timing.compute_s,
                "specdec.serving.server.copy_s": timing.copy_s,
                "specdec.serving.server.computed_tokens": timing.computed_tokens,
            })
        if not isinstance(self.metrics, ServiceMetrics):
            return
        if timing is not None:
            self.metrics.observe_timing(timing)
        if method == "Propose":
            self.metrics.observe_proposed(count)
        elif method == "Verify":
            self.metrics.observe_verified(len(request.draft_tokens), response.accepted)

    def _failed(self, span, method: str, start: float, exc: BaseException, context) -> None:
        if isinstance(exc, grpc.aio.AbortError):  # aborted on purpose: the code is on the context
            code = _context_code(context) or grpc.StatusCode.UNKNOWN
        elif isinstance(exc, Exception):
            code = status_for(exc)[0]
        else:  # cancelled by the client (CancelledError), or shutdown
            code = grpc.StatusCode.CANCELLED
        if span.is_recording():
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {exc}"))
            if code == grpc.StatusCode.INTERNAL:  # a bug, not a bad request: keep the traceback
                span.record_exception(exc)
        self._finished(method, start, code.name)

    def _finished(self, method: str, start: float, code: str | None) -> None:
        if self.metrics is not None:
            self.metrics.observe_rpc(method, time.perf_counter() - start, code)


def _server_span(name: str, attributes: Mapping, metadata, peer: str, start_time: int | None = None):
    """A SERVER span, child of the W3C context in the call's ``metadata``, with
    the caller's address; and that parent context."""
    parent = propagate.extract(dict(metadata)) if metadata else None
    span = light_spans.start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes,
                                  start_time=start_time)
    if span.is_recording():  # which caller: several coordinators may share a service
        span.set_attributes(_peer_attributes(peer))
    return span, parent


@functools.lru_cache(maxsize=256)  # a service's callers are a few long-lived connections
def _peer_attributes(peer: str) -> Mapping[str, object]:
    """``ipv4:10.0.0.7:51234`` / ``ipv6:%5B::1%5D:51234`` as the gRPC
    instrumentation's ``net.peer.ip`` and ``net.peer.port``; nothing for other
    transports (``unix:``). Cached: parsing it took ~12 µs of CPU per call
    inside a serving process."""
    kind, _, address = peer.partition(":")
    host, _, port = address.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return types.MappingProxyType({})
    return types.MappingProxyType({"net.peer.ip": urllib.parse.unquote(host).strip("[]"), "net.peer.port": int(port)})


class _LateSpan:
    """A SERVER span written down during the call and made once the reply has
    gone (:meth:`ServerObserver` with ``span_after_reply``): the call's own path
    then carries a clock read and a few stores instead of the W3C context read
    and the span made and ended (~155 µs of a service's CPU per call, in place).
    It takes the recording calls the observer makes (attributes, status, an
    exception) and replays them on the real span, with the call's own start and
    end times, from the event loop after the reply is on its way."""

    __slots__ = ("name", "attributes", "metadata", "peer", "start_ns", "status", "exception", "exception_ns")

    def __init__(self, name: str, attributes: Mapping, metadata, peer: str):
        self.name, self.metadata, self.peer = name, metadata, peer
        self.attributes = dict(attributes)
        self.start_ns = time.time_ns()
        self.status = self.exception = self.exception_ns = None

    def is_recording(self) -> bool:  # the sampler decides later: keep everything
        return True

    def set_attributes(self, attributes: Mapping) -> None:
        self.attributes.update(attributes)

    def set_attribute(self, key: str, value) -> None:
        self.attributes[key] = value

    def set_status(self, status: Status) -> None:
        self.status = status

    def record_exception(self, exception: BaseException) -> None:
        self.exception, self.exception_ns = exception, time.time_ns()

    def end_later(self) -> None:
        """Make and end the span at the event loop's next turn, after the reply
        (now if there is no loop: a stream's generator closed by the garbage
        collector)."""
        try:
            asyncio.get_running_loop().call_soon(self._make, time.time_ns())
        except RuntimeError:
            self._make(time.time_ns())

    def _make(self, end_ns: int) -> None:
        try:
            span, _ = _server_span(self.name, self.attributes, self.metadata, self.peer, self.start_ns)
            if span.is_recording():
                if self.status is not None:
                    span.set_status(self.status)
                if self.exception is not None:
                    span.record_exception(self.exception, timestamp=self.exception_ns)
            span.end(end_ns)
        except Exception:  # noqa: BLE001 -- a span lost is logged; the call was answered long ago
            log.exception("the SERVER span of %s could not be made", self.name)


def _end_span(span, token) -> None:
    """Undo ``attach`` and end the span. When a client goes away while a stream
    is blocked sending, grpc leaves the handler's generator to asyncio, which
    closes it later from another context: there is nothing to undo there, and
    OpenTelemetry's ``detach`` would log an error for every such disconnect."""
    if type(span) is _LateSpan:
        span.end_later()
        return
    if token is None:
        return
    if isinstance(token, contextvars.Token):  # OpenTelemetry's default runtime context
        with contextlib.suppress(ValueError):  # created in a different Context
            token.var.reset(token)
    else:
        otel_context.detach(token)
    span.end()


def _context_code(context) -> grpc.StatusCode | None:
    try:
        return context.code()
    except Exception:  # noqa: BLE001 -- older grpc: no code() on aio contexts
        return None


class ServiceTelemetry:
    """A service process's telemetry: tracing (process-wide, set up once from the
    flags and ``OTEL_*``), its metrics registry and ``/metrics`` endpoint."""

    def __init__(self, role: str, metrics: CoordinatorMetrics | ServiceMetrics | None = None,
                 metrics_port: int = 0):
        self.role = role
        self.metrics = metrics
        self.metrics_port = metrics_port
        self.metrics_server: MetricsServer | None = None

    @classmethod
    def for_role(cls, role: str, metrics_port: int = 0) -> "ServiceTelemetry":
        """Metrics objects only when a port will serve them."""
        metrics = None
        if metrics_port:
            metrics = CoordinatorMetrics() if role == "coordinator" else ServiceMetrics(role)
        return cls(role, metrics, metrics_port)

    def server_interceptors(self) -> list:
        """For :class:`specdec.serving.server.GrpcServer`'s ``interceptors``: the
        :class:`ServerObserver` (which maps errors too, in place of the server's
        plain ErrorInterceptor), or none when there is nothing to trace or count."""
        traced = tracing.enabled()
        if self.metrics is None and not traced:
            return []
        return [ServerObserver(self.metrics, traced, span_after_reply=self.role != "coordinator")]

    def serve_metrics(self, host: str = "0.0.0.0", sessions=None) -> int | None:
        """Start ``/metrics`` if a port was given; ``sessions`` returns the
        session store's stats (model services). Returns the port."""
        if self.metrics is None or not self.metrics_port:
            return None
        if sessions is not None and isinstance(self.metrics, ServiceMetrics):
            self.metrics.watch_sessions(sessions)
        self.metrics_server = MetricsServer(self.metrics.registry, self.metrics_port, host)
        return self.metrics_server.port

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None


# ---------------------------------------------------------------- flags


def metrics_port_env(role: str) -> str:
    return f"SPECDEC_{role.upper()}_METRICS_PORT"


def add_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """``--trace-file`` and ``--metrics-port`` for a service's command line."""
    parser.add_argument(
        "--trace-file", dest="trace_file", default=None, metavar="PATH",
        help=f"append every span as a JSON line to PATH (read by `specdec trace-report`); OTLP export is "
             f"configured by the standard OTEL_* variables [env {tracing.TRACE_FILE_ENV}; default off]")
    parser.add_argument(
        "--metrics-port", dest="metrics_port", default=None, type=int, metavar="PORT",
        help=f"serve Prometheus metrics on http://HOST:PORT/metrics (0: off) [env {metrics_port_env(role)}; "
             "default 0]")


def setup_from_args(args: argparse.Namespace, role: str, environ: Mapping[str, str] | None = None) -> ServiceTelemetry:
    """At process start: install tracing from ``--trace-file`` and ``OTEL_*`` and
    prepare metrics for ``--metrics-port``."""
    environ = os.environ if environ is None else environ
    tracing.setup_tracing(f"specdec-{role}", getattr(args, "trace_file", None), environ)
    port = getattr(args, "metrics_port", None)
    if port is None:
        raw = environ.get(metrics_port_env(role), "").strip()
        try:
            port = int(raw) if raw else 0
        except ValueError:
            raise ValueError(f"environment variable {metrics_port_env(role)}={raw!r} is not a valid int") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"--metrics-port must be in [0, 65535], got {port}")
    return ServiceTelemetry.for_role(role, port)


def start_telemetry(role: str, trace_file: str | None = None, metrics_port: int = 0) -> ServiceTelemetry:
    """At process start: tracing from ``trace_file`` and the ``OTEL_*``
    variables, and metrics objects when ``metrics_port`` will serve them."""
    tracing.setup_tracing(f"specdec-{role}", trace_file)
    return ServiceTelemetry.for_role(role, metrics_port)
