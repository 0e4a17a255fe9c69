"""The SERVER span every specdec service makes per call: a child of the W3C
trace context in the call's metadata, named and attributed as OpenTelemetry's
gRPC instrumentation names it (``/specdec.v1.TargetService/Verify``, ``rpc.*``,
``net.peer.*``), with the reply's ``ServerTiming`` as ``specdec.server.*``.
The coordinator's HTTP API makes one per request the same way
(:func:`start_http_span`: ``POST /v1/completions``, ``http.*``), a child of a
``traceparent`` header.
"""

from __future__ import annotations

import functools
import types
import urllib.parse
from collections.abc import Mapping

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode

from specdec.telemetry import tracing
from specdec.telemetry.metrics import http_method

# Probes call these every few seconds: a root trace each would bury the
# requests' traces at the collector.
UNTRACED_SERVICES = frozenset({"grpc.health.v1.Health"})


def start_server_span(full_method: str, metadata, peer: str) -> tuple[trace.Span, Context | None]:
    """The call's SERVER span, and the context to make current while the
    handler runs (None: none). A caller whose request is not sampled gets no
    span: its context, which says so, is made current (what the handler starts
    follows it). Services that are not traced get neither."""
    attributes = _rpc_attributes(full_method)
    if attributes is None:
        return trace.INVALID_SPAN, None
    parent = propagate.extract(dict(metadata)) if metadata else None
    caller = trace.get_current_span(parent).get_span_context()
    if caller.is_valid and not caller.trace_flags.sampled:
        return trace.INVALID_SPAN, parent
    span = tracing.tracer().start_span(full_method, context=parent, kind=trace.SpanKind.SERVER,
                                       attributes=attributes)
    if span.is_recording():  # which caller: several coordinators may share a service
        span.set_attributes(_peer_attributes(peer))
    return span, trace.set_span_in_context(span, parent)


def start_http_span(method: str, route: str, headers: Mapping[str, str], client: tuple | None
                    ) -> tuple[trace.Span, Context | None]:
    """An HTTP request's SERVER span (named ``METHOD ROUTE``, with OpenTelemetry's
    HTTP attributes: never the path's query, nor anything of the body), and the
    context to make current while it is answered; as :func:`start_server_span`
    for a caller that is not sampled. A method OpenTelemetry's conventions do
    not know is ``_OTHER`` (the span ``HTTP ROUTE``), never the client's own."""
    parent = propagate.extract(headers) if headers else None
    caller = trace.get_current_span(parent).get_span_context()
    if caller.is_valid and not caller.trace_flags.sampled:
        return trace.INVALID_SPAN, parent
    method = http_method(method)
    attributes = {"http.request.method": method, "http.route": route}
    if client:
        attributes.update({"client.address": str(client[0]), "client.port": int(client[1])})
    name = f"{'HTTP' if method == '_OTHER' else method} {route}"
    span = tracing.tracer().start_span(name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes)
    return span, trace.set_span_in_context(span, parent)


def end_http_span(span: trace.Span, status: int) -> None:
    """The response's status code on the span (an error from 500 on, as
    OpenTelemetry's HTTP conventions have it for a server), and its end."""
    if span.is_recording():
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
    span.end()


def record_timing(span: trace.Span, timing) -> None:
    """The reply's ServerTiming (protobuf) on the call's span."""
    if span.is_recording():
        span.set_attributes({
            "specdec.server.queue_s": timing.queue_s,
            "specdec.server.compute_s": timing.compute_s,
            "specdec.server.copy_s": timing.copy_s,
            "specdec.server.computed_tokens": timing.computed_tokens,
        })


@functools.lru_cache(maxsize=64)
def _rpc_attributes(full_method: str) -> Mapping[str, object] | None:
    service, _, method = full_method.lstrip("/").partition("/")
    if service in UNTRACED_SERVICES:
        return None
    return types.MappingProxyType({"rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                                   "rpc.grpc.status_code": grpc.StatusCode.OK.value[0]})


@functools.lru_cache(maxsize=256)  # a service's callers are a few long-lived connections
def _peer_attributes(peer: str) -> Mapping[str, object]:
    """``ipv4:10.0.0.7:51234`` / ``ipv6:%5B::1%5D:51234`` as ``net.peer.ip`` and
    ``net.peer.port``; nothing for other transports (``unix:``)."""
    kind, _, address = peer.partition(":")
    host, _, port = address.rpartition(":")
    if kind not in ("ipv4", "ipv6") or not port.isdigit():
        return types.MappingProxyType({})
    return types.MappingProxyType({"net.peer.ip": urllib.parse.unquote(host).strip("[]"), "net.peer.port": int(port)})
