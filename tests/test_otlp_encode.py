"""The fast OTLP encoder against the SDK's: the same message for every kind of
span, attribute value and grouping the SDK makes, and the exporter end to end."""

from __future__ import annotations

import logging

import pytest
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as SdkOTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specdec.telemetry import otlp_encode
from specdec.tools.otlp_receiver import OtlpReceiver

@pytest.fixture(autouse=True)
def cold_caches():
    """Each test starts with the encoder's caches empty (they outlive batches)."""
    for cache in (otlp_encode._key_fields, otlp_encode._name_fields, otlp_encode._resource_fields,
                  otlp_encode._scope_fields, otlp_encode._reads_own_fields):
        cache.clear()


EVERY_VALUE = {
    "str": "Verify", "empty": "", "unicode": "γ → ü 🚀", "long": "x" * 300,
    "true": True, "false": False,
    "zero": 0, "small": 7, "neg": -5, "int64_max": 2**63 - 1, "int64_min": -2**63, "two_bytes": 300,
    "float": 0.0123, "float_zero": 0.0, "float_neg": -1e300, "nan": float("nan"), "inf": float("inf"),
    "bytes": b"\xff\x00", "strs": ("a", "", "ü"), "ints": (1, -2, 2**40), "floats": (0.5, -0.25),
    "bools": (True, False), "empty_seq": (), "with_none": (None, 1), "mixed": (1, "a", 2.5, True, None),
    "nested": ((1, 2), ("a",), ()), "mapping": {"a": 1, 2: "b", "inner": {"x": (1.5,)}},
}


def _provider(name: str, schema_url: str | None = None, limits: SpanLimits | None = None):
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": name, "host.cores": 2}, schema_url=schema_url),
                              span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    return provider, memory


def _same_message(spans) -> ExportTraceServiceRequest:
    """Both encoders' messages are equal (NaN aside: NaN != NaN, so compared as
    bytes), with the encoder's caches cold and then warm."""
    sdk = sdk_encode_spans(spans)
    for _ in ("cold", "warm"):
        fast = ExportTraceServiceRequest.FromString(otlp_encode.encode_spans(spans))
        assert fast == sdk or fast.SerializeToString(deterministic=True) == sdk.SerializeToString(deterministic=True)
    return fast


def test_every_attribute_value_kind_encodes_as_the_sdk_does():
    provider, memory = _provider("specdec-test")
    with provider.get_tracer("specdec").start_as_current_span("all", attributes=EVERY_VALUE):
        pass
    (span,) = memory.get_finished_spans()
    message = _same_message([span])
    encoded = message.resource_spans[0].scope_spans[0].spans[0]
    assert {kv.key for kv in encoded.attributes} == set(EVERY_VALUE)
    values = {kv.key: kv.value for kv in encoded.attributes}
    assert values["zero"].HasField("int_value") and values["false"].HasField("bool_value")  # defaults still set
    assert values["int64_min"].int_value == -2**63 and values["unicode"].string_value == "γ → ü 🚀"


def test_span_structure_encodes_as_the_sdk_does():
    """Parents local and remote (with trace state), every kind, events, links,
    statuses, dropped counts, several scopes and resources in one batch."""
    limits = SpanLimits(max_span_attributes=3, max_events=2, max_links=1, max_event_attributes=1,
                        max_link_attributes=1)
    provider, memory = _provider("specdec-a", limits=limits)
    other, other_memory = _provider("specdec-b", schema_url="https://opentelemetry.io/schemas/1.21.0")
    scoped = provider.get_tracer("specdec.other", "1.2.3", schema_url="https://example.com/s",
                                 attributes={"scope.attr": "x"})
    tracer = provider.get_tracer("specdec")
    remote = propagate.extract({"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                                "tracestate": "vendor=a,other=b"})
    with tracer.start_as_current_span("root", kind=trace.SpanKind.SERVER, context=remote,
                                      attributes={"a": 1, "b": 2, "c": 3, "d": 4}) as root:
        root.add_event("first", {"k": 1.5, "dropped": 2})
        root.add_event("second")
        root.add_event("third")
        for kind in trace.SpanKind:
            with tracer.start_as_current_span(f"child {kind.name}", kind=kind,
                                              links=[trace.Link(remote_context(remote)),  # dropped: max 1
                                                     trace.Link(root.get_span_context(), {"why": "test", "n": 2})]):
                pass
        with scoped.start_as_current_span("failed") as failed:
            failed.record_exception(ValueError("bad draft token"))
            failed.set_status(trace.Status(trace.StatusCode.ERROR, "INVALID_ARGUMENT: bad draft token"))
        with tracer.start_as_current_span("ok") as ok:
            ok.set_status(trace.Status(trace.StatusCode.OK))
    with other.get_tracer("specdec").start_as_current_span("elsewhere"):
        pass
    spans = list(memory.get_finished_spans()) + list(other_memory.get_finished_spans())
    assert any(s.dropped_attributes and s.dropped_events for s in spans) and any(s.dropped_links for s in spans)
    assert any(link.dropped_attributes for s in spans for link in s.links)
    message = _same_message(spans)
    assert len(message.resource_spans) == 2 and len(message.resource_spans[0].scope_spans) == 2
    # Interleaved batches group the same way (by resource, then scope, first seen first).
    _same_message(spans[::-1])
    _same_message([spans[0], spans[-1], spans[1], spans[-1]])


def remote_context(context) -> trace.SpanContext:
    return trace.get_current_span(context).get_span_context()


def test_equal_resources_that_are_different_objects_share_one_resource_spans():
    """Grouped by value, in the order first seen, as the SDK groups them."""
    first, memory = _provider("specdec-same")
    second, second_memory = _provider("specdec-same")
    for provider, name in ((first, "a"), (second, "b"), (first, "c")):
        with provider.get_tracer("specdec").start_as_current_span(name):
            pass
    a, c = memory.get_finished_spans()
    (b,) = second_memory.get_finished_spans()
    assert a.resource is not b.resource and a.resource == b.resource
    message = _same_message([a, b, c])
    assert len(message.resource_spans) == 1
    assert [s.name for s in message.resource_spans[0].scope_spans[0].spans] == ["a", "b", "c"]


def test_scopes_that_compare_equal_keep_their_own_attribute_types():
    """1 == True == 1.0: a scope must not get another scope's encoding from the
    cache (one provider per value: a provider hands equal scopes one tracer)."""
    for value in (1, True, 1.0):
        provider, memory = _provider("specdec-test")
        with provider.get_tracer("scope", attributes={"x": value}).start_as_current_span("s"):
            pass
        (span,) = memory.get_finished_spans()
        assert type(span.instrumentation_scope.attributes["x"]) is type(value)
        _same_message([span])


def test_a_span_class_that_overrides_its_attributes_is_read_through_them():
    from opentelemetry.sdk.trace import ReadableSpan

    class Redacted(ReadableSpan):
        @property
        def attributes(self):
            return {k: "***" if k == "secret" else v for k, v in super().attributes.items()}

        @property
        def events(self):
            return ()

    provider, memory = _provider("specdec-test")
    with provider.get_tracer("specdec").start_as_current_span("s", attributes={"secret": "hunter2"}) as span:
        span.add_event("e")
    (finished,) = memory.get_finished_spans()
    redacted = Redacted(name=finished.name, context=finished.context, parent=finished.parent,
                        resource=finished.resource, attributes=finished.attributes, events=finished.events,
                        kind=finished.kind, status=finished.status, start_time=finished.start_time,
                        end_time=finished.end_time, instrumentation_scope=finished.instrumentation_scope)
    encoded = _same_message([redacted]).resource_spans[0].scope_spans[0].spans[0]
    assert [(kv.key, kv.value.string_value) for kv in encoded.attributes] == [("secret", "***")]
    assert not encoded.events


@pytest.mark.parametrize("attributes", [{"ok": 1, "huge": 2**70}, {"ok": 1, "bad\ud800key": 2}])
def test_an_attribute_the_protocol_cannot_carry_is_left_out_with_a_log_line(caplog, attributes):
    provider, memory = _provider("specdec-test")
    with provider.get_tracer("specdec").start_as_current_span("s", attributes=attributes):
        pass
    with caplog.at_level(logging.ERROR):
        message = _same_message(memory.get_finished_spans())  # the SDK leaves it out too
    assert [kv.key for kv in message.resource_spans[0].scope_spans[0].spans[0].attributes] == ["ok"]
    ours = [r for r in caplog.records if r.name == "specdec.telemetry.otlp_encode"]
    assert ours and "left out of the OTLP export" in ours[0].getMessage()


def test_exporter_sends_the_spans_to_a_collector():
    provider, memory = _provider("specdec-test")
    with provider.get_tracer("specdec").start_as_current_span("root", attributes=EVERY_VALUE):
        with provider.get_tracer("specdec").start_as_current_span("child", kind=trace.SpanKind.CLIENT):
            pass
    spans = memory.get_finished_spans()
    received = []
    for exporter_class in (otlp_encode.OTLPSpanExporter, SdkOTLPSpanExporter):
        with OtlpReceiver() as receiver:
            exporter = exporter_class(endpoint=receiver.endpoint, insecure=True)
            assert exporter.export(spans) == SpanExportResult.SUCCESS
            exporter.shutdown()
            received.append(receiver.wait_for(lambda got: len(got) == 2))
    fast, sdk = received
    assert [s["name"] for s in fast] == ["child", "root"]
    assert _without_nan(fast) == _without_nan(sdk)


def _without_nan(spans: list[dict]) -> list[dict]:
    return [{**s, "attributes": {k: v for k, v in s["attributes"].items() if k != "nan"}} for s in spans]


def test_exporter_still_sends_its_encoding_after_reconnecting():
    """After UNAVAILABLE the SDK's exporter makes a new channel and stub."""
    provider, memory = _provider("specdec-test")
    with provider.get_tracer("specdec").start_as_current_span("root"):
        pass
    with OtlpReceiver() as receiver:
        exporter = otlp_encode.OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
        exporter._channel.close()
        exporter._initialize_channel_and_stub()  # what its retry loop does
        assert isinstance(exporter._client, otlp_encode._TraceServiceBytesStub)
        assert exporter.export(memory.get_finished_spans()) == SpanExportResult.SUCCESS
        exporter.shutdown()
        assert [s["name"] for s in receiver.wait_for(lambda got: len(got) == 1)] == ["root"]


def test_exporter_falls_back_to_the_sdks_encoder(monkeypatch, caplog):
    provider, memory = _provider("specdec-test")
    with provider.get_tracer("specdec").start_as_current_span("root"):
        pass

    def broken(span):
        raise RuntimeError("a span this encoder does not know")

    monkeypatch.setattr(otlp_encode, "_span", broken)
    with OtlpReceiver() as receiver:
        exporter = otlp_encode.OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)
        assert exporter.export(memory.get_finished_spans()) == SpanExportResult.SUCCESS
        exporter.shutdown()
        assert [s["name"] for s in receiver.wait_for(lambda got: len(got) == 1)] == ["root"]
    assert "uses the SDK's encoder" in caplog.text


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16383, 16384, 2**32, 2**64 - 1])
def test_varint(n):
    from google.protobuf.internal.encoder import _VarintBytes

    assert otlp_encode._varint(n) == _VarintBytes(n)


def test_random_batches_encode_as_the_sdk_does():
    """Seeded random batches of ``ReadableSpan``: values nested two deep, equal
    but distinct resources and scopes, every status, optional times and parents."""
    import random

    from opentelemetry.sdk.trace import Event, ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    rng = random.Random(0)
    scalars = ["", "a", "ü🚀", "x" * 200, True, False, 0, -1, 127, 128, 2**63 - 1, -2**63, 2**63, 0.0, -0.0, 1.5,
               float("inf"), b"", b"\x00\xff", None]

    def value(depth=0):
        kind = rng.randrange(8)
        if depth < 2 and kind == 0:
            return tuple(value(depth + 1) for _ in range(rng.randrange(4)))
        if depth < 2 and kind == 1:
            return {rng.choice(["a", "b", 1]): value(depth + 1) for _ in range(rng.randrange(3))}
        return rng.choice(scalars)

    def attributes():
        return None if rng.random() < 0.2 else {f"k{rng.randrange(20)}": value() for _ in range(rng.randrange(6))}

    def context(remote):
        state = trace.TraceState([("v", "a"), ("w", "b")][:rng.randrange(3)]) if rng.random() < 0.5 else None
        return trace.SpanContext(rng.getrandbits(128), rng.getrandbits(64), remote, trace.TraceFlags(1), state)

    resources = [Resource.create({"service.name": "a"}), Resource.create({"service.name": "a"}),
                 Resource({"service.name": "b", "n": 1}, schema_url="https://s"), Resource({})]
    scopes = [None, InstrumentationScope("s"), InstrumentationScope("s"), InstrumentationScope("s", "1.0", "https://u"),
              InstrumentationScope("t", None, None, {"x": 1}), InstrumentationScope("t", None, None, {"x": True})]
    statuses = [trace.Status(trace.StatusCode.UNSET), trace.Status(trace.StatusCode.OK),
                trace.Status(trace.StatusCode.ERROR), trace.Status(trace.StatusCode.ERROR, "boom ü")]

    def span():
        return ReadableSpan(
            name=rng.choice(["n", "", "ü", "specdec.round"]), context=context(False),
            parent=None if rng.random() < 0.3 else context(rng.random() < 0.5), resource=rng.choice(resources),
            attributes=attributes(), kind=rng.choice(list(trace.SpanKind)), status=rng.choice(statuses),
            events=[Event(rng.choice(["", "e"]), attributes(), timestamp=rng.choice([None, 1, 2**63]))
                    for _ in range(rng.randrange(3))],
            links=[trace.Link(context(rng.random() < 0.5), attributes()) for _ in range(rng.randrange(3))],
            start_time=rng.choice([None, 0, 1700000000000000000]), end_time=rng.choice([None, 1700000000000000001]),
            instrumentation_scope=rng.choice(scopes))

    for _ in range(300):
        _same_message([span() for _ in range(rng.randrange(1, 6))])
