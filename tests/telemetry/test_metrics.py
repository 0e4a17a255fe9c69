"""Each service's Prometheus metrics: served over HTTP, one registry per service."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from specdec.serving.sessions import StoreStats
from specdec.telemetry.metrics import CoordinatorMetrics, MetricsServer, ServiceMetrics


def _sample(text: str, name: str, **labels) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    raise KeyError(name, labels)


def test_service_metrics_are_served_over_http():
    stats = StoreStats(active_sessions=3, cached_tokens=120, evictions=2, expirations=1, created=6)
    metrics = ServiceMetrics("target", sessions=lambda: stats)
    metrics.observe_verified(drafts=4, accepted=3)
    metrics.observe_rpc("Verify", 0.01, None)
    metrics.observe_rpc("Verify", 0.01, "NOT_FOUND")
    server = MetricsServer(metrics.registry, 0, "127.0.0.1")
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
    finally:
        server.close()
    assert _sample(text, "specdec_active_sessions", service="target") == 3
    assert _sample(text, "specdec_cached_kv_tokens", service="target") == 120
    assert _sample(text, "specdec_session_evictions_total", service="target") == 2
    assert _sample(text, "specdec_target_verified_draft_tokens_total", service="target") == 4
    assert _sample(text, "specdec_target_accepted_tokens_total", service="target") == 3
    assert _sample(text, "specdec_rpc_errors_total", service="target", method="Verify", code="NOT_FOUND") == 1
    assert _sample(text, "specdec_rpc_server_duration_seconds_count", service="target", method="Verify") == 2


def test_separate_services_keep_separate_registries():
    a, b = CoordinatorMetrics(), CoordinatorMetrics()
    a.observe_round(gamma=3, accepted=3, wall_s=0.01, phases={})
    assert a.registry.get_sample_value("specdec_spec_decode_num_draft_tokens_total") == 3
    assert b.registry.get_sample_value("specdec_spec_decode_num_draft_tokens_total") == 0
