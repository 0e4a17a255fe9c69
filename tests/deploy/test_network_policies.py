"""Who may reach whom, as the rendered NetworkPolicies decide it (ingress, as a
CNI enforces them): only the coordinator reaches the model services, clients
reach only the coordinator (its gRPC port and its OpenAI-compatible HTTP port),
only Prometheus reaches the metrics ports, and only the collector receives
telemetry."""

from __future__ import annotations

import kube

CLIENT = {"namespace": "clients", "labels": {"app": "client"}}
NEIGHBOUR = {"namespace": kube.NAMESPACE, "labels": {"app": "something-else"}}  # a pod beside specdec's
PROMETHEUS = {"namespace": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}}



def peer_matches(peer: dict, source: dict, namespace: str) -> bool:
    if "namespaceSelector" in peer:  # {} selects every namespace
        in_namespace = kube.matches(peer["namespaceSelector"], source.get("namespace_labels", {}))
    else:
        in_namespace = source["namespace"] == namespace
    return in_namespace and ("podSelector" not in peer or kube.matches(peer["podSelector"], source["labels"]))


def rule_allows(rule: dict, source: dict, namespace: str, port: tuple[str, int]) -> bool:
    ports_ok = not rule.get("ports") or any(p["port"] in port for p in rule["ports"])
    peers = rule.get("from")
    return ports_ok and (not peers or any(peer_matches(peer, source, namespace) for peer in peers))


def allowed(objects, source: dict, workload: dict, port_name: str) -> bool:
    """Whether ``source`` (a pod's namespace and labels) may open a connection to
    the named container port of ``workload``'s pods."""
    namespace, labels = workload["metadata"]["namespace"], kube.pod_labels(workload)
    (number,) = {kube.container_port(c, port_name) for c in kube.pod_template(workload)["spec"]["containers"]} - {None}
    policies = [p for p in kube.of_kind(objects, "NetworkPolicy") if p["metadata"]["namespace"] == namespace
                and "Ingress" in p["spec"]["policyTypes"] and kube.matches(p["spec"]["podSelector"], labels)]
    if not policies:
        return True
    return any(rule_allows(rule, source, namespace, (port_name, number))
               for p in policies for rule in p["spec"].get("ingress", []))


def pod(workload: dict) -> dict:
    return {"namespace": workload["metadata"]["namespace"], "labels": kube.pod_labels(workload)}


def ports(objects) -> list[tuple[dict, str]]:
    """(workload, port name) for every named port of every pod."""
    return [(w, p["name"]) for w, c in kube.containers(objects) for p in c.get("ports", [])]


def test_only_the_coordinator_reaches_the_model_services(objects):
    roles = kube.by_role(objects)
    for role in ("draft", "target"):
        model = roles[role].workload
        assert allowed(objects, pod(roles["coordinator"].workload), model, "grpc"), role
        others = [w for w in kube.workloads(objects) if w is not roles["coordinator"].workload]
        for source in [CLIENT, NEIGHBOUR, PROMETHEUS] + [pod(w) for w in others]:
            assert not allowed(objects, source, model, "grpc"), f"{source} reaches {role}"


def test_clients_reach_only_the_coordinators_grpc_and_http_ports(objects):
    coordinator = kube.by_role(objects)["coordinator"].workload
    open_to_clients = [(coordinator, "grpc"), (coordinator, "http")]  # gRPC, and the OpenAI-compatible API
    for source in (CLIENT, NEIGHBOUR):
        for workload, port in ports(objects):
            reached = allowed(objects, source, workload, port)
            assert reached == ((workload, port) in open_to_clients), f"{workload['metadata']['name']}:{port}"


def test_only_prometheus_reaches_the_metrics_ports(objects):
    for sc in kube.specdec_containers(objects):
        assert allowed(objects, PROMETHEUS, sc.workload, "metrics"), sc.name
        for source in [CLIENT, NEIGHBOUR] + [pod(w) for w in kube.workloads(objects)]:
            assert not allowed(objects, source, sc.workload, "metrics"), f"{source} reaches {sc.name}'s metrics"


def test_only_the_collector_receives_telemetry(objects):
    collector = kube.named(objects, "Deployment", "otel-collector")
    for sc in kube.specdec_containers(objects):
        assert allowed(objects, pod(sc.workload), collector, "otlp-grpc"), sc.name
    for source in (CLIENT, NEIGHBOUR, PROMETHEUS):
        assert not allowed(objects, source, collector, "otlp-grpc")
    for backend in [w for w in kube.workloads(objects) if w["metadata"]["name"] == "jaeger"]:
        assert allowed(objects, pod(collector), backend, "otlp-grpc")
        for sc in kube.specdec_containers(objects):
            assert not allowed(objects, pod(sc.workload), backend, "otlp-grpc"), sc.name


def test_only_the_coordinators_reach_redis(objects):
    redis = kube.named(objects, "StatefulSet", "specdec-redis")
    coordinator = kube.by_role(objects)["coordinator"].workload
    assert allowed(objects, pod(coordinator), redis, "redis")
    others = [w for w in kube.workloads(objects) if w is not coordinator]
    for source in [CLIENT, NEIGHBOUR, PROMETHEUS] + [pod(w) for w in others]:
        assert not allowed(objects, source, redis, "redis"), f"{source} reaches Redis"
