"""The coordinator's upstream credentials follow renewed certificate files,
checked against a real mutual-TLS gRPC server that answers with the identities
its caller's certificate names, each with its type; and the identities
--tls-peer-identity accepts, each with its type."""

from __future__ import annotations

import shutil
from concurrent import futures

import grpc
import pytest
from tls_certs import CA

from specdec.serving.server import free_port
from specdec.serving.tls import (
    ServerTls,
    accepted_identities,
    peer_identities,
    renewed_channel_credentials,
    server_credentials,
)

WHO = "/test.Identity/Who"


@pytest.fixture
def ca(tmp_path):
    return CA(tmp_path / "ca")


@pytest.fixture
def address(ca, tmp_path):
    cert, key = ca.issue("server", ips=["127.0.0.1"], folder=tmp_path / "server")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    answer = grpc.unary_unary_rpc_method_handler(lambda request, context: ",".join(sorted(peer_identities(context)))
                                                 .encode())
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Identity", {"Who": answer})])
    port = free_port()
    server.add_secure_port(f"127.0.0.1:{port}", server_credentials(ServerTls(cert, key, ca.path)))
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def who(address: str, credentials: grpc.ChannelCredentials) -> str:
    with grpc.secure_channel(address, credentials) as channel:
        return channel.unary_unary(WHO)(b"", timeout=10).decode()


def test_clients_made_after_a_renewal_present_the_renewed_certificate(ca, address, tmp_path):
    folder = tmp_path / "client"
    cert, key = ca.issue("tls", uris=["spiffe://specdec/coordinator-1"], folder=folder)
    current = renewed_channel_credentials(ca.path, cert, key)
    first = current()
    assert current() is first  # files unchanged: nothing read again
    assert who(address, first) == "uri:spiffe://specdec/coordinator-1"

    renewed = tmp_path / "renewed"  # as cert-manager does: a new pair, put in place whole
    ca.issue("tls", uris=["spiffe://specdec/coordinator-2"], folder=renewed)
    for name in ("tls.crt", "tls.key"):
        shutil.copyfile(renewed / name, folder / name)
    assert who(address, current()) == "uri:spiffe://specdec/coordinator-2"


def test_unreadable_renewed_files_keep_the_last_credentials(ca, tmp_path):
    cert, key = ca.issue("tls", uris=["spiffe://specdec/coordinator"], folder=tmp_path / "client")
    current = renewed_channel_credentials(ca.path, cert, key)
    first = current()
    (tmp_path / "client" / "tls.key").unlink()  # a renewal half done
    assert current() is first


def test_a_renewed_key_that_is_not_the_certificates_keeps_the_last_credentials(ca, tmp_path):
    """A renewal caught between writing the certificate and its key."""
    folder = tmp_path / "client"
    cert, key = ca.issue("tls", uris=["spiffe://specdec/coordinator"], folder=folder)
    current = renewed_channel_credentials(ca.path, cert, key)
    first = current()
    ca.issue("other", folder=folder)
    shutil.copyfile(folder / "other.key", key)
    assert current() is first
    shutil.copyfile(folder / "other.crt", cert)  # the renewal completed
    assert current() is not first


def test_a_peers_names_come_with_their_types(ca, address, tmp_path):
    """A DNS or e-mail SAN that spells a URI is no URI."""
    spelled = "spiffe://specdec/coordinator"
    cert, key = ca.issue("tls", dns=[spelled, "Coordinator.Example"], emails=[spelled],
                         uris=["https://specdec.example/coordinator"], folder=tmp_path / "client")
    names = set(who(address, grpc.ssl_channel_credentials(*(open(f, "rb").read() for f in (ca.path, key, cert))))
                .split(","))
    assert names == {f"dns:{spelled}", f"email:{spelled}", "dns:coordinator.example",
                     "uri:https://specdec.example/coordinator"}
    assert not names & accepted_identities(spelled)
    assert names & accepted_identities("dns:coordinator.example")


@pytest.mark.parametrize("given, accepted", [
    ("spiffe://specdec/coordinator", {"uri:spiffe://specdec/coordinator"}),  # a scheme: a URI
    ("https://specdec.example/c, coordinator.specdec.svc", {"uri:https://specdec.example/c",
                                                           "dns:coordinator.specdec.svc"}),
    ("uri:spiffe://a/b,URI:urn:specdec:coordinator", {"uri:spiffe://a/b", "uri:urn:specdec:coordinator"}),
    ("dns:Coordinator.Example, DNS:other", {"dns:coordinator.example", "dns:other"}),  # DNS names: any case
])
def test_accepted_identities_say_their_type(given, accepted):
    assert accepted_identities(given) == accepted


@pytest.mark.parametrize("given", ["dns:spiffe://specdec/coordinator", "uri:coordinator.example", "uri:",
                                   "admin@specdec.example", "a b"])
def test_an_identity_of_no_type_is_refused(given):
    with pytest.raises(ValueError, match="must be URIs .* or DNS names"):
        accepted_identities(given)


def test_a_service_given_an_identity_of_no_type_fails_at_start_up_naming_the_flag(ca, tmp_path):
    from specdec.serving.config import TargetConfig

    cert, key = ca.issue("service", ips=["127.0.0.1"], folder=tmp_path / "service")
    tls = {"tls_cert": cert, "tls_key": key, "tls_ca": ca.path}
    with pytest.raises(ValueError, match="--tls-peer-identity must be URIs .*'admin@specdec.example' is neither"):
        TargetConfig.load({**tls, "tls_peer_identity": "spiffe://specdec/coordinator,admin@specdec.example"})
    config = TargetConfig.load({**tls, "tls_peer_identity": "spiffe://specdec/coordinator"})
    assert config.peer_identities == {"uri:spiffe://specdec/coordinator"}
