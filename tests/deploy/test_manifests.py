"""The Kubernetes manifests (deploy/kubernetes), rendered by ``kubectl
kustomize``: valid objects of the Kubernetes release they are pinned to, and
true to the deployment's rules (probes, resources, locked-down containers,
drain, rollouts, disruption budgets, placement, GPUs). Every port, variable and
flag they give a specdec container is checked against the services' own
command line and config classes, not against a list kept here."""

from __future__ import annotations

import re

import kubernetes_validate
import pytest
import yaml
from opentelemetry.sdk import environment_variables as otel_variables

from specdec.serving.config import CONFIG_CLASSES, env_names

import kube

# Kinds from CRDs, which kubernetes-validate has no schema for: the Prometheus Operator's and cert-manager's.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("cert-manager.io/v1", "Certificate"),
             ("cert-manager.io/v1", "Issuer")}
# Read by torch, not by specdec's settings: its CPU thread count.
TORCH_VARIABLES = {"OMP_NUM_THREADS"}
# After the drain a service flushes its last spans (up to 3 s) and exits.
EXIT_S = 5
MODEL_LOADER = kube.KUBERNETES / "model-loader.yaml"



def validate(obj: dict) -> None:
    what = f"{obj['kind']}/{obj['metadata']['name']}"
    try:
        kubernetes_validate.validate(obj, kube.KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        assert (obj["apiVersion"], obj["kind"]) in CRD_KINDS, f"{what}: not a Kubernetes {kube.KUBERNETES_VERSION} kind"
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{what} is not valid for Kubernetes {kube.KUBERNETES_VERSION}: "
                    f"{'.'.join(map(str, e.path))}: {e.message}")


def test_every_object_is_valid_for_the_pinned_kubernetes_release(objects):
    assert len(objects) > 20
    for obj in objects:
        validate(obj)


def test_every_object_is_in_the_deploy_readmes_table(objects):
    """deploy/README.md explains each object an overlay makes, and each claim
    a StatefulSet makes, in its table (a row naming its kind and its name)."""
    table = (kube.DEPLOY / "README.md").read_text().split("## What each object is for", 1)[1]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| ")]
    made = [(o["kind"], o["metadata"]["name"]) for o in objects]
    made += [("PersistentVolumeClaim", f"{t['metadata']['name']}-{o['metadata']['name']}-{i}")
             for o in kube.of_kind(objects, "StatefulSet") for t in o["spec"].get("volumeClaimTemplates", [])
             for i in range(o["spec"].get("replicas", 1))]
    for kind, name in made:
        if kind == "ConfigMap":
            name = re.sub(r"-[a-z0-9]{10}$", "", name)  # the generator's hash of the contents
        assert any(f"`{name}`" in row and kind in row for row in rows), f"deploy/README.md: no row for {kind} {name}"


def test_everything_lives_in_the_specdec_namespace(objects):
    (namespace,) = kube.of_kind(objects, "Namespace")
    assert namespace["metadata"]["name"] == kube.NAMESPACE
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    for obj in objects:
        if obj is not namespace:
            assert obj["metadata"].get("namespace") == kube.NAMESPACE, f"{obj['kind']}/{obj['metadata']['name']}"


def assert_locked_down(workload: dict, container: dict) -> None:
    what = f"{workload['metadata']['name']}/{container['name']}"
    pod = kube.pod_template(workload)["spec"]
    sc, pod_sc = container.get("securityContext", {}), pod.get("securityContext", {})
    assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, what
    assert sc.get("readOnlyRootFilesystem") is True, what
    assert sc.get("allowPrivilegeEscalation") is False, what
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], what
    assert (sc.get("seccompProfile") or pod_sc.get("seccompProfile")) == {"type": "RuntimeDefault"}, what
    assert pod.get("automountServiceAccountToken") is False, f"{what}: nothing here calls the Kubernetes API"


def test_every_container_has_probes_resources_and_a_locked_down_security_context(objects):
    for workload, container in kube.containers(objects):
        what = f"{workload['metadata']['name']}/{container['name']}"
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(container), what
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(container.get("resources", {}).get(kind, {})), f"{what}: {kind}"
        assert_locked_down(workload, container)


def pods_and_containers(objects):
    """(workload, pod spec, container, what) for every container of ``objects`` and of the model loader."""
    (loader,) = yaml.safe_load_all(MODEL_LOADER.read_text())
    for workload, container in [*kube.containers(objects), *kube.containers([loader])]:
        yield (workload, kube.pod_template(workload)["spec"], container,
               f"{workload['metadata']['name']}/{container['name']}")


def test_every_container_runs_as_a_user_and_group_above_10000(objects):
    """Whatever its image's own user (redis's is 999): the policy scanners' rule."""
    for _, pod, container, what in pods_and_containers(objects):
        sc, pod_sc = container.get("securityContext", {}), pod.get("securityContext", {})
        assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True, what
        for field in ("runAsUser", "runAsGroup"):
            value = sc.get(field, pod_sc.get(field))
            assert isinstance(value, int) and value > kube.HIGHEST_RESERVED_ID, f"{what}: {field} {value}"


def test_every_volume_a_container_writes_is_writable_by_its_group(objects):
    """A claimed volume belongs to root until fsGroup gives it to the pod's
    group (an emptyDir is writable by anyone)."""
    for workload, pod, container, what in pods_and_containers(objects):
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        claimed = {t["metadata"]["name"] for t in workload.get("spec", {}).get("volumeClaimTemplates", [])}
        for mount in container.get("volumeMounts", []):
            volume = volumes.get(mount["name"], {})
            if mount.get("readOnly") or "emptyDir" in volume or not (
                    "persistentVolumeClaim" in volume or mount["name"] in claimed):
                continue
            pod_sc = pod["securityContext"]
            group = container.get("securityContext", {}).get("runAsGroup", pod_sc.get("runAsGroup"))
            assert pod_sc.get("fsGroup") == group, f"{what}: {mount['mountPath']} is not its group's"


def test_specdec_writes_only_to_an_empty_dir_at_its_home():
    """The image points HOME and the library caches at /tmp; with a read-only
    root filesystem that must be a mounted emptyDir."""
    home = kube.image_env()["HOME"]
    for name, objects in kube.renders().items():
        for sc in kube.specdec_containers(objects):
            (mount,) = [m for m in sc.container["volumeMounts"] if m["mountPath"] == home]
            (volume,) = [v for v in sc.pod["volumes"] if v["name"] == mount["name"]]
            assert "emptyDir" in volume, f"{name} {sc.name}"


def test_specdec_probes_ask_grpc_health_on_the_plaintext_health_port_the_service_opens(objects):
    for sc in kube.specdec_containers(objects):
        config = sc.config()
        assert kube.container_port(sc.container, "grpc") == config.port, sc.name
        # the kubelet's gRPC probes speak plaintext only: not the service port, which may speak TLS
        assert config.health_port and kube.container_port(sc.container, "health") == config.health_port, sc.name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert sc.container[probe]["grpc"]["port"] == config.health_port, f"{sc.name} {probe}"
        startup = sc.container["startupProbe"]
        budget = startup.get("periodSeconds", 10) * startup.get("failureThreshold", 3)
        # a model service may take minutes to load a large model; the coordinator loads a tokenizer
        assert budget >= (60 if sc.role == "coordinator" else 600), f"{sc.name}: startup budget {budget} s"


def test_termination_grace_covers_the_pre_stop_pause_and_the_drain(objects):
    for sc in kube.specdec_containers(objects):
        config = sc.config()
        pause = sc.container["lifecycle"]["preStop"]["sleep"]["seconds"]
        # the coordinator, once drained, gives the sessions it cut --info-timeout to end
        ending = config.info_timeout_s if sc.role == "coordinator" else 0
        needed = pause + config.drain_grace_s + ending + EXIT_S
        assert sc.pod["terminationGracePeriodSeconds"] >= needed, f"{sc.name} needs {needed} s"


def test_rollouts_and_node_drains_never_take_the_last_ready_pod(objects):
    budgets = kube.of_kind(objects, "PodDisruptionBudget")
    for sc in kube.specdec_containers(objects):
        strategy = sc.workload["spec"]["strategy"]
        assert strategy["type"] == "RollingUpdate", sc.name
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0 and strategy["rollingUpdate"]["maxSurge"] >= 1
        (budget,) = [b for b in budgets if kube.matches(b["spec"]["selector"], kube.pod_labels(sc.workload))]
        assert budget["spec"]["minAvailable"] >= 1, sc.name


def test_model_pods_are_addressable_and_the_coordinator_scales_behind_a_service(objects):
    roles = kube.by_role(objects)
    for role in ("draft", "target"):
        assert kube.service_for(objects, roles[role].workload)["spec"].get("clusterIP") == "None", f"{role}: headless"
    assert kube.service_for(objects, roles["coordinator"].workload)["spec"].get("clusterIP") != "None"
    (hpa,) = kube.of_kind(objects, "HorizontalPodAutoscaler")
    coordinator = roles["coordinator"].workload
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": coordinator["kind"],
                                             "name": coordinator["metadata"]["name"]}
    assert "replicas" not in coordinator["spec"], "the autoscaler owns the coordinator's replica count"
    assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]


def test_drafts_prefer_nodes_holding_targets_and_targets_spread_over_nodes(objects):
    roles = kube.by_role(objects)
    target_labels = kube.pod_labels(roles["target"].workload)
    (preferred,) = roles["draft"].pod["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname" and kube.matches(term["labelSelector"], target_labels)
    (spread,) = roles["target"].pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and kube.matches(spread["labelSelector"], target_labels)


def gpus(container: dict) -> tuple[int, int]:
    resources = container["resources"]
    return (int(resources["requests"].get("nvidia.com/gpu", 0)), int(resources["limits"].get("nvidia.com/gpu", 0)))


def test_gpu_overlay_gives_draft_and_target_a_gpu_each_in_pods_of_their_own():
    roles = kube.by_role(kube.render(kube.OVERLAYS["gpu"]))
    assert roles["draft"].workload is not roles["target"].workload
    for role in ("draft", "target"):
        sc = roles[role]
        assert len(sc.pod["containers"]) == 1 and gpus(sc.container) == (1, 1), role
        assert sc.pod["nodeSelector"], role
        assert any(t["key"] == "nvidia.com/gpu" for t in sc.pod["tolerations"]), role
        assert sc.config().device == "cuda:0", role
        assert sc.config().model_path().startswith("/models/"), f"{role}: models from the volume"
    assert gpus(roles["coordinator"].container) == (0, 0)


def test_cpu_overlay_runs_on_cpus_with_the_bundled_models():
    from specdec.models import bundled

    roles = kube.by_role(kube.render(kube.OVERLAYS["cpu"]))
    for role, sc in roles.items():
        assert gpus(sc.container) == (0, 0), role
        if role != "coordinator":
            assert sc.config().device == "cpu"
            assert sc.config().model_path() == str(bundled.draft_path() if role == "draft" else bundled.target_path())


def accepted(role: str) -> set[str]:
    """The variables a service reads: its settings' and OpenTelemetry's (and torch's thread count)."""
    cls = CONFIG_CLASSES[role]
    names = {env for field in cls.model_fields for env in env_names(cls, field)}
    otel = {getattr(otel_variables, n) for n in dir(otel_variables) if n.startswith("OTEL_")}
    return names | otel | TORCH_VARIABLES


def test_every_flag_variable_and_port_is_one_the_services_accept(objects):
    roles = kube.by_role(objects)
    for role, sc in roles.items():
        config = sc.config()  # fails on an argument specdec does not accept
        for var in sc.container.get("env", []):
            assert var["name"] in accepted(role), f"{sc.name}: {role} does not read {var['name']}"
        served = {config.port, config.metrics_port, config.health_port, getattr(config, "http_port", 0)} - {0}
        assert {p["containerPort"] for p in sc.container["ports"]} == served, sc.name
        annotations = kube.pod_template(sc.workload)["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == config.metrics_port == kube.container_port(
            sc.container, "metrics"), sc.name
    for name in {ref["configMapRef"]["name"] for sc in roles.values() for ref in sc.container.get("envFrom", [])}:
        readers = [role for role, sc in roles.items()
                   if name in [ref["configMapRef"]["name"] for ref in sc.container.get("envFrom", [])]]
        for key in kube.named(objects, "ConfigMap", name)["data"]:
            assert any(key in accepted(role) for role in readers), f"ConfigMap {name}: no service reads {key}"


def test_the_coordinators_service_leads_to_its_http_api_with_the_grpc_ports_tls(objects):
    """The OpenAI-compatible API: the container port the coordinator serves it
    on, behind the Service's ``http`` port, which says ``https`` exactly when
    the coordinator serves TLS (its certificate flags apply to both ports)."""
    sc = kube.by_role(objects)["coordinator"]
    config = sc.config()
    assert config.http_port and kube.container_port(sc.container, "http") == config.http_port
    service = kube.service_for(objects, sc.workload)
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    workload, _, container_port = kube.service_backend(objects, service, port["port"])
    assert workload is sc.workload and container_port == config.http_port
    assert port["appProtocol"] == ("https" if config.tls_cert else "http")
    (grpc,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert ("appProtocol" in grpc) != bool(config.tls_cert), "h2c only in plaintext"


def test_the_coordinator_finds_each_model_service_through_its_service(objects):
    roles = kube.by_role(objects)
    config = roles["coordinator"].config()
    assert config.redis.startswith("redis://specdec-redis:"), "the coordinators share the bundled Redis"
    for role in ("draft", "target"):
        # every ready pod of the headless Service, looked up again as pods come and go
        assert getattr(config, role).startswith("dns:///"), f"--{role} {getattr(config, role)}: not a pool"
        (address,) = kube.addresses(getattr(config, role))
        service = kube.service_host(objects, address["host"])
        assert service is not None, f"--{role} {getattr(config, role)}: no such Service"
        workload, _, port = kube.service_backend(objects, service, int(address["port"]))
        assert workload is roles[role].workload and port == roles[role].config().port, role


def test_the_coordinator_limits_each_client_by_default(objects):
    """Without per-client limits one client's flood raises everyone's latency:
    each client gets a bounded share of a coordinator pod."""
    roles = kube.by_role(objects)
    config = roles["coordinator"].config()
    assert config.client_max_streams > 0 and config.client_rate > 0, "per-client limits are off"
    assert config.client_max_streams * 16 <= config.max_streams, "one client could hold the pod's streams"
    assert config.client_max_streams * 4 <= roles["target"].config().max_sessions
    # a burst above the rate, so a client opening its conversations is not held back a second each
    assert config.client_rate < config.client_burst <= config.client_max_streams


def test_the_model_loader_is_valid_and_locked_down():
    (pod,) = yaml.safe_load_all(MODEL_LOADER.read_text())
    validate(pod)
    for container in pod["spec"]["containers"]:
        assert_locked_down(pod, container)
    (volume,) = pod["spec"]["volumes"]
    pvc = kube.named(kube.render(kube.OVERLAYS["gpu"]), "PersistentVolumeClaim", "specdec-models")
    assert volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert pod["metadata"]["namespace"] == pvc["metadata"]["namespace"]
