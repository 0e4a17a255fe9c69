"""OTLP trace export with a fast encoder: the same bytes on the wire, ~10x less CPU.

The OTLP exporters build a protobuf object for every span, attribute and value
before serialising them (``encode_spans``): ~60 µs of Python per span on this
machine, in the exporting thread of the very process that serves the model. A
round makes five spans, so that was about a third of tracing's cost.
:func:`encode_spans` writes the serialised ``ExportTraceServiceRequest``
directly (protobuf's wire format is simple: a tag, then a varint, a fixed-width
number or a length and the bytes), with each attribute key's bytes kept. The
collector receives the same message: the tests parse both encodings and compare
them field by field over every kind of span and attribute value the SDK makes.

:class:`OTLPSpanExporter` is the SDK's OTLP/gRPC span exporter sending those
bytes; everything else (endpoint, headers, TLS, compression, retries) is the
SDK's. A batch this encoder cannot write goes through the SDK's encoder.

Wire format: https://protobuf.dev/programming-guides/encoding/ ; the messages
are opentelemetry-proto's ``trace.proto``, ``common.proto`` and
``resource.proto``.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Mapping, Sequence

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as _SdkGrpcSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.trace.v1.trace_pb2 import Span as PbSpan
from opentelemetry.proto.trace.v1.trace_pb2 import SpanFlags as PbSpanFlags
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

log = logging.getLogger(__name__)

EXPORT_METHOD = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"

# Protobuf wire types.
_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5

_SPAN_KIND = {kind: PbSpan.SpanKind.Value(f"SPAN_KIND_{kind.name}") for kind in SpanKind}
_HAS_IS_REMOTE = PbSpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = PbSpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_pack_double = struct.Struct("<d").pack
_pack_fixed64 = struct.Struct("<Q").pack
_pack_fixed32 = struct.Struct("<I").pack


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _varint(n: int) -> bytes:
    """A non-negative integer, seven bits per byte, low bits first."""
    if n < 0x80:
        return _SMALL_VARINTS[n]
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_SMALL_VARINTS = [bytes((n,)) for n in range(0x80)]


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: string, bytes or a nested message."""
    return tag + _varint(len(payload)) + payload


# Tags, by message: (field number, wire type) as in opentelemetry-proto.
_REQ_RESOURCE_SPANS = _tag(1, _LEN)
_RS_RESOURCE, _RS_SCOPE_SPANS, _RS_SCHEMA_URL = _tag(1, _LEN), _tag(2, _LEN), _tag(3, _LEN)
_SS_SCOPE, _SS_SPANS, _SS_SCHEMA_URL = _tag(1, _LEN), _tag(2, _LEN), _tag(3, _LEN)
_RESOURCE_ATTRIBUTES = _tag(1, _LEN)
_SCOPE_NAME, _SCOPE_VERSION, _SCOPE_ATTRIBUTES = _tag(1, _LEN), _tag(2, _LEN), _tag(3, _LEN)
_SPAN_TRACE_ID, _SPAN_SPAN_ID, _SPAN_TRACE_STATE, _SPAN_PARENT_ID = (_tag(1, _LEN), _tag(2, _LEN), _tag(3, _LEN),
                                                                     _tag(4, _LEN))
_SPAN_NAME, _SPAN_KIND_TAG, _SPAN_START, _SPAN_END = _tag(5, _LEN), _tag(6, _VARINT), _tag(7, _FIXED64), \
    _tag(8, _FIXED64)
_SPAN_ATTRIBUTES, _SPAN_DROPPED_ATTRIBUTES = _tag(9, _LEN), _tag(10, _VARINT)
_SPAN_EVENTS, _SPAN_DROPPED_EVENTS = _tag(11, _LEN), _tag(12, _VARINT)
_SPAN_LINKS, _SPAN_DROPPED_LINKS = _tag(13, _LEN), _tag(14, _VARINT)
_SPAN_STATUS, _SPAN_FLAGS = _tag(15, _LEN), _tag(16, _FIXED32)
_EVENT_TIME, _EVENT_NAME, _EVENT_ATTRIBUTES, _EVENT_DROPPED = _tag(1, _FIXED64), _tag(2, _LEN), _tag(3, _LEN), \
    _tag(4, _VARINT)
_LINK_TRACE_ID, _LINK_SPAN_ID, _LINK_ATTRIBUTES, _LINK_DROPPED, _LINK_FLAGS = (
    _tag(1, _LEN), _tag(2, _LEN), _tag(4, _LEN), _tag(5, _VARINT), _tag(6, _FIXED32))
_STATUS_MESSAGE, _STATUS_CODE = _tag(2, _LEN), _tag(3, _VARINT)
_KV_KEY, _KV_VALUE = _tag(1, _LEN), _tag(2, _LEN)
_ANY_STRING, _ANY_BOOL, _ANY_INT, _ANY_DOUBLE = _tag(1, _LEN), _tag(2, _VARINT), _tag(3, _VARINT), \
    _tag(4, _FIXED64)
_ANY_ARRAY, _ANY_KVLIST, _ANY_BYTES = _tag(5, _LEN), _tag(6, _LEN), _tag(7, _LEN)
_LIST_VALUES = _tag(1, _LEN)  # ArrayValue.values and KeyValueList.values


# ---------------------------------------------------------------- attributes


def _any_value(value) -> bytes:
    """An ``AnyValue``'s bytes. The checks run in the SDK encoder's order (a bool
    is an int, a str is a Sequence); a oneof member is written even when it holds
    its type's default (``0``, ``""``, ``False``), as protobuf does."""
    kind = type(value)
    if kind is float:
        return _ANY_DOUBLE + _pack_double(value)
    if kind is str:
        return _field(_ANY_STRING, value.encode())
    if kind is int and _INT64_MIN <= value <= _INT64_MAX:
        return _ANY_INT + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)
    if value is None:
        return b""
    if isinstance(value, bool):
        return _ANY_BOOL + (b"\x01" if value else b"\x00")
    if isinstance(value, str):
        return _field(_ANY_STRING, value.encode())
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ValueError(f"{value} does not fit an int64")
        return _ANY_INT + _varint(value & 0xFFFF_FFFF_FFFF_FFFF)  # negatives: two's complement, 10 bytes
    if isinstance(value, float):
        return _ANY_DOUBLE + _pack_double(value)
    if isinstance(value, bytes):
        return _field(_ANY_BYTES, value)
    if isinstance(value, Sequence):
        return _field(_ANY_ARRAY, b"".join([_field(_LIST_VALUES, _any_value(v)) for v in value]))
    if isinstance(value, Mapping):
        return _field(_ANY_KVLIST, b"".join([_field(_LIST_VALUES, _key_value(str(k), v)) for k, v in value.items()]))
    raise TypeError(f"invalid type {type(value).__name__} of value {value!r}")


_key_bytes: dict[str, bytes] = {}  # key -> its KeyValue.key field; spans repeat a few dozen keys


def _key_head(key: str) -> bytes:
    """The ``KeyValue.key`` field of ``key``."""
    head = _key_bytes.get(key)
    if head is None:
        head = _field(_KV_KEY, key.encode())
        if len(_key_bytes) < 4096:  # arbitrary keys (user attributes) must not grow it without bound
            _key_bytes[key] = head
    return head


def _key_value(key: str, value) -> bytes:
    """A ``KeyValue`` message's bytes."""
    return _key_head(key) + _field(_KV_VALUE, _any_value(value))


_KV_DOUBLE = _KV_VALUE + _varint(len(_ANY_DOUBLE) + 8) + _ANY_DOUBLE  # KeyValue.value = AnyValue{double}


def _items(attributes):
    """An attribute mapping's items, read from the dict underneath when there is
    one (the SDK's ``BoundedAttributes``, frozen once its span ended): going
    through its Mapping interface costs more than encoding the attribute."""
    inner = getattr(attributes, "_dict", None)
    return (attributes if inner is None else inner).items()


def _attributes(tag: bytes, attributes) -> bytes:
    """Each attribute as a ``tag``-ged KeyValue field. A value the protocol cannot
    carry is left out with a log line, as the SDK's encoder does."""
    if not attributes:
        return b""
    parts = []
    for key, value in _items(attributes):
        head = _key_bytes.get(key) or _key_head(key)
        if type(value) is float:  # inlined: most attributes here are durations
            kv = head + _KV_DOUBLE + _pack_double(value)
        else:
            try:
                kv = head + _field(_KV_VALUE, _any_value(value))
            except (TypeError, ValueError) as e:
                log.error("span attribute %s left out of the OTLP export: %s", key, e)
                continue
        n = len(kv)
        parts.append(tag + (_SMALL_VARINTS[n] if n < 0x80 else _varint(n)) + kv)
    return b"".join(parts)


def _uint(tag: bytes, n: int | None) -> bytes:
    return tag + _varint(n) if n else b""


def _string(tag: bytes, s: str | None) -> bytes:
    return _field(tag, s.encode()) if s else b""


# ---------------------------------------------------------------- spans


_LOCAL_FLAGS, _REMOTE_FLAGS = _pack_fixed32(_HAS_IS_REMOTE), _pack_fixed32(_HAS_IS_REMOTE | _IS_REMOTE)


def _flags(parent) -> bytes:
    """``flags``: whether the parent (or a link's context) came from another process."""
    return _REMOTE_FLAGS if parent is not None and parent.is_remote else _LOCAL_FLAGS


_name_bytes: dict[str, bytes] = {}  # span name -> its Span.name field (a process has a few dozen names)


def _name(name: str) -> bytes:
    cached = _name_bytes.get(name)
    if cached is None:
        cached = _string(_SPAN_NAME, name)
        if len(_name_bytes) < 4096:
            _name_bytes[name] = cached
    return cached


# The id fields' tag and length, ahead of the id's bytes.
_SPAN_IDS = _SPAN_TRACE_ID + b"\x10", _SPAN_SPAN_ID + b"\x08"
_LINK_IDS = _LINK_TRACE_ID + b"\x10", _LINK_SPAN_ID + b"\x08"
_SPAN_PARENT = _SPAN_PARENT_ID + b"\x08"


def _span(span) -> bytes:
    """One ``Span`` message's bytes, with the fields ``encode_spans`` sets."""
    ctx, parent = span.get_span_context(), span.parent
    status = span.status
    status_bytes = _string(_STATUS_MESSAGE, status.description) + _uint(_STATUS_CODE, status.status_code.value) \
        if status.description or status.status_code.value else b""
    trace_state = ",".join(f"{k}={v}" for k, v in ctx.trace_state.items()) if ctx.trace_state else ""
    # A ReadableSpan's own attributes and events, not the copy or view its
    # properties make of them on each access.
    own = isinstance(span, ReadableSpan)
    attributes = span._attributes if own else span.attributes
    parts = [
        _SPAN_IDS[0], ctx.trace_id.to_bytes(16, "big"), _SPAN_IDS[1], ctx.span_id.to_bytes(8, "big"),
        _string(_SPAN_TRACE_STATE, trace_state),
        _SPAN_PARENT + parent.span_id.to_bytes(8, "big") if parent is not None else b"",
        _name(span.name),
        _SPAN_KIND_TAG, _SMALL_VARINTS[_SPAN_KIND[span.kind]],
        _SPAN_START + _pack_fixed64(span.start_time) if span.start_time else b"",
        _SPAN_END + _pack_fixed64(span.end_time) if span.end_time else b"",
        _attributes(_SPAN_ATTRIBUTES, attributes),
        _uint(_SPAN_DROPPED_ATTRIBUTES, span.dropped_attributes),
    ]
    for event in (span._events if own else span.events) or ():
        parts.append(_field(_SPAN_EVENTS, b"".join([
            _EVENT_TIME + _pack_fixed64(event.timestamp) if event.timestamp else b"",
            _string(_EVENT_NAME, event.name),
            _attributes(_EVENT_ATTRIBUTES, event.attributes),
            _uint(_EVENT_DROPPED, event.dropped_attributes)])))
    parts.append(_uint(_SPAN_DROPPED_EVENTS, span.dropped_events))
    for link in span.links or ():
        parts.append(_field(_SPAN_LINKS, b"".join([
            _LINK_IDS[0], link.context.trace_id.to_bytes(16, "big"),
            _LINK_IDS[1], link.context.span_id.to_bytes(8, "big"),
            _attributes(_LINK_ATTRIBUTES, link.attributes),
            _uint(_LINK_DROPPED, link.dropped_attributes),
            _LINK_FLAGS, _flags(link.context)])))
    parts += [_uint(_SPAN_DROPPED_LINKS, span.dropped_links),
              _field(_SPAN_STATUS, status_bytes),  # always there, as in the SDK's encoding
              _SPAN_FLAGS, _flags(parent)]
    return b"".join(parts)


_resource_bytes: dict = {}  # Resource -> its ResourceSpans.resource field (a process has one or two)
_scope_bytes: dict = {}  # InstrumentationScope | None -> its ScopeSpans.scope field


def _resource(resource) -> bytes:
    cached = _resource_bytes.get(resource)
    if cached is None:
        cached = _field(_RS_RESOURCE, _attributes(_RESOURCE_ATTRIBUTES, resource.attributes))
        if len(_resource_bytes) < 64:
            _resource_bytes[resource] = cached
    return cached


def _scope(scope) -> bytes:
    cached = _scope_bytes.get(scope)
    if cached is None:
        payload = b"" if scope is None else (_string(_SCOPE_NAME, scope.name) + _string(_SCOPE_VERSION, scope.version)
                                             + _attributes(_SCOPE_ATTRIBUTES, scope.attributes))
        cached = _field(_SS_SCOPE, payload)
        if len(_scope_bytes) < 256:
            _scope_bytes[scope] = cached
    return cached


def encode_spans(spans: Sequence) -> bytes:
    """The serialised ``ExportTraceServiceRequest`` of finished SDK spans: one
    ``ResourceSpans`` per resource, one ``ScopeSpans`` per instrumentation scope,
    in the order first seen, as ``opentelemetry``'s own ``encode_spans``."""
    # Grouped by object first: a Resource hashes by serialising its attributes to
    # JSON, and a process's spans share one Resource object (or a few).
    by_object: dict[tuple[int, int], tuple] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope or None
        group = by_object.get((id(resource), id(scope)))
        if group is None:
            group = by_object[id(resource), id(scope)] = (resource, scope, [])
        span_bytes = _span(span)
        n = len(span_bytes)
        group[2].append(_SS_SPANS + (_SMALL_VARINTS[n] if n < 0x80 else _varint(n)) + span_bytes)
    grouped: dict = {}  # then by value, as the SDK does
    for resource, scope, encoded in by_object.values():
        grouped.setdefault(resource, {}).setdefault(scope, []).extend(encoded)
    out = []
    for resource, scopes in grouped.items():
        scope_spans = [_field(_RS_SCOPE_SPANS, _scope(scope) + b"".join(encoded)
                              + _string(_SS_SCHEMA_URL, scope.schema_url if scope is not None else None))
                       for scope, encoded in scopes.items()]
        out.append(_field(_REQ_RESOURCE_SPANS, _resource(resource) + b"".join(scope_spans)
                          + _string(_RS_SCHEMA_URL, resource.schema_url)))
    return b"".join(out)


# ---------------------------------------------------------------- the exporter


class _TraceServiceBytesStub:
    """``TraceServiceStub`` taking the request already serialised."""

    def __init__(self, channel):
        self.Export = channel.unary_unary(EXPORT_METHOD, request_serializer=None,
                                          response_deserializer=ExportTraceServiceResponse.FromString)


class OTLPSpanExporter(_SdkGrpcSpanExporter):
    """The SDK's OTLP/gRPC span exporter (configured the same way, from the same
    ``OTEL_EXPORTER_OTLP_*`` variables) sending :func:`encode_spans`' bytes."""

    def _initialize_channel_and_stub(self):  # at start, and on reconnecting after UNAVAILABLE
        super()._initialize_channel_and_stub()
        self._client = _TraceServiceBytesStub(self._channel)

    def _translate_data(self, data: Sequence) -> bytes:
        try:
            return encode_spans(data)
        except Exception:  # a span this encoder does not know: the SDK's encoder decides
            log.exception("fast OTLP encoding failed; this batch uses the SDK's encoder")
            return super()._translate_data(data).SerializeToString()
