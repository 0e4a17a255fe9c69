"""specdec.telemetry.light_spans: a light span exports what the SDK's span exports for the
same calls, takes the sampler's decision as the SDK does, and behaves as a span
(current, ended, failed) wherever the SDK's would."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from specdec.telemetry import light_spans, otlp_encode
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class _Starts(SpanProcessor):
    def __init__(self):
        self.started = []

    def on_start(self, span, parent_context=None):
        # what a processor may read of a starting span, as of the SDK's
        self.started.append((span.name, dict(span.attributes), span.kind, span.parent, span.resource,
                             span.instrumentation_scope, span.events, span.links, span.dropped_attributes,
                             span.status.status_code, span.end_time))


def _provider(sampler=None):
    provider = TracerProvider(resource=Resource.create({"service.name": "light-test"}), sampler=sampler)
    provider.memory = InMemorySpanExporter()
    provider.starts = _Starts()
    provider.add_span_processor(provider.starts)
    provider.add_span_processor(SimpleSpanProcessor(provider.memory))
    return provider


def _parent(sampled=True, state=None) -> object:
    flags = TraceFlags(TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
    ctx = SpanContext(0x1234, 0x5678, is_remote=True, trace_flags=flags, trace_state=state or TraceState())
    return trace.set_span_in_context(NonRecordingSpan(ctx))


class _Odd:
    def __str__(self):
        return "odd"


def _exercise(span) -> None:
    """The same calls on either kind of span: every attribute and event path."""
    span.set_attributes({"s": "x", "i": 7, "f": 0.5, "b": True, "list": [1, 2], "odd": _Odd(), "": 1,
                         "bytes": b"\x00"})
    span.set_attribute("i", 8)
    span.set_attribute(5, "x")  # a bad key: dropped and counted by set_attribute
    span.set_attribute("none", None)
    span.add_event("ev", {"k": [1.5, 2.5]})
    span.update_name("renamed")
    try:
        raise KeyError("boom")
    except KeyError as exc:
        span.record_exception(exc, attributes={"extra": 1})
    span.set_status(Status(StatusCode.ERROR, "failed"))
    span.set_status(StatusCode.UNSET)  # ignored by both
    span.end()
    span.set_attribute("late", 1)  # after end: ignored by both
    span.end()  # a second end exports nothing more


def _comparable(s) -> dict:
    return {
        "name": s.name, "kind": s.kind, "trace_id": s.context.trace_id, "flags": s.context.trace_flags,
        "state": s.context.trace_state, "parent": s.parent, "attributes": dict(s.attributes),
        "events": [(e.name, {k: v for k, v in e.attributes.items() if k != "exception.stacktrace"})
                   for e in s.events],
        "status": (s.status.status_code, s.status.description), "resource": s.resource.attributes,
        "scope": s.instrumentation_scope, "links": list(s.links), "dropped": s.dropped_attributes,
        "timed": s.start_time <= s.end_time,
    }


def test_light_span_exports_what_the_sdk_span_exports():
    provider = _provider()
    tracer = provider.get_tracer("specdec")
    parent = _parent(state=TraceState([("vendor", "v")]))
    light = light_spans.start_span("op", kind=SpanKind.CLIENT, attributes={"a": 1}, context=parent, tracer=tracer)
    sdk = tracer.start_span("op", kind=SpanKind.CLIENT, attributes={"a": 1}, context=parent)
    assert isinstance(light, light_spans.LightSpan) and not isinstance(sdk, light_spans.LightSpan)
    assert light.is_recording()
    for span in (light, sdk):
        _exercise(span)
        assert not span.is_recording()
    got_light, got_sdk = provider.memory.get_finished_spans()
    assert _comparable(got_light) == _comparable(got_sdk)
    assert got_light.attributes["list"] == (1, 2) and got_light.attributes["odd"] == "odd"
    assert got_light.context.span_id != got_sdk.context.span_id and not got_light.context.is_remote
    # processors were told of both starts, and saw the same span
    light_start, sdk_start = provider.starts.started
    assert light_start == sdk_start and light_start[:2] == ("op", {"a": 1})
    assert got_light.dropped_attributes == 2  # "" and 5
    # and the OTLP encodings agree but for ids and times
    a, b = (ExportTraceServiceRequest.FromString(otlp_encode.encode_spans([s])) for s in (got_light, got_sdk))
    for request in (a, b):
        span = request.resource_spans[0].scope_spans[0].spans[0]
        span.span_id, span.start_time_unix_nano, span.end_time_unix_nano = b"", 0, 0
        ordered = sorted(span.attributes, key=lambda kv: kv.key)  # a re-set key moves last in the SDK's
        del span.attributes[:]
        span.attributes.extend(ordered)
        for event in span.events:
            event.time_unix_nano = 0
            for kv in event.attributes:
                if kv.key == "exception.stacktrace":
                    kv.value.string_value = ""
    assert a == b


@pytest.mark.parametrize("sampler", [
    None,  # the SDK's default: parent-based, always on
    sampling.ALWAYS_OFF,
    sampling.ALWAYS_ON,
    sampling.TraceIdRatioBased(0.5),
    sampling.ParentBased(sampling.ALWAYS_OFF, remote_parent_not_sampled=sampling.ALWAYS_ON),
])
@pytest.mark.parametrize("sampled", [True, False])
def test_sampling_decision_is_the_sdks(sampler, sampled):
    provider = _provider(sampler)
    tracer = provider.get_tracer("specdec")
    for trace_id, random_id in ((0x1234, False), (0xFFFF_FFFF_FFFF_FFFF_FFFF_FFFF_FFFF_FFF0, True)):
        flags = TraceFlags((TraceFlags.SAMPLED if sampled else TraceFlags.DEFAULT)
                           | (TraceFlags.RANDOM_TRACE_ID if random_id else 0))
        parent = trace.set_span_in_context(NonRecordingSpan(SpanContext(trace_id, 0x5678, True, flags)))
        light = light_spans.start_span("op", context=parent, tracer=tracer)
        sdk = tracer.start_span("op", context=parent)
        assert light.is_recording() == sdk.is_recording()
        assert light.get_span_context().trace_flags == sdk.get_span_context().trace_flags
        assert light.get_span_context().trace_id == trace_id
        light.end()
        sdk.end()
    exported = provider.memory.get_finished_spans()
    assert len(exported) % 2 == 0 and all(s.name == "op" for s in exported)


def test_root_spans_and_other_tracers_are_left_to_the_tracer():
    provider = _provider()
    tracer = provider.get_tracer("specdec")
    root = light_spans.start_span("root", tracer=tracer)  # no parent: a new trace, the SDK makes it
    assert root.is_recording() and not isinstance(root, light_spans.LightSpan)
    root.end()
    noop = light_spans.start_span("x", context=_parent(), tracer=trace.NoOpTracer())
    assert not noop.is_recording()
    assert [s.name for s in provider.memory.get_finished_spans()] == ["root"]


def test_current_light_span_parents_sdk_spans_and_records_failures():
    provider = _provider()
    tracer = provider.get_tracer("specdec")
    with pytest.raises(ValueError):
        with trace.use_span(light_spans.start_span("round", context=_parent(), tracer=tracer),
                            end_on_exit=True) as span:
            assert trace.get_current_span() is span
            tracer.start_span("child").end()
            raise ValueError("bad round")
    child, round_ = provider.memory.get_finished_spans()
    assert child.parent.span_id == round_.context.span_id and child.context.trace_id == 0x1234
    assert round_.status.status_code is StatusCode.ERROR and round_.status.description == "ValueError: bad round"
    assert [e.name for e in round_.events] == ["exception"]
    assert round_.events[0].attributes["exception.type"] == "ValueError"
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_ok_status_is_final():
    provider = _provider()
    span = light_spans.start_span("op", context=_parent(), tracer=provider.get_tracer("specdec"))
    span.set_status(StatusCode.OK)
    span.set_status(Status(StatusCode.ERROR, "late"))
    span.end()
    assert provider.memory.get_finished_spans()[0].status.status_code is StatusCode.OK


def test_with_block_records_a_failure_as_the_sdks_span_does():
    provider = _provider()
    tracer = provider.get_tracer("specdec")
    for span in (light_spans.start_span("op", context=_parent(), tracer=tracer),
                 tracer.start_span("op", context=_parent())):
        with pytest.raises(RuntimeError):
            with span:
                raise RuntimeError("inside")
    got_light, got_sdk = provider.memory.get_finished_spans()
    assert _comparable(got_light) == _comparable(got_sdk)
    assert got_light.status.status_code is StatusCode.ERROR
    assert got_light.events[0].attributes["exception.escaped"] == "True"


def test_a_disabled_tracer_or_the_sdks_span_metrics_leave_the_span_to_the_sdk(monkeypatch):
    from opentelemetry.metrics import NoOpMeterProvider
    from opentelemetry.sdk.trace import _TracerConfig
    from opentelemetry.sdk.trace._tracer_metrics import TracerMetrics

    provider = _provider()
    tracer = provider.get_tracer("specdec")
    tracer._set_tracer_config(_TracerConfig(is_enabled=False))  # what a tracer configurator does
    assert not light_spans.start_span("op", context=_parent(), tracer=tracer).is_recording()
    tracer._set_tracer_config(_TracerConfig(is_enabled=True))
    # OTEL_PYTHON_SDK_INTERNAL_METRICS_ENABLED: the SDK counts the spans it starts
    monkeypatch.setattr(tracer, "_tracer_metrics", TracerMetrics(NoOpMeterProvider()))
    span = light_spans.start_span("op", context=_parent(), tracer=tracer)
    assert span.is_recording() and not isinstance(span, light_spans.LightSpan)
    span.end()
