"""The manifests run: every specdec container of the rendered cpu overlay starts
here as a local process with exactly the command, arguments and environment
its manifest gives it. Only what a cluster provides is stood in for: each pod's
ports are free loopback ports, a Service name resolves to the port of the
container behind it, each volume is a local folder, the collector is an
in-memory OTLP receiver and Redis a local redis-server with the Redis
container's own arguments. Then, as the kubelet would: wait for each readiness
probe (gRPC health on the probe's port), stream a Generate through the
coordinator's Service, ask the same of its OpenAI-compatible HTTP API (the
Service's ``http`` port) with the openai SDK, and SIGTERM every process, which
must exit within its terminationGracePeriodSeconds.

With components/tls and components/client-auth, what cert-manager and the
operator would put in the Secrets is made here: a CA, and for each Certificate
a pod mounts a certificate with the names the object asks for (and 127.0.0.1,
where its Service's name leads here); a tokens file. The client then needs the
CA and a token, and every hop is TLS."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import ssl
import subprocess
import time
import urllib.request

import grpc
import openai
import pytest
from redis_server import RedisServer
from tls_certs import CA

from specdec import SpeculativeDecoder
from specdec.models import bundled
from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import errors
from specdec.serving.client import Client, Delta
from specdec.serving.server import free_port
from specdec.tools.otlp_receiver import OtlpReceiver

import kube
from service_harness import ServiceProcess

PROMPT = "def fibonacci(n):"
NEW_TOKENS = 32
SERVICES = {"specdec-coordinator", "specdec-draft", "specdec-target"}  # their spans' service.name
COMPONENTS = kube.KUBERNETES / "components"
SECURED = (COMPONENTS / "tls", COMPONENTS / "client-auth")
TOKEN = "the-test-clients-token"


class LocalCluster:
    """Where the rendered objects' pods, Services and volumes are on this machine."""

    def __init__(self, objects, root: pathlib.Path):
        self.objects, self.root = objects, root
        self.ports: dict[tuple[str, int], int] = {}

    def port(self, workload: dict, container_port: int) -> int:
        """The loopback port standing in for a pod's container port."""
        return self.ports.setdefault((workload["metadata"]["name"], container_port), free_port())

    def address(self, host: str, port: int) -> str:
        """Where ``host:port`` leads when ``host`` names a Service."""
        workload, _, container_port = kube.service_backend(self.objects, kube.service_host(self.objects, host), port)
        return f"127.0.0.1:{self.port(workload, container_port)}"

    def volume(self, sc: kube.SpecdecContainer, mount: dict) -> pathlib.Path:
        folder = self.root / sc.name / mount["name"]
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def local(self, sc: kube.SpecdecContainer, value: str) -> str:
        """A manifest value as it reads here: one of the container's own ports,
        Service addresses, paths under its volume mounts."""
        if value.isdigit() and kube.container_port(sc.container, int(value)):
            return str(self.port(sc.workload, int(value)))
        value = kube.ADDRESS.sub(lambda m: self.address(m["host"], int(m["port"]))
                                 if kube.service_host(self.objects, m["host"]) else m[0], value)
        mounts = sorted(sc.container.get("volumeMounts", []), key=lambda m: -len(m["mountPath"]))
        for mount in mounts:  # the deepest mount holds the path; one rewrite only
            path = mount["mountPath"]
            if value == path or value.startswith(path + "/"):
                return str(self.volume(sc, mount)) + value[len(path):]
        return value

    def start(self, sc: kube.SpecdecContainer) -> ServiceProcess:
        """The container as a process: its argv and environment, made local. The
        environment this machine has stands in for the image's, less any
        specdec or OpenTelemetry setting of its own."""
        for mount in sc.container.get("volumeMounts", []):
            self.volume(sc, mount)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SPECDEC_", "OTEL_"))}
        env |= {name: self.local(sc, value) for name, value in sc.env.items()}
        argv = [kube.tool(sc.argv[0], "specdec")] + [self.local(sc, a) for a in sc.argv[1:]]
        address = f"127.0.0.1:{self.port(sc.workload, kube.container_port(sc.container, 'grpc'))}"
        return ServiceProcess(sc.name, argv, self.root, address, env=env, cwd=self.root)

    def secret_volume(self, secret: str) -> list[pathlib.Path]:
        """The local folders of every pod's volume of this Secret."""
        found = []
        for sc in kube.specdec_containers(self.objects):
            volumes = {v["name"]: v for v in sc.pod.get("volumes", [])}
            for mount in sc.container.get("volumeMounts", []):
                if volumes[mount["name"]].get("secret", {}).get("secretName") == secret:
                    found.append(self.volume(sc, mount))
        return found

    def issue_certificates(self) -> CA | None:
        """What cert-manager would write into each mounted Certificate's Secret (None: no Certificate)."""
        certificates = [c for c in kube.of_kind(self.objects, "Certificate") if not c["spec"].get("isCA")]
        if not certificates:
            return None
        ca = CA(self.root / "ca")
        for certificate in certificates:
            spec = certificate["spec"]
            for folder in self.secret_volume(spec["secretName"]):
                ca.issue("tls", dns=spec.get("dnsNames", []), uris=spec.get("uris", []), ips=["127.0.0.1"],
                         folder=folder)
                (folder / "ca.crt").write_bytes(pathlib.Path(ca.path).read_bytes())
        return ca


@contextlib.contextmanager
def _stopped(redis: RedisServer):
    try:
        yield redis
    finally:
        redis.stop()


def local_port(cluster: LocalCluster, address) -> int:
    """The loopback port of the pod behind a Service address (a regex match of host and port)."""
    return int(cluster.address(address["host"], int(address["port"])).split(":")[1])


def wait_ready(sc: kube.SpecdecContainer, cluster: LocalCluster, process: ServiceProcess) -> None:
    """As the kubelet does: the startup probe's budget to pass the readiness and
    liveness probes (gRPC health, in plaintext, on the probes' port)."""
    startup = sc.container["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    for probe in (sc.container["readinessProbe"]["grpc"], sc.container["livenessProbe"]["grpc"]):
        process.wait_serving(timeout=min(budget, 120), service=probe.get("service", ""),
                             address=f"127.0.0.1:{cluster.port(sc.workload, probe['port'])}")


def target_only(prompt: str, n: int) -> list[int]:
    decoder = SpeculativeDecoder(target=str(bundled.target_path()))
    ids = decoder.tokenizer.encode(prompt, add_special_tokens=False)
    return decoder.generate(ids, max_new_tokens=n, gamma=0).token_ids


def coordinator_address(cluster: LocalCluster, sc: kube.SpecdecContainer) -> str:
    """The coordinator's Service, on its gRPC port, as clients reach it."""
    service = kube.service_for(cluster.objects, sc.workload)
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "grpc"]
    return cluster.address(service["metadata"]["name"], port)


def coordinator_http_api(cluster: LocalCluster, sc: kube.SpecdecContainer, ca: CA | None, token: str | None):
    """The openai SDK on the coordinator's Service's ``http`` port, as a client
    in the cluster would call it (HTTPS, trusting the CA, with components/tls)."""
    service = kube.service_for(cluster.objects, sc.workload)
    (port,) = [p["port"] for p in service["spec"]["ports"] if p["name"] == "http"]
    tls = {"http_client": openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca.path))} if ca else {}
    scheme = "https" if ca else "http"
    return openai.OpenAI(base_url=f"{scheme}://{cluster.address(service['metadata']['name'], port)}/v1",
                         api_key=token or "unused", max_retries=0, timeout=60, **tls)


def assert_http_api_answers_as_grpc(client: openai.OpenAI, text: str, secured: bool) -> None:
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert out.choices[0].text == text and out.usage.completion_tokens == NEW_TOKENS
    if secured:  # no call without a token
        with pytest.raises(openai.AuthenticationError):
            client.with_options(api_key="not-a-token").models.list()


def scrape(cluster: LocalCluster, sc: kube.SpecdecContainer) -> str:
    """/metrics where the pod's Prometheus annotation says."""
    port = int(kube.pod_template(sc.workload)["metadata"]["annotations"]["prometheus.io/port"])
    with urllib.request.urlopen(f"http://127.0.0.1:{cluster.port(sc.workload, port)}/metrics", timeout=10) as r:
        return r.read().decode()


def model_info(process: ServiceProcess, sc: kube.SpecdecContainer, coordinator_tls) -> pb.ModelInfo:
    """A model service's GetModelInfo, over mutual TLS as the coordinator when the pods speak it."""
    if coordinator_tls is None:
        return process.model_info(sc.role)
    ca, cert, key = (pathlib.Path(f).read_bytes() for f in coordinator_tls)
    with grpc.secure_channel(process.address, grpc.ssl_channel_credentials(ca, key, cert)) as channel:
        stub = (pb_grpc.DraftServiceStub if sc.role == "draft" else pb_grpc.TargetServiceStub)(channel)
        return stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)


def assert_kv_budget_fits_the_memory_limit(info: pb.ModelInfo, sc: kube.SpecdecContainer) -> None:
    """The cache grows in steps of up to 1.5x its tokens; the process itself needs about half a GiB."""
    cache = 1.5 * info.kv_budget_tokens * info.kv_bytes_per_token
    limit = kube.quantity(sc.container["resources"]["limits"]["memory"])
    assert cache + 2**29 <= limit, f"{sc.name}: a full KV budget takes {cache / 2**20:.0f} MiB of {limit / 2**20:.0f}"


def stop_as_the_kubelet_does(processes: dict[str, ServiceProcess], roles: dict[str, kube.SpecdecContainer]):
    """SIGTERM to every process at once; each must exit 0 within its grace period
    less the preStop pause that the kubelet runs first."""
    started = time.monotonic()
    for process in processes.values():
        process.proc.send_signal(signal.SIGTERM)
    for role, process in processes.items():
        sc = roles[role]
        grace = sc.pod["terminationGracePeriodSeconds"] - sc.container["lifecycle"]["preStop"]["sleep"]["seconds"]
        try:
            process.proc.wait(timeout=max(0.0, grace - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{role} still running {grace} s after SIGTERM:\n{process.log()}") from None
        assert process.proc.returncode == 0, f"{role} exited {process.proc.returncode}:\n{process.log()}"


def coordinator_credentials(cluster: LocalCluster, sc: kube.SpecdecContainer) -> tuple[str, str, str] | None:
    """The coordinator's upstream CA, certificate and key, as files here (None: plaintext)."""
    config = sc.config()
    if not config.upstream_ca:
        return None
    return tuple(cluster.local(sc, f) for f in (config.upstream_ca, config.upstream_cert, config.upstream_key))


def give_client_tokens(cluster: LocalCluster, sc: kube.SpecdecContainer) -> str | None:
    """The tokens Secret an operator creates, with one client (None: no authentication)."""
    path = getattr(sc.config(), "auth_tokens_file", "")
    if not path:
        return None
    pathlib.Path(cluster.local(sc, path)).write_text("# NAME TOKEN\ntest-client " + TOKEN + "\n")
    return TOKEN


@pytest.mark.parametrize("components", [(), SECURED], ids=["cpu", "cpu+tls+client-auth"])
def test_the_cpu_overlay_runs_as_its_manifests_say(tmp_path, components):
    objects = kube.render_with(kube.OVERLAYS["cpu"], components) if components else kube.render(kube.OVERLAYS["cpu"])
    roles = kube.by_role(objects)
    cluster = LocalCluster(objects, tmp_path)
    ca = cluster.issue_certificates()
    assert (ca is not None) == bool(components)
    token = give_client_tokens(cluster, roles["coordinator"])
    (collector,) = kube.addresses(roles["coordinator"].env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    (redis,) = kube.addresses(roles["coordinator"].env["SPECDEC_COORDINATOR_REDIS"])
    # redis-server with the manifest's own arguments (the append-only file, the memory policy)
    directory = RedisServer(tmp_path / "redis", port=local_port(cluster, redis),
                            args=kube.redis_args(objects, tmp_path / "redis")).start()
    with OtlpReceiver(port=local_port(cluster, collector)) as otlp, _stopped(directory):
        processes = {role: cluster.start(sc) for role, sc in roles.items()}  # all at once
        try:
            expected = target_only(PROMPT, NEW_TOKENS)  # while they start
            for role, process in processes.items():
                wait_ready(roles[role], cluster, process)
            address = coordinator_address(cluster, roles["coordinator"])
            tls = {"tls_ca": ca.path} if ca else {}
            with Client(address, timeout=60, token=token, **tls) as client:
                events = list(client.generate(PROMPT, max_new_tokens=NEW_TOKENS))
            assert [t for e in events if isinstance(e, Delta) for t in e.token_ids] == expected
            assert events[-1].finish_reason == "length"
            with coordinator_http_api(cluster, roles["coordinator"], ca, token) as api:
                text = "".join(e.text for e in events if isinstance(e, Delta))
                assert_http_api_answers_as_grpc(api, text, secured=bool(components))
            if components:  # no plaintext, and no call without a token
                with Client(address, timeout=10) as plain, pytest.raises(errors.Unavailable):
                    plain.complete(PROMPT, max_new_tokens=2)
                with Client(address, timeout=10, **tls) as anonymous, pytest.raises(errors.Unauthenticated):
                    anonymous.complete(PROMPT, max_new_tokens=2)
            for sc in roles.values():
                assert "specdec_rpc_server_duration_seconds" in scrape(cluster, sc), sc.name
            upstream = coordinator_credentials(cluster, roles["coordinator"])
            for role in ("draft", "target"):
                assert_kv_budget_fits_the_memory_limit(model_info(processes[role], roles[role], upstream), roles[role])
                assert ("without TLS" in processes[role].log()) != bool(components), processes[role].log()
            stop_as_the_kubelet_does(processes, roles)
        finally:
            for process in processes.values():
                process.stop()
        # the sampler of the cpu overlay keeps every trace; the last spans were flushed at exit
        assert SERVICES <= {span["service"] for span in otlp.spans}
