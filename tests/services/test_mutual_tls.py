"""Both model services, in mutual TLS with --tls-peer-identity, accept a peer
only by a subject alternative name of the identity's own type: the
coordinator's URI only as a URI SAN (a DNS or e-mail SAN spelling it is
refused on every RPC), and a ``dns:`` identity only as a DNS SAN."""

from __future__ import annotations

import grpc
import pytest
from tls_certs import CA

from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc

from service_harness import LoopThread, start_service

COORDINATOR = "spiffe://specdec/coordinator"
OTHER = "coordinator.specdec.example"
ACCEPTED = f"{COORDINATOR},dns:{OTHER}"
STUBS = {"draft": pb_grpc.DraftServiceStub, "target": pb_grpc.TargetServiceStub}


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    return CA(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def services(ca, tiny_pair):
    """The draft and target services in mutual TLS accepting ACCEPTED: role -> address."""
    target, draft, _ = tiny_pair
    cert, key = ca.issue("service", ips=["127.0.0.1"])
    loop = LoopThread()
    tls = {"tls_cert": cert, "tls_key": key, "tls_ca": ca.path, "tls_peer_identity": ACCEPTED}
    running = {role: start_service(loop, role, model, **tls) for role, model in (("draft", draft), ("target", target))}
    yield {role: f"127.0.0.1:{service.port}" for role, service in running.items()}
    for service in running.values():
        loop.call(service.stop())
    loop.close()


def credentials(ca: CA, tmp_path, **names) -> grpc.ChannelCredentials:
    """A client certificate from the services' own CA, naming ``names`` (CA.issue's)."""
    cert, key = ca.issue("client", folder=tmp_path, **names)
    return grpc.ssl_channel_credentials(*(open(f, "rb").read() for f in (ca.path, key, cert)))


def every_rpc(address: str, role: str, creds: grpc.ChannelCredentials) -> dict[str, grpc.StatusCode]:
    """Each RPC of the role's service (from its descriptor), with an empty request: the status it ends with."""
    service = pb.DESCRIPTOR.services_by_name[STUBS[role].__name__.removesuffix("Stub")]
    codes = {}
    with grpc.secure_channel(address, creds) as channel:
        for method in service.methods:
            path = f"/{service.full_name}/{method.name}"
            try:
                call = channel.unary_stream(path) if method.server_streaming else channel.unary_unary(path)
                reply = call(b"", timeout=10)
                if method.server_streaming:
                    list(reply)
                codes[method.name] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                codes[method.name] = e.code()
    return codes


@pytest.mark.parametrize("names", [{"dns": [COORDINATOR]}, {"emails": [COORDINATOR]},
                                   {"uris": [f"dns:{OTHER}"]}, {"emails": [OTHER]}],
                         ids=["dns-san-spelling-the-uri", "email-san-spelling-the-uri", "uri-san-spelling-dns",
                              "email-san-naming-the-dns-name"])
def test_a_name_of_another_type_is_refused_by_every_rpc_of_both_services(services, ca, tmp_path, names):
    for role, address in services.items():
        codes = every_rpc(address, role, credentials(ca, tmp_path, **names))
        assert len(codes) >= 4 and set(codes.values()) == {grpc.StatusCode.PERMISSION_DENIED}, (role, codes)


@pytest.mark.parametrize("names", [{"uris": [COORDINATOR]}, {"dns": [OTHER.upper()]}], ids=["uri-san", "dns-san"])
def test_a_name_of_the_identitys_type_is_accepted_by_both_services(services, ca, tmp_path, names):
    creds = credentials(ca, tmp_path, **names)
    for role, address in services.items():
        with grpc.secure_channel(address, creds) as channel:
            assert STUBS[role](channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10).vocab_size > 0
        codes = every_rpc(address, role, creds)
        assert grpc.StatusCode.PERMISSION_DENIED not in codes.values(), (role, codes)
