"""TLS on every hop, end to end: the client reaches the coordinator over TLS,
the coordinator reaches draft and target over mutual TLS, and the model
services accept only the coordinator's certificate identity. Certificates
are made here (tests/tls_certs.py); a rotation of the target's certificate
under a running stream drops nothing."""

from __future__ import annotations

import shutil
import time

import grpc
import pytest
from test_e2e import Proc, greedy_ref
from tls_certs import CA

from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import errors
from specdec.serving.client import Client, Delta
from specdec.serving.server import free_port

COORDINATOR_ID = "spiffe://specdec.test/coordinator"
IDS = [100, 101, 102]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    ca = CA(tmp_path_factory.mktemp("pki"))
    return {
        "ca": ca,
        "service": ca.issue("service", dns=["localhost"], ips=["127.0.0.1"]),
        # reached by name (the draft through dns:///localhost; the coordinator
        # as through a port-forward), so its certificate names no IP
        "named-service": ca.issue("named-service", dns=["localhost"]),
        "coordinator": ca.issue("coordinator", uris=[COORDINATOR_ID]),
        "intruder": ca.issue("intruder", uris=["spiffe://specdec.test/intruder"]),
    }


@pytest.fixture(scope="module")
def stack(models, pki, tmp_path_factory):
    target, draft = models
    logdir = tmp_path_factory.mktemp("tls-logs")
    ca = pki["ca"].path
    target_cert = logdir / "target.crt", logdir / "target.key"  # the target's own copy, to rotate
    for src, dst in zip(pki["service"], target_cert, strict=True):
        shutil.copy(src, dst)
    mtls = ["--tls-ca", ca, "--tls-peer-identity", COORDINATOR_ID]
    health_port = free_port()
    procs = {}
    try:
        procs["D"] = Proc("draft", ["draft-service", "--model", str(draft), "--tls-cert", pki["named-service"][0],
                                    "--tls-key", pki["named-service"][1], *mtls], logdir)
        procs["T"] = Proc("target", ["target-service", "--model", str(target), "--tls-cert", str(target_cert[0]),
                                     "--tls-key", str(target_cert[1]), *mtls,
                                     "--health-port", str(health_port)], logdir)
        procs["T"].health_port = health_port
        procs["C"] = Proc("coordinator", [
            "coordinator", "--draft", f"dns:///localhost:{procs['D'].port}", "--target", procs["T"].address,
            "--tokenizer", str(target), "--tls-cert", pki["named-service"][0], "--tls-key", pki["named-service"][1],
            "--upstream-ca", ca, "--upstream-cert", pki["coordinator"][0], "--upstream-key", pki["coordinator"][1],
        ], logdir)
        for p in procs.values():
            wait_tls_serving(p, pki)
        yield procs, target_cert
    finally:
        for p in procs.values():
            p.stop()


def wait_tls_serving(proc, pki, timeout=90):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    while True:
        with secure(proc.address, pki, "coordinator") as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
        time.sleep(0.2)


def secure(address, pki, who):
    cert, key = pki[who]
    creds = grpc.ssl_channel_credentials(open(pki["ca"].path, "rb").read(), open(key, "rb").read(),
                                         open(cert, "rb").read())
    return grpc.secure_channel(address, creds, options=[("grpc.ssl_target_name_override", "localhost")])


def test_a_generation_goes_over_tls_on_every_hop(stack, pki, reference):
    procs, _ = stack
    with Client(procs["C"].address, timeout=60, tls_ca=pki["ca"].path, tls_server_name="localhost") as c:
        out = c.complete(prompt_ids=IDS, max_new_tokens=16, gamma_policy="static:3")
    assert out.token_ids == greedy_ref(reference, IDS, 16)
    assert "without TLS" not in procs["C"].log()


def test_the_command_line_tools_take_tls_from_the_environment(stack, pki, monkeypatch, reference):
    procs, _ = stack
    monkeypatch.setenv("SPECDEC_CLIENT_TLS_CA", pki["ca"].path)
    with Client(procs["C"].address, timeout=10) as c, pytest.raises(errors.Unavailable):
        c.complete(prompt_ids=IDS, max_new_tokens=8)  # 127.0.0.1: not a name its certificate carries
    monkeypatch.setenv("SPECDEC_CLIENT_TLS_SERVER_NAME", "localhost")
    with Client(procs["C"].address, timeout=60) as c:
        assert c.complete(prompt_ids=IDS, max_new_tokens=8).token_ids == greedy_ref(reference, IDS, 8)


def test_model_services_refuse_other_identities_and_plaintext(stack, pki):
    procs, _ = stack
    request = pb.ModelInfoRequest()
    with secure(procs["T"].address, pki, "intruder") as channel:  # same CA, another identity
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.TargetServiceStub(channel).GetModelInfo(request, timeout=10)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "spiffe://specdec.test/intruder" in exc.value.details()
    with secure(procs["T"].address, pki, "coordinator") as channel:
        assert pb_grpc.TargetServiceStub(channel).GetModelInfo(request, timeout=10).vocab_size == 260
    with grpc.insecure_channel(procs["T"].address) as channel, pytest.raises(grpc.RpcError) as exc:
        pb_grpc.TargetServiceStub(channel).GetModelInfo(request, timeout=5)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    with Client(procs["C"].address, timeout=10) as plain, pytest.raises(errors.Unavailable):
        plain.complete(prompt_ids=IDS, max_new_tokens=4)


def test_the_health_port_answers_health_in_plaintext_and_nothing_else(stack):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    procs, _ = stack
    with grpc.insecure_channel(f"127.0.0.1:{procs['T'].health_port}") as channel:  # as the kubelet probes
        for service in ("", "specdec.v1.TargetService"):
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                             timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.TargetServiceStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_rotating_the_targets_certificate_drops_no_stream(stack, pki, reference):
    procs, target_cert = stack
    fresh = pki["ca"].issue("service-rotated", dns=["localhost"], ips=["127.0.0.1"])
    with Client(procs["C"].address, timeout=60, tls_ca=pki["ca"].path, tls_server_name="localhost") as c:
        stream = c.generate(prompt_ids=IDS, max_new_tokens=300, gamma_policy="static:2")
        got = list(next(stream).token_ids)
        for src, dst in zip(fresh, target_cert, strict=True):
            shutil.copy(src, dst)
        got += [t for e in stream if isinstance(e, Delta) for t in e.token_ids]
    assert got == greedy_ref(reference, IDS, 300)
    with secure(procs["T"].address, pki, "coordinator") as channel:  # a new connection: the new certificate
        assert pb_grpc.TargetServiceStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10).vocab_size
    assert "TLS certificate files changed" in procs["T"].log()


def test_incomplete_tls_settings_fail_at_start_up(models, pki, tmp_path):
    proc = Proc("half-tls", ["target-service", "--model", str(models[0]), "--tls-cert", pki["service"][0]],
                tmp_path)
    assert proc.proc.wait(60) == 2
    assert "--tls-cert needs --tls-key" in proc.log()
