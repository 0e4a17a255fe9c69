"""A minimal OTLP/gRPC trace receiver that keeps spans in memory.

Not a collector: it exists so tests and ``specdec bench-tracing`` can export to a
*real* OTLP endpoint (the exporters, serialisation and network path all run as
in production) without installing one. Spans come back flattened into the same
dicts as the trace file (:func:`specdec.telemetry.trace_file.span_to_dict`).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as ts_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as ts_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


def _value(v):
    """An OTLP AnyValue as a plain Python value."""
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def _kind(kind: int) -> str:
    return trace_pb2.Span.SpanKind.Name(kind).removeprefix("SPAN_KIND_")


def flatten(request: ts_pb2.ExportTraceServiceRequest) -> list[dict]:
    spans = []
    for rs in request.resource_spans:
        resource = _attributes(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append({
                    "trace_id": s.trace_id.hex(),
                    "span_id": s.span_id.hex(),
                    "parent_span_id": s.parent_span_id.hex() or None,
                    "name": s.name,
                    "kind": _kind(s.kind),
                    "service": resource.get("service.name", ""),
                    "start_ns": s.start_time_unix_nano,
                    "end_ns": s.end_time_unix_nano,
                    "status": trace_pb2.Status.StatusCode.Name(s.status.code).removeprefix("STATUS_CODE_"),
                    "attributes": _attributes(s.attributes),
                    "events": [{"name": e.name, "attributes": _attributes(e.attributes)} for e in s.events],
                })
    return spans


class _Servicer(ts_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver):
        self.receiver = receiver

    def Export(self, request, context):
        if self.receiver.keep:
            spans = flatten(request)
            count = len(spans)
        else:
            spans, count = [], sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        self.receiver._add(spans, count, request.ByteSize())
        return ts_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` point exporters at ``r.endpoint``; read ``r.spans``.

    ``keep=False`` only counts what arrives (``span_count``): a benchmark's
    receiver then costs about what a collector's network read would, instead
    of flattening and holding every span in the benchmarking process."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep: bool = True):
        self._lock = threading.Lock()
        self._spans: list[dict] = []
        self.keep = keep
        self.exports = 0
        self.span_count = 0
        self.bytes = 0
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        ts_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.endpoint = f"http://{host}:{self.port}"

    def _add(self, spans: list[dict], count: int, size: int) -> None:
        with self._lock:
            self._spans.extend(spans)
            self.exports += 1
            self.span_count += count
            self.bytes += size

    @property
    def spans(self) -> list[dict]:
        with self._lock:
            return list(self._spans)

    def wait_for(self, predicate, timeout: float = 30.0) -> list[dict]:
        """Poll until ``predicate(spans)`` holds; return the spans (raise on timeout)."""
        if not self.keep:
            raise ValueError("this receiver keeps no spans (keep=False): read span_count instead")
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"OTLP receiver: condition not met after {timeout:.0f} s ({len(spans)} spans)")
            time.sleep(0.05)

    def start(self) -> OtlpReceiver:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(None)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
