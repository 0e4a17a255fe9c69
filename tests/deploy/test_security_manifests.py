"""The security components of deploy/kubernetes, rendered by ``kubectl
kustomize`` onto each overlay: components/tls (certificates cert-manager issues,
mounted from their Secrets; TLS on every hop, mutual TLS to the model
services) and components/client-auth (the coordinator's client tokens from a
Secret). What the services are told is read through their own config classes,
and checked against the Certificate objects: every file a service is given is
one its pod mounts from the right Secret, every certificate names what its
peers check it for."""

from __future__ import annotations

import pathlib

import pytest

from specdec.coordinator.pools import DnsName, parse_addresses

import kube

TLS = kube.KUBERNETES / "components" / "tls"
CLIENT_AUTH = kube.KUBERNETES / "components" / "client-auth"
# What cert-manager writes into a Certificate's Secret.
CERT_MANAGER_KEYS = {"tls.crt", "tls.key", "ca.crt"}


@pytest.fixture(scope="module", params=sorted(kube.OVERLAYS))
def secured(request):
    """An overlay with both security components, as a user's kustomization adds them."""
    return kube.render_with(kube.OVERLAYS[request.param], (TLS, CLIENT_AUTH))


def secret_of(sc: kube.SpecdecContainer, path: str) -> str:
    """The Secret a file the service is given comes from (fails if the pod does not mount it from one)."""
    mount = sc.mount(path)
    assert mount is not None, f"{sc.name}: {path} is in none of its volumes"
    (volume,) = [v for v in sc.pod["volumes"] if v["name"] == mount["name"]]
    assert "secret" in volume, f"{sc.name}: {path} is not from a Secret"
    assert mount.get("readOnly") and not mount.get("subPath"), \
        f"{sc.name}: mount {path} read-only and whole (a subPath mount is never updated on renewal)"
    return volume["secret"]["secretName"]


def certificate_for(objects, secret: str) -> dict:
    (found,) = [c for c in kube.of_kind(objects, "Certificate") if c["spec"]["secretName"] == secret]
    return found


def tls_files(sc: kube.SpecdecContainer) -> dict[str, str]:
    config = sc.config()
    names = ("tls_cert", "tls_key", "tls_ca") + (("upstream_ca", "upstream_cert", "upstream_key")
                                                 if sc.role == "coordinator" else ())
    return {name: getattr(config, name) for name in names if getattr(config, name)}


def test_every_service_serves_tls_from_its_own_certificate_secret(secured):
    for sc in kube.specdec_containers(secured):
        files = tls_files(sc)
        assert files.get("tls_cert") and files.get("tls_key"), f"{sc.name}: no TLS"
        secrets = {name: secret_of(sc, path) for name, path in files.items()}
        assert len(set(secrets.values())) == 1, f"{sc.name}: certificate and key from different Secrets: {secrets}"
        certificate = certificate_for(secured, secrets["tls_cert"])
        assert certificate["metadata"]["name"] == f"{sc.name}-tls"
        assert {pathlib.PurePath(p).name for p in files.values()} <= CERT_MANAGER_KEYS, files
        assert "server auth" in certificate["spec"]["usages"]
        service = kube.service_for(secured, sc.workload)["metadata"]["name"]
        assert service in certificate["spec"]["dnsNames"], f"{sc.name}: its certificate does not name {service}"


def test_model_services_accept_only_the_coordinators_certificate_identity(secured):
    roles = kube.by_role(secured)
    coordinator = roles["coordinator"].config()
    theirs = certificate_for(secured, secret_of(roles["coordinator"], coordinator.upstream_cert))["spec"]
    assert "client auth" in theirs["usages"]
    for role in ("draft", "target"):
        config = roles[role].config()
        assert config.tls_ca, f"{role}: no mutual TLS"
        uris = {f"uri:{uri}" for uri in theirs.get("uris", [])}  # URI SANs: accepted only as URIs
        assert config.peer_identities and config.peer_identities <= uris, \
            f"{role} accepts {config.peer_identities}; the coordinator's certificate names {theirs.get('uris')}"


def test_the_coordinator_checks_each_model_service_for_the_name_its_certificate_carries(secured):
    roles = kube.by_role(secured)
    coordinator = roles["coordinator"].config()
    assert coordinator.upstream_ca and not coordinator.upstream_server_name
    for role in ("draft", "target"):
        pool = parse_addresses(getattr(coordinator, role))
        assert isinstance(pool, DnsName)  # its host is the name checked (coordinator.engine.make_pool)
        served = certificate_for(secured, secret_of(roles[role], roles[role].config().tls_cert))
        assert pool.name in served["spec"]["dnsNames"], f"{role}: {pool.name} not in {served['spec']['dnsNames']}"


def test_every_certificate_is_issued_by_an_issuer_of_the_deployment(secured):
    issuers = {i["metadata"]["name"]: i for i in kube.of_kind(secured, "Issuer")}
    for certificate in kube.of_kind(secured, "Certificate"):
        ref = certificate["spec"]["issuerRef"]
        assert ref["kind"] == "Issuer" and ref["name"] in issuers, certificate["metadata"]["name"]
        if not certificate["spec"].get("isCA"):
            assert "ca" in issuers[ref["name"]]["spec"], "service certificates come from the CA issuer"
            assert certificate["spec"]["privateKey"]["rotationPolicy"] == "Always"
    (ca_issuer,) = [i for i in issuers.values() if "ca" in i["spec"]]
    assert certificate_for(secured, ca_issuer["spec"]["ca"]["secretName"])["spec"]["isCA"]


def test_client_tokens_come_from_a_secret_the_manifests_do_not_hold(secured):
    coordinator = kube.by_role(secured)["coordinator"]
    path = coordinator.config().auth_tokens_file
    assert path, "client-auth sets no tokens file"
    secret = secret_of(coordinator, path)
    assert not [s for s in kube.of_kind(secured, "Secret") if s["metadata"]["name"] == secret], \
        "a tokens Secret in the manifests would put tokens in git"
    for sc in kube.specdec_containers(secured):
        assert not [name for name in sc.env if name.endswith("AUTH_TOKENS")], f"{sc.name}: tokens in the manifests"


def test_the_overlays_alone_need_no_cert_manager_and_run_plaintext():
    """Both components are opt-in: an overlay applies to a cluster without cert-manager's CRDs."""
    for name, overlay in kube.OVERLAYS.items():
        objects = kube.render(overlay)
        assert not [o for o in objects if o["apiVersion"].startswith("cert-manager.io/")], name
        for sc in kube.specdec_containers(objects):
            assert not tls_files(sc) and not getattr(sc.config(), "auth_tokens_file", ""), f"{name} {sc.name}"
