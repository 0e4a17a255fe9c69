"""The ``--trace-file`` exporter: every finished span as one JSON line, and the
reader ``specdec trace-report`` uses."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence

from opentelemetry.sdk.trace.export import SpanExportResult

log = logging.getLogger(__name__)


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
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.lock = threading.Lock()

    def export(self, spans: Sequence) -> SpanExportResult:
        data = "".join(json.dumps(span_to_dict(s), separators=(",", ":")) + "\n" for s in spans).encode()
        with self.lock:
            if self.fd < 0:
                return SpanExportResult.FAILURE
            os.write(self.fd, data)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self.lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1

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
