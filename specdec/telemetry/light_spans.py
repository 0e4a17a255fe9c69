"""Spans for the hot path -- a round's span, each RPC's CLIENT and SERVER span --
made without the SDK's ``Tracer.start_span``.

Why: every round makes five spans across the three processes, and with the
SDK's ``start_span``/``set_attributes``/``end`` making them was most of the
coordinator's tracing CPU (``scripts/bench_otlp_export.py``, a simulated round's
three spans made and dropped: 187 µs with the SDK's spans, 100 µs with these,
13 µs with tracing off). Most of it is generality a span we make ourselves does
not need: an ``RLock`` and a ``BoundedAttributes`` per span, every attribute
value re-validated, a second object built at ``end``.

What is the same as the SDK's spans: the sampler is asked for every span (with
the SDK's arguments), trace and span ids, flags and trace state are made as the
SDK makes them, the span processors get ``on_start`` and, at ``end``, a
``ReadableSpan`` they export as any other (OTLP, the trace file, the console).
Attribute values of type ``str``, ``bool``, ``int`` and ``float`` are stored as
they are -- as the SDK would -- and anything else goes through the SDK's own
cleaning. ``tests/test_light_spans.py`` checks that a light span and an SDK span
made by the same calls export the same.

What is not: span limits (``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT``,
``OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT`` and friends) are not applied -- these spans
carry at most ~20 short attributes --, the processors' experimental
``_on_ending`` hook is not called, and a span is meant for one thread at a time
(no lock). Root spans (no valid parent: a new trace), tracers that are not the
SDK's, a tracer a configurator disabled and the SDK's own span metrics are left
to the tracer itself, unchanged.
"""

from __future__ import annotations

import traceback
from time import time_ns
from types import MappingProxyType
from typing import Mapping

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from specdec.telemetry import tracing

_PLAIN = frozenset({str, bool, int, float})  # values the SDK would store unchanged
_UNSET = Status(StatusCode.UNSET)


def start_span(name: str, *, kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping | None = None,
               context: Context | None = None, tracer: trace.Tracer | None = None,
               start_time: int | None = None) -> trace.Span:
    """``tracer.start_span(name, context, kind, attributes, start_time)``, cheaper: a
    :class:`LightSpan` for a recorded child span of an SDK tracer; otherwise
    whatever the tracer makes. ``tracer``: specdec's (:func:`specdec.telemetry.tracing.tracer`)
    unless given. Not made current (``trace.use_span`` does that, as for the SDK's)."""
    tracer = tracer or tracing.tracer()
    parent = trace.get_current_span(context).get_span_context()
    if not parent.is_valid or not _plain_sdk_tracer(tracer):
        return tracer.start_span(name, context=context, kind=kind, attributes=attributes, start_time=start_time)
    # As in the SDK's Tracer.start_span for a span with a parent.
    sampling = tracer.sampler.should_sample(context, parent.trace_id, name, kind, attributes, ())
    flags = TraceFlags.SAMPLED if sampling.decision.is_sampled() else TraceFlags.DEFAULT
    if parent.trace_flags.random_trace_id:
        flags |= TraceFlags.RANDOM_TRACE_ID
    span_context = SpanContext(parent.trace_id, tracer.id_generator.generate_span_id(), is_remote=False,
                               trace_flags=TraceFlags(flags), trace_state=sampling.trace_state)
    if not sampling.decision.is_recording():
        return trace.NonRecordingSpan(span_context)
    span = LightSpan(tracer, name, kind, span_context, parent, start_time)
    if sampling.attributes:
        span.set_attributes(sampling.attributes)
    tracer.span_processor.on_start(span, parent_context=context)
    return span


def _plain_sdk_tracer(tracer) -> bool:
    """An SDK tracer whose spans need nothing beyond what a light span does: not
    disabled by a tracer configurator, not counting its spans in the SDK's own
    metrics (``OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED``)."""
    return (isinstance(tracer, sdk_trace.Tracer) and tracer._is_enabled()  # noqa: SLF001
            and isinstance(tracer._tracer_metrics, NoOpTracerMetrics))  # noqa: SLF001


class LightSpan(trace.Span):
    """A recording span that becomes an SDK ``ReadableSpan`` when it ends."""

    __slots__ = ("_tracer", "_name", "_kind", "_context", "_parent", "_attributes", "_events", "_links",
                 "_status", "_start_time", "_end_time", "_dropped")

    def __init__(self, tracer: sdk_trace.Tracer, name: str, kind: SpanKind, context: SpanContext,
                 parent: SpanContext | None, start_time: int | None = None):
        self._tracer, self._name, self._kind, self._context, self._parent = tracer, name, kind, context, parent
        self._attributes: dict = {}
        self._events: list = []
        self._links: list = []
        self._status = _UNSET
        self._start_time = start_time if start_time is not None else time_ns()
        self._end_time: int | None = None
        self._dropped = 0  # attributes the SDK's cleaning dropped (bad keys)

    # ---- what span processors and exporters read (as on an SDK span)
    name = property(lambda self: self._name)
    kind = property(lambda self: self._kind)
    parent = property(lambda self: self._parent)
    context = property(lambda self: self._context)
    start_time = property(lambda self: self._start_time)
    end_time = property(lambda self: self._end_time)
    status = property(lambda self: self._status)
    attributes = property(lambda self: MappingProxyType(self._attributes))
    events = property(lambda self: tuple(self._events))
    links = property(lambda self: tuple(self._links))
    dropped_attributes = property(lambda self: self._dropped)
    dropped_events = dropped_links = property(lambda self: 0)
    resource = property(lambda self: self._tracer.resource)
    instrumentation_scope = property(lambda self: self._tracer._instrumentation_scope)  # noqa: SLF001

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self._end_time is None

    def set_attributes(self, attributes: Mapping) -> None:
        if self._end_time is not None:
            return
        mine = self._attributes
        for key, value in attributes.items():
            if type(value) in _PLAIN and type(key) is str and key:
                mine[key] = value
            else:
                cleaned = _cleaned({key: value})
                mine.update(cleaned)
                self._dropped += 1 - len(cleaned)

    def set_attribute(self, key: str, value) -> None:
        if type(key) is str and key:
            self.set_attributes({key: value})
        elif self._end_time is None:  # as the SDK's set_attribute: a bad key is dropped and counted
            self._dropped += 1

    def add_event(self, name: str, attributes: Mapping | None = None, timestamp: int | None = None) -> None:
        if self._end_time is None:
            self._events.append(sdk_trace.Event(name, _cleaned(attributes), timestamp))

    def add_link(self, context: SpanContext, attributes: Mapping | None = None) -> None:
        if self._end_time is None and (context.is_valid or attributes or context.trace_state):
            self._links.append(trace.Link(context, _cleaned(attributes)))

    def update_name(self, name: str) -> None:
        if self._end_time is None:
            self._name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        """As the SDK: OK is final, UNSET is ignored."""
        if self._end_time is not None or self._status.status_code is StatusCode.OK:
            return
        if isinstance(status, StatusCode):
            status = Status(status, description)
        if status.status_code is not StatusCode.UNSET:
            self._status = status

    def record_exception(self, exception: BaseException, attributes: Mapping | None = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        """The SDK's ``exception`` event, attribute for attribute."""
        module, qualname = type(exception).__module__, type(exception).__qualname__
        event = {
            "exception.type": f"{module}.{qualname}" if module and module != "builtins" else qualname,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
            **(attributes or {}),
        }
        self.add_event("exception", event, timestamp)

    def __exit__(self, exc_type, exc_val, exc_tb) -> None:
        """``with span:`` as with the SDK's span: a failure is recorded, then it ends."""
        if exc_val is not None and self.is_recording():
            self.record_exception(exc_val, escaped=True)
            self.set_status(Status(StatusCode.ERROR, f"{type(exc_val).__name__}: {exc_val}"))
        self.end()

    def end(self, end_time: int | None = None) -> None:
        if self._end_time is not None:
            return
        self._end_time = end_time if end_time is not None else time_ns()
        tracer, attributes = self._tracer, self._attributes
        if self._dropped:  # rare: the count travels on a BoundedAttributes, as from the SDK
            attributes = BoundedAttributes(attributes=attributes, immutable=True)
            attributes.dropped = self._dropped
        tracer.span_processor.on_end(sdk_trace.ReadableSpan(
            self._name, self._context, self._parent, tracer.resource, attributes, tuple(self._events),
            tuple(self._links), self._kind, tracer.instrumentation_info, self._status, self._start_time,
            self._end_time, tracer._instrumentation_scope))  # noqa: SLF001 -- the scope its own spans carry


def _cleaned(attributes: Mapping | None) -> Mapping:
    """Attributes as the SDK keeps them (sequences as tuples, bad keys dropped)."""
    return BoundedAttributes(attributes=attributes, immutable=True) if attributes else MappingProxyType({})
