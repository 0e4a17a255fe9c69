"""A service process's telemetry: tracing (process-wide, installed once at
start from the ``OTEL_*`` variables and ``--trace-file``), its metrics
registry and the ``/metrics`` endpoint (``--metrics-port``)."""

from __future__ import annotations

from specdec.telemetry import tracing
from specdec.telemetry.metrics import CoordinatorMetrics, MetricsServer, ServiceMetrics


class ServiceTelemetry:
    """What a service reports to: ``metrics`` (None when no port will serve
    them) and the endpoint serving them."""

    def __init__(self, role: str, metrics: CoordinatorMetrics | ServiceMetrics | None = None,
                 metrics_port: int = 0):
        self.role = role
        self.metrics = metrics
        self.metrics_port = metrics_port
        self.metrics_server: MetricsServer | None = None

    @classmethod
    def for_role(cls, role: str, metrics_port: int = 0) -> ServiceTelemetry:
        """Metrics objects only when a port will serve them."""
        metrics = None
        if metrics_port:
            metrics = CoordinatorMetrics() if role == "coordinator" else ServiceMetrics(role)
        return cls(role, metrics, metrics_port)

    def serve_metrics(self, host: str = "0.0.0.0", sessions=None) -> int | None:
        """Start ``/metrics`` if a port was given; ``sessions`` returns the
        session store's stats (model services). Returns the port."""
        if self.metrics is None or not self.metrics_port:
            return None
        if sessions is not None and isinstance(self.metrics, ServiceMetrics):
            self.metrics.watch_sessions(sessions)
        self.metrics_server = MetricsServer(self.metrics.registry, self.metrics_port, host)
        return self.metrics_server.port

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None


def start_telemetry(role: str, trace_file: str | None = None, metrics_port: int = 0) -> ServiceTelemetry:
    """At process start: tracing from ``trace_file`` and the ``OTEL_*``
    variables, and metrics objects when ``metrics_port`` will serve them."""
    tracing.setup_tracing(f"specdec-{role}", trace_file)
    return ServiceTelemetry.for_role(role, metrics_port)
