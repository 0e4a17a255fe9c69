"""The observability parts of the manifests fit together: the services' spans
reach the collector's OTLP receiver, which forwards them to a trace backend
that exists; Prometheus (by pod annotations, or the ServiceMonitor) scrapes
each specdec pod on the port its metrics are served on; the dashboard and the
scrape configuration are ConfigMaps generated from deploy/'s own files."""

from __future__ import annotations

import re

import yaml

import kube

DASHBOARD = kube.DEPLOY / "grafana" / "specdec-dashboard.json"
PROMETHEUS = kube.DEPLOY / "prometheus" / "prometheus.yml"



def test_dashboard_and_scrape_configuration_are_generated_from_deploy_files(objects):
    (dashboard,) = [c for c in kube.of_kind(objects, "ConfigMap")
                    if c["metadata"].get("labels", {}).get("grafana_dashboard") == "1"]
    assert dashboard["data"] == {DASHBOARD.name: DASHBOARD.read_text()}
    (scrape,) = [c for c in kube.of_kind(objects, "ConfigMap") if PROMETHEUS.name in c.get("data", {})]
    assert scrape["data"][PROMETHEUS.name] == PROMETHEUS.read_text()
    assert not list(kube.KUBERNETES.rglob("*.json")), "no copy of the dashboard under deploy/kubernetes"


def merged(*configs: dict) -> dict:
    """Collector configuration files merged as the collector merges them (maps
    deeply, anything else replaced)."""
    out: dict = {}
    for config in configs:
        for key, value in config.items():
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merged(out[key], value) if both else value
    return out


def collector_config(objects) -> tuple[dict, dict]:
    """The collector's container and its configuration, from the files its
    --config arguments name in the ConfigMap mounted there."""
    workload = kube.named(objects, "Deployment", "otel-collector")
    (container,) = kube.pod_template(workload)["spec"]["containers"]
    volumes = {v["name"]: v for v in kube.pod_template(workload)["spec"]["volumes"]}
    files = []
    for arg in container["args"]:
        path = arg.removeprefix("--config=")
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        data = kube.named(objects, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])["data"]
        files.append(yaml.safe_load(data[path.removeprefix(mount["mountPath"] + "/")]))
    return container, merged(*files)


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_the_services_spans_reach_the_collector_and_go_on_to_a_backend(objects):
    container, config = collector_config(objects)
    for sc in kube.specdec_containers(objects):
        assert sc.env["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc", sc.name
        (address,) = kube.addresses(sc.env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        service = kube.service_host(objects, address["host"])
        _, backend, port = kube.service_backend(objects, service, int(address["port"]))
        assert backend is container, f"{sc.name} sends its spans to {address[0]}"
        assert port_of(config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]) == port
    traces = config["service"]["pipelines"]["traces"]
    assert "otlp" in traces["receivers"] and traces["exporters"]
    for name in traces["exporters"]:
        endpoint = config["exporters"][name].get("endpoint")
        if endpoint is not None:  # an OTLP exporter: a backend the manifests run
            (address,) = kube.addresses(endpoint)
            kube.service_backend(objects, kube.service_host(objects, address["host"]), int(address["port"]))
    health = port_of(config["extensions"]["health_check"]["endpoint"])
    assert kube.container_port(container, container["readinessProbe"]["httpGet"]["port"]) == health


def test_the_cpu_overlay_forwards_traces_to_jaeger():
    _, config = collector_config(kube.render(kube.OVERLAYS["cpu"]))
    (exporter,) = config["service"]["pipelines"]["traces"]["exporters"]
    assert exporter.startswith("otlp") and config["exporters"][exporter]["endpoint"].startswith("jaeger:")


def relabel(rules: list[dict], labels: dict[str, str]) -> dict[str, str] | None:
    """Prometheus relabelling (keep and replace) of a target's labels; None: dropped."""
    labels = dict(labels)
    for rule in rules:
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule["source_labels"])
        match = re.fullmatch(rule.get("regex", "(.*)"), value)
        if rule.get("action", "replace") == "keep":
            if not match:
                return None
        elif match:
            labels[rule["target_label"]] = match.expand(rule.get("replacement", "$1").replace("$", "\\"))
    return labels


def discovered(workload: dict) -> dict[str, str]:
    """The labels Prometheus' pod discovery gives a pod (its address on port 80)."""
    meta = kube.pod_template(workload)["metadata"]
    clean = lambda name: re.sub(r"[^a-zA-Z0-9_]", "_", name)  # noqa: E731
    labels = {f"__meta_kubernetes_pod_label_{clean(k)}": v for k, v in meta.get("labels", {}).items()}
    labels |= {f"__meta_kubernetes_pod_annotation_{clean(k)}": v for k, v in meta.get("annotations", {}).items()}
    return labels | {"__address__": "10.0.0.1:80", "__meta_kubernetes_pod_name": workload["metadata"]["name"]}


def test_prometheus_scrapes_each_specdec_pod_on_its_metrics_port(objects):
    (job,) = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    scraped = {w["metadata"]["name"]: relabel(job["relabel_configs"], discovered(w)) for w in kube.workloads(objects)}
    for sc in kube.specdec_containers(objects):
        target = scraped.pop(sc.name)
        assert target is not None, f"{sc.name} is not scraped"
        assert target["__address__"] == f"10.0.0.1:{sc.config().metrics_port}" and target["component"] == sc.role
    assert not any(scraped.values()), "only specdec pods serve specdec metrics"


def test_the_service_monitor_scrapes_every_specdec_service_on_its_metrics_port():
    objects = kube.renders()["gpu+components"]
    (monitor,) = kube.of_kind(objects, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    services = [s for s in kube.of_kind(objects, "Service") if kube.matches(monitor["spec"]["selector"],
                                                                              s["metadata"]["labels"])]
    roles = kube.by_role(objects)
    assert len(services) == len(roles)
    for service in services:
        (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        workload, _, container_port = kube.service_backend(objects, service, port)
        (sc,) = [sc for sc in roles.values() if sc.workload is workload]
        assert container_port == sc.config().metrics_port
    drops = [r for r in endpoint["relabelings"] if r.get("action") == "labeldrop"]
    assert [r["regex"] for r in drops] == ["service"], "the model services' own `service` label must survive"
