"""A collector that cannot be reached must not hold up a stopping service nor
flood its log: at exit the last spans get EXIT_FLUSH_S, then the exporters'
retries are cut short; their messages come at most once a minute per kind."""

import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specdec.telemetry import export


class StuckExporter:
    """Like the OTLP exporter retrying to an unreachable collector: an export
    returns only when the exporter is shut down."""

    def __init__(self):
        self.stopped = threading.Event()
        self.exports = self.shutdowns = 0

    def export(self, spans):
        self.exports += 1
        self.stopped.wait(30)
        return SpanExportResult.FAILURE

    def shutdown(self):
        self.shutdowns += 1
        self.stopped.set()

    def force_flush(self, timeout_millis=30000):
        return True


def exit_with(inner, spans: int, flush_s: float, caplog, local=None) -> float:
    """Spans through batch processors into ``local`` (a trace file, say) and the
    remote ``inner``, in that order as setup_tracing adds them, then the exit;
    its seconds."""
    exporter = export.StoppableExporter(inner)
    provider = TracerProvider(shutdown_on_exit=False)
    if local is not None:
        provider.add_span_processor(BatchSpanProcessor(local))
    provider.add_span_processor(BatchSpanProcessor(exporter, max_export_batch_size=1))
    for _ in range(spans):
        provider.get_tracer("t").start_span("s").end()
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="specdec.telemetry.export"):
        export.shutdown_tracing(provider, [exporter], flush_s=flush_s)
    return time.monotonic() - start


def test_exit_cuts_retries_short_after_the_flush_time(caplog):
    inner, trace_file = StuckExporter(), InMemorySpanExporter()
    assert 0.3 <= exit_with(inner, 3, 0.3, caplog, local=trace_file) < 3
    # The stuck export was cut short; the rest were dropped without reaching it.
    assert inner.exports == 1 and inner.shutdowns == 1
    assert "did not finish within" in caplog.text
    assert len(trace_file.get_finished_spans()) == 3  # the local exporter is not cut short


def test_exit_does_not_wait_for_an_export_that_cannot_be_cut_short(caplog):
    """An HTTP request already sent to a silent collector ignores shutdown."""

    class Deaf(StuckExporter):
        def export(self, spans):
            self.exports += 1
            time.sleep(30)

    assert exit_with(Deaf(), 1, 0.3, caplog) < 3
    assert "did not finish within" in caplog.text


def test_exit_exports_everything_when_the_collector_answers(caplog):
    inner = InMemorySpanExporter()
    exit_with(inner, 5, 5, caplog)
    assert len(inner.get_finished_spans()) == 5
    assert caplog.text == ""


def test_export_messages_are_let_through_once_a_minute_per_kind():
    now = [0.0]
    limit = export.RateLimitFilter(60, clock=lambda: now[0])

    def record(level=logging.WARNING, name="opentelemetry.exporter.otlp.proto.grpc.exporter"):
        return logging.LogRecord(name, level, __file__, 1, "Transient error %s", ("UNAVAILABLE",), None)

    assert limit.filter(record())
    assert limit.filter(record(logging.ERROR))  # another kind
    held = [record() for _ in range(4)]
    for t, r in zip((5, 10, 20, 59), held, strict=True):
        now[0] = t
        assert not limit.filter(r)
    now[0] = 61
    shown = record()
    assert limit.filter(shown)
    assert shown.getMessage() == "Transient error UNAVAILABLE (4 more like this in the last 61 s not shown)"
    now[0] = 70
    assert not limit.filter(record())


def test_a_service_process_exits_promptly_with_its_collector_down():
    """The real OTLP/gRPC exporter, pointed at a port nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again below: connections are refused
    script = textwrap.dedent(f"""
        import logging, time
        logging.basicConfig(level=logging.INFO)
        from specdec.telemetry import export, tracing
        tracing.setup_tracing("specdec-test", environ={{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:{port}"}})
        for _ in range(20):
            tracing.tracer().start_span("s").end()
        print("EXITING", time.monotonic(), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    exited = time.monotonic()
    assert done.returncode == 0, done.stderr
    started_exit = float(done.stdout.split("EXITING", 1)[1].split()[0])
    assert exited - started_exit < export.EXIT_FLUSH_S + 4, done.stderr  # the SDK's own exit: ~10 s
    exporter_lines = [line for line in done.stderr.splitlines() if "opentelemetry.exporter" in line]
    assert len(exporter_lines) <= 2, done.stderr
