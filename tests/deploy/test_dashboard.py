"""The Grafana dashboard and Prometheus scrape config in deploy/ stay true to
the metrics the code exports: every PromQL expression names only metrics that
specdec/telemetry/metrics.py registers (with the right suffixes) and labels they carry."""

from __future__ import annotations

import json
import pathlib
import re
import types

import yaml
from prometheus_client import CollectorRegistry

from specdec.serving.sessions import StoreStats
from specdec.telemetry.metrics import CoordinatorMetrics, ServiceMetrics

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "specdec-dashboard.json"
PROMETHEUS = DEPLOY / "prometheus" / "prometheus.yml"
PROMETHEUS_LOCAL = DEPLOY / "prometheus" / "prometheus-local.yml"


def exported() -> dict[str, set[str]]:
    """Every sample name the services export after some work -> its labels."""
    from specdec.serving.scheduler import PassStats
    from specdec.serving.timing import ServerTiming
    from specdec.telemetry.metrics import ROUND_PHASES

    stats = StoreStats(active_sessions=1, cached_tokens=1, evictions=0, expirations=0, created=1,
                       budget_tokens=10, refusals=0)
    coordinator, service = CoordinatorMetrics(), ServiceMetrics("target", sessions=lambda: stats)
    coordinator.observe_round(gamma=2, accepted=1, wall_s=0.01, phases=dict.fromkeys(ROUND_PHASES, 0.001))
    coordinator.observe_call("draft", 0.001, 10, 10)
    coordinator.observe_request(prompt_tokens=3, finish_reason="length")
    for m in (coordinator, service):
        m.observe_rpc("Verify", 0.01, "NOT_FOUND")
    service.observe_timing(ServerTiming(0.1, 0.1, 0.1, 3))
    service.observe_proposed(2)
    service.observe_verified(2, 1)
    service.observe_draft_ahead(made=2, reused=1)
    service.observe_pass(PassStats(sequences=4, tokens=8, seconds=0.01))
    service.observe_queue_wait(0.001)
    coordinator.directory.labels("read").observe(0.001)  # (the Redis directory's)
    coordinator.directory_errors.labels("read").inc()
    coordinator.pins.labels("draft", "gone").inc()
    coordinator.failovers.labels("target").inc()
    coordinator.prefills.labels("target", "moved").inc()
    replica = types.SimpleNamespace(address="t:1", load=1, healthy=True)
    coordinator.watch_replicas(lambda: {"target": [replica]})
    names: dict[str, set[str]] = {}
    for registry in (coordinator.registry, service.registry):
        assert isinstance(registry, CollectorRegistry)
        for family in registry.collect():
            for sample in family.samples:
                names.setdefault(sample.name, set()).update(sample.labels)
    return names


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))  # collapsed rows
    return out


def expressions() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in panels(dashboard) for t in p.get("targets", [])]


def test_every_panel_queries_only_exported_metrics_and_labels():
    names = exported()
    exprs = expressions()
    assert exprs
    for title, expr in exprs:
        used = set(re.findall(r"\bspecdec_[a-zA-Z0-9_]+", expr))
        assert used, f"panel {title!r} queries no specdec metric: {expr}"
        for metric in used:
            assert metric in names, f"panel {title!r} uses {metric}, which specdec does not export"
        # label matchers and by/without clauses must name labels the metrics carry
        labels = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", expr))
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
            labels |= {x.strip() for x in group.split(",") if x.strip()}
        carried = set().union(*(names[m] for m in used))
        assert labels <= carried, f"panel {title!r} uses labels {labels - carried} that {sorted(used)} lack"


def test_dashboard_covers_what_operators_ask_for():
    titles = {p["title"].lower() for p in panels(json.loads(DASHBOARD.read_text()))}
    for want in ("acceptance rate", "mean acceptance length", "acceptance by draft position", "γ over time",
                 "tokens / s", "share of round time crossing devices"):
        assert any(want in t for t in titles), f"no panel about {want!r}"
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert any(v["type"] == "datasource" for v in dashboard["templating"]["list"])


def test_prometheus_scrapes_the_three_services():
    """On one machine: the ports ``specdec serve --metrics-port 9464`` gives each
    role. In Kubernetes: every annotated specdec pod, once (no static job
    beside it, which would count each sample twice)."""
    from specdec.cli.serve import METRICS_PORT_OFFSETS

    local = yaml.safe_load(PROMETHEUS_LOCAL.read_text())
    jobs = {job["job_name"]: job for job in local["scrape_configs"]}
    assert set(jobs) == {f"specdec-{role}" for role in METRICS_PORT_OFFSETS}
    for role, offset in METRICS_PORT_OFFSETS.items():
        (static,) = jobs[f"specdec-{role}"]["static_configs"]
        assert static["targets"] == [f"localhost:{9464 + offset}"]
        # a target label named like a metric label would be renamed exported_<label>
        assert static["labels"] == {"component": role}

    (pods,) = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    assert pods["kubernetes_sd_configs"] == [{"role": "pod"}]
    relabel = {r.get("target_label"): r for r in pods["relabel_configs"]}
    assert relabel["component"]["source_labels"] == ["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
    assert "service" not in relabel
