"""Traces (DESIGN §5): the tracer provider, the JSON-lines file exporter and
the generation span. W3C trace context crosses gRPC in each call's metadata:
:class:`specdec.telemetry.observe.ClientCalls` writes it, and each server's
:class:`specdec.telemetry.observe.ServerObserver` reads it for its SERVER span.

Configuration is the standard OpenTelemetry environment, plus one file flag:

* ``OTEL_TRACES_EXPORTER`` = ``otlp`` | ``console`` | ``none`` (comma-separated
  list allowed). Unset: ``otlp`` if an OTLP endpoint is set, else nothing.
* ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` and
  ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``..._TRACES_PROTOCOL`` = ``grpc`` (default) |
  ``http/protobuf``; the exporters read the rest (headers, timeouts) themselves.
* ``OTEL_SERVICE_NAME`` overrides the service's own name (``specdec-draft`` ...).
* ``OTEL_SDK_DISABLED=true`` turns everything off, the trace file included.
* Values this build does not know (an exporter such as ``zipkin``, a protocol
  such as ``http/json``) are ignored with a warning, as the spec asks.
* ``--trace-file PATH`` / ``SPECDEC_TRACE_FILE``: every finished span as one JSON
  line, appended (several processes may share a file); ``specdec trace-report``
  reads it.

When the collector cannot be reached, the OTLP exporters retry each batch for
up to ``OTEL_EXPORTER_OTLP_TIMEOUT`` (10 s) and log every attempt. Here their
messages are let through once a minute per kind (the next one says how many
were held back), and at exit the last spans get ``EXIT_FLUSH_S`` to reach the
collector before the retries are cut short (the trace file is written in
full), so a stopping service is not held up.

Why nothing is installed when nothing is configured: the OpenTelemetry API then
hands out its no-op tracer, whose spans cost well under a microsecond, and the
services install no interceptor for it — tracing that is off costs
nothing measurable.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import threading
import time
from typing import Iterator, Mapping, Sequence

from opentelemetry import trace

log = logging.getLogger(__name__)

TRACER_NAME = "specdec"
TRACE_FILE_ENV = "SPECDEC_TRACE_FILE"
SUPPORTED_EXPORTERS = ("otlp", "console")
EXIT_FLUSH_S = 3.0  # at exit, how long unexported spans may take before retries are cut short
EXPORT_LOG_INTERVAL_S = 60.0  # the OTLP exporters' messages: at most one per kind per interval
# Where the OTLP exporters (gRPC; HTTP and its client; specdec's encoder) log
# failed exports and spans they cannot encode.
OTLP_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                "opentelemetry.exporter.otlp.common.http",
                "specdec.telemetry.otlp_encode")

# gen_ai.* semantic-convention attribute names (GenAI semconv, incubating).
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_TOP_K = "gen_ai.request.top_k"
GEN_AI_SEED = "gen_ai.request.seed"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_CONVERSATION = "gen_ai.conversation.id"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"


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


# ---------------------------------------------------------------- provider setup


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


def _otlp_exporter(environ: Mapping[str, str]):
    if _otlp_protocol(environ) == "grpc":  # the SDK's exporter, with a faster encoder (same message)
        from specdec.telemetry.otlp_encode import OTLPSpanExporter
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
    trace_file = trace_file or environ.get(TRACE_FILE_ENV) or None
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
    remote = [StoppableExporter(_otlp_exporter(environ))] if "otlp" in names else []
    for exporter in local + remote:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if remote:
        limit_export_logs()
    atexit.register(shutdown_tracing, provider, remote)
    trace.set_tracer_provider(provider)
    log.info("tracing %s to %s", resource.attributes.get("service.name"),
             ", ".join([_otlp_description(environ) if n == "otlp" else n for n in names]
                       + ([f"file {trace_file}"] if trace_file else [])))
    return provider


# ---------------------------------------------------------------- exit and export failures


class StoppableExporter:
    """An OTLP span exporter whose shutdown can come early and only once: at
    exit it cuts short the retries of an export to an unreachable collector,
    after which further batches are dropped at once, without a warning each."""

    def __init__(self, inner):
        self.inner = inner
        self._stopped = threading.Event()
        self._lock = threading.Lock()  # the exit timer and the batch thread may both stop it

    def export(self, spans: Sequence):
        from opentelemetry.sdk.trace.export import SpanExportResult

        if self._stopped.is_set():
            return SpanExportResult.FAILURE
        return self.inner.export(spans)

    def shutdown(self) -> None:
        with self._lock:
            if self._stopped.is_set():
                return
            self._stopped.set()
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def shutdown_tracing(provider, remote: Sequence[StoppableExporter], flush_s: float = EXIT_FLUSH_S) -> None:
    """Export what is left, giving the ``remote`` exporters at most ``flush_s``;
    then cut their retries short. The SDK's own exit hook would wait out every
    retry (the batch processor's flush ignores its timeout), and an HTTP request
    already sent to a silent collector cannot be cut at all: the shutdown runs
    on a daemon thread that exit does not wait for beyond ``flush_s`` + 1 s."""
    stopper = threading.Timer(flush_s, lambda: [e.shutdown() for e in remote])
    stopper.daemon = True
    stopper.start()
    start = time.monotonic()
    worker = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    worker.start()
    worker.join(flush_s + 1.0)
    stopper.cancel()
    if worker.is_alive() or time.monotonic() - start >= flush_s:
        log.warning("trace export did not finish within %.0f s at exit; the spans not yet exported are dropped",
                    flush_s)


class RateLimitFilter(logging.Filter):
    """Lets one record of each (logger, level) through per ``interval_s``; the
    next one let through says how many were held back meanwhile."""

    def __init__(self, interval_s: float = EXPORT_LOG_INTERVAL_S, clock=time.monotonic):
        super().__init__()
        self.interval_s, self.clock = interval_s, clock
        self._last: dict[tuple[str, int], float] = {}
        self._held: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno)
        with self._lock:
            now, last = self.clock(), self._last.get(key)
            if last is not None and now - last < self.interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
        if held:
            record.msg = f"{record.msg} ({held} more like this in the last {now - last:.0f} s not shown)"
        return True


_export_log_filter = RateLimitFilter()


def limit_export_logs() -> None:
    """Rate-limit the OTLP exporters' messages (each failed export logs a warning
    per retry and an error, every few seconds while a collector is down)."""
    for name in OTLP_LOGGERS:
        logger = logging.getLogger(name)
        if _export_log_filter not in logger.filters:
            logger.addFilter(_export_log_filter)


# ---------------------------------------------------------------- the file exporter


def span_to_dict(span) -> dict:
    """A finished SDK span as the flat JSON object of a trace-file line."""
    ctx, parent = span.get_span_context(), span.parent
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "name": span.name,
        "kind": span.kind.name,
        "service": span.resource.attributes.get("service.name", ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": {k: _jsonable(v) for k, v in (span.attributes or {}).items()},
        "events": [{"name": e.name, "attributes": {k: _jsonable(v) for k, v in (e.attributes or {}).items()}}
                   for e in span.events],
    }


def _jsonable(value):
    return list(value) if isinstance(value, tuple) else value


class JsonLinesSpanExporter:
    """Appends each finished span as one JSON line to a file.

    A batch is written with a single ``write`` on a file opened in append mode,
    so processes sharing one file do not interleave inside a line."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()

    def export(self, spans: Sequence) -> "SpanExportResult":
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self._lock:
            if self._fd < 0:
                return SpanExportResult.FAILURE
            os.write(self._fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def read_spans(paths: Sequence[str | os.PathLike]) -> list[dict]:
    """Every span of one or more trace files, each once (files may overlap);
    lines that are not JSON are skipped with a warning (a process killed
    mid-write may leave half a line)."""
    spans, seen = [], set()
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    span = json.loads(line)
                    key = (span["trace_id"], span["span_id"])
                except (json.JSONDecodeError, TypeError, KeyError):
                    log.warning("%s:%d is not a JSON span; skipped", path, n)
                    continue
                if key not in seen:
                    seen.add(key)
                    spans.append(span)
    return spans


# ---------------------------------------------------------------- the generation span


@contextlib.contextmanager
def generation_span(*, model: str, max_tokens: int, temperature: float, input_tokens: int,
                    conversation_id: str, operation: str = "text_completion",
                    extra: Mapping[str, object] | None = None) -> Iterator[trace.Span]:
    """The span of one Generate, named and attributed per the GenAI semantic
    conventions (``{operation} {model}``); every round span is its child.
    Set the output with :func:`record_usage`."""
    attributes = {
        GEN_AI_OPERATION: operation,
        GEN_AI_PROVIDER: "specdec",
        GEN_AI_REQUEST_MODEL: model,
        GEN_AI_MAX_TOKENS: max_tokens,
        GEN_AI_TEMPERATURE: temperature,
        GEN_AI_INPUT_TOKENS: input_tokens,
        GEN_AI_CONVERSATION: conversation_id,
        **(extra or {}),
    }
    with tracer().start_as_current_span(f"{operation} {model}", attributes=attributes) as span:
        yield span


def record_usage(span: trace.Span, *, output_tokens: int, finish_reason: str, **extra) -> None:
    span.set_attribute(GEN_AI_OUTPUT_TOKENS, output_tokens)
    span.set_attribute(GEN_AI_FINISH_REASONS, [finish_reason])
    for key, value in extra.items():
        span.set_attribute(key, value)
