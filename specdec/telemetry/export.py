"""Exporting spans without holding up a stopping service or flooding its log.

When the collector cannot be reached, the SDK's OTLP exporters retry each
batch for up to ``OTEL_EXPORTER_OTLP_TIMEOUT`` (10 s) and log every attempt.
Here their messages are let through once a minute per kind (the next one says
how many were held back), and at exit the last spans get ``EXIT_FLUSH_S`` to
reach the collector before the retries are cut short (the trace file is
written in full).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace.export import SpanExportResult

log = logging.getLogger(__name__)

EXIT_FLUSH_S = 3.0  # at exit, how long unexported spans may take before retries are cut short
EXPORT_LOG_INTERVAL_S = 60.0  # the OTLP exporters' messages: at most one per kind per interval
# Where the OTLP exporters (gRPC; HTTP and its client) log failed exports.
OTLP_LOGGERS = ("opentelemetry.exporter.otlp.proto.grpc.exporter",
                "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                "opentelemetry.exporter.otlp.common.http")


class StoppableExporter:
    """An OTLP span exporter whose shutdown can come early and only once: at
    exit it cuts short the retries of an export to an unreachable collector,
    after which further batches are dropped at once, without a warning each."""

    def __init__(self, inner):
        self.inner = inner
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # the exit timer and the batch thread may both stop it

    def export(self, spans: Sequence):
        if self.stopped.is_set():
            return SpanExportResult.FAILURE
        return self.inner.export(spans)

    def shutdown(self) -> None:
        with self.lock:
            if self.stopped.is_set():
                return
            self.stopped.set()
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
        self.last_seen: dict[tuple[str, int], float] = {}
        self.held_back: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno)
        with self.lock:
            now, last = self.clock(), self.last_seen.get(key)
            if last is not None and now - last < self.interval_s:
                self.held_back[key] = self.held_back.get(key, 0) + 1
                return False
            self.last_seen[key] = now
            held = self.held_back.pop(key, 0)
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
