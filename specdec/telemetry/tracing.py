"""Traces on the standard OpenTelemetry SDK: the tracer provider a service
process installs at start, chosen by the standard ``OTEL_*`` environment and
one file flag. W3C trace context crosses gRPC in each call's metadata
(:mod:`specdec.telemetry.calls` writes it, :mod:`specdec.telemetry.server_spans`
reads it), so one Generate is one trace across the three services.

* ``OTEL_TRACES_EXPORTER`` = ``otlp`` | ``console`` | ``none`` (comma-separated
  list allowed). Unset: ``otlp`` if an OTLP endpoint is set, else nothing.
* ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` and
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``..._TRACES_PROTOCOL`` = ``grpc`` (default) |
  ``http/protobuf``: the SDK's OTLP exporters, which read the rest (headers,
  timeouts, TLS) themselves.
* ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG``: the SDK's samplers. In
  production, ``parentbased_traceidratio`` with a ratio such as ``0.05``: the
  coordinator's root span decides, and every span below it (rounds, RPCs, the
  services' spans) follows that decision, so a trace is whole or absent.
* ``OTEL_BSP_*``: the SDK's batch span processor (queue size, schedule).
* ``OTEL_SERVICE_NAME`` overrides the service's own name (``specdec-draft`` ...).
* ``OTEL_SDK_DISABLED=true`` turns everything off, the trace file included.
* Values this build does not know (an exporter such as ``zipkin``, a protocol
  such as ``http/json``) are ignored with a warning, as the spec asks.
* ``--trace-file PATH`` / ``SPECDEC_TRACE_FILE``: every finished span as one JSON
  line (:mod:`specdec.telemetry.trace_file`), read by ``specdec trace-report``.

Nothing is installed when nothing is configured: the OpenTelemetry API then
hands out its no-op tracer, and tracing that is off costs nothing measurable.
"""

from __future__ import annotations

import atexit
import logging
import os
from collections.abc import Mapping

from opentelemetry import trace

from specdec.telemetry.export import StoppableExporter, limit_export_logs, shutdown_tracing
from specdec.telemetry.trace_file import JsonLinesSpanExporter

log = logging.getLogger(__name__)

TRACER_NAME = "specdec"
SUPPORTED_EXPORTERS = ("otlp", "console")


_tracer_of: tuple[object, trace.Tracer] | None = None  # (provider, its tracer)


def tracer() -> trace.Tracer:
    """specdec's tracer from the provider installed now. Kept per provider: the
    SDK builds a new Tracer on every ``get_tracer`` call (~10 µs, three per
    round otherwise)."""
    global _tracer_of
    provider = trace.get_tracer_provider()
    cached = _tracer_of
    if cached is None or cached[0] is not provider:
        cached = _tracer_of = (provider, trace.get_tracer(TRACER_NAME))
    return cached[1]


def enabled() -> bool:
    """Whether a real tracer provider is installed in this process (by
    :func:`setup_tracing` or by anything else, e.g. ``opentelemetry-instrument``)."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def recording() -> bool:
    """Whether spans made now would be recorded: a real provider is installed
    and the current span, if there is one, is recorded. Below a span the
    sampler dropped, specdec makes no spans of its own and only passes the
    decision on (in the W3C context it sends), as parent-based sampling would
    decide anyway: at a production sampling ratio the unsampled requests, nearly
    all of them, then cost next to nothing."""
    if not enabled():
        return False
    current = trace.get_current_span()
    return current.is_recording() or not current.get_span_context().is_valid


def sdk_disabled(environ: Mapping[str, str]) -> bool:
    return environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


def exporter_names(environ: Mapping[str, str]) -> list[str]:
    """The span exporters the environment asks for (``otlp``, ``console``).
    Names this build does not support are ignored with a warning, as the
    OpenTelemetry configuration spec asks (a typo must not stop a server)."""
    if sdk_disabled(environ):
        return []
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not raw:
        # The SDK's own default is "otlp" always; here an endpoint must say so, so
        # that a bare service sends nothing anywhere (and costs nothing).
        return ["otlp"] if _otlp_endpoint(environ) else []
    names = [n.strip() for n in raw.split(",") if n.strip() and n.strip() != "none"]
    for name in names:
        if name not in SUPPORTED_EXPORTERS:
            log.warning("OTEL_TRACES_EXPORTER=%s: exporter %r is not supported (use otlp, console or none); "
                        "ignored", raw, name)
    return [n for n in names if n in SUPPORTED_EXPORTERS]


def _otlp_endpoint(environ: Mapping[str, str]) -> str | None:
    return environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")


def _otlp_protocol(environ: Mapping[str, str], warn: bool = True) -> str:
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol not in ("grpc", "http/protobuf"):
        if warn:
            log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported (use grpc or http/protobuf); using grpc",
                        protocol)
        return "grpc"
    return protocol


def _otlp_description(environ: Mapping[str, str]) -> str:
    """What the startup log says of the OTLP exporter (already made, and warned
    about): protocol and endpoint."""
    endpoint = _otlp_endpoint(environ) or "the default endpoint on localhost"
    return f"otlp ({_otlp_protocol(environ, warn=False)}, {endpoint})"


def otlp_exporter(environ: Mapping[str, str]):
    if _otlp_protocol(environ) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    return OTLPSpanExporter()


def setup_tracing(service_name: str, trace_file: str | os.PathLike | None = None,
                  environ: Mapping[str, str] | None = None):
    """Install a tracer provider for this process if the environment or
    ``trace_file`` asks for any exporter; return it (None: tracing stays off).

    Call once, at process start (OpenTelemetry allows one global provider). Spans
    are exported in batches on a background thread and flushed at exit.

    ``environ`` decides *which* exporters (and the file); the OTLP exporters
    read their own settings (endpoint, headers, timeout, TLS) from
    ``os.environ``, as the SDK does."""
    environ = os.environ if environ is None else environ
    if sdk_disabled(environ):
        if trace_file:
            log.warning("OTEL_SDK_DISABLED=true: tracing is off, %s is not written", trace_file)
        return None
    names = exporter_names(environ)
    if not names and not trace_file:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or service_name})
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # shutdown_tracing instead
    # Local exporters first: at exit they are flushed before the OTLP one, the
    # only one that can stall (on a collector), and the only one cut short.
    local = [ConsoleSpanExporter()] if "console" in names else []
    if trace_file:
        local.append(JsonLinesSpanExporter(trace_file))
    remote = [StoppableExporter(otlp_exporter(environ))] if "otlp" in names else []
    for exporter in local + remote:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if remote:
        limit_export_logs()
    atexit.register(shutdown_tracing, provider, remote)
    trace.set_tracer_provider(provider)
    log.info("tracing %s to %s, sampler %s", resource.attributes.get("service.name"),
             ", ".join([_otlp_description(environ) if n == "otlp" else n for n in names]
                       + ([f"file {trace_file}"] if trace_file else [])), provider.sampler.get_description())
    return provider
