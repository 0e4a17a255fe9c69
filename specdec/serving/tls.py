"""TLS for every hop, and mutual TLS between the coordinator and the model services.

A service given ``--tls-cert`` and ``--tls-key`` serves TLS only; given
``--tls-ca`` too, it asks every client for a certificate signed by that CA
(mutual TLS), and with ``--tls-peer-identity`` accepts only clients whose
certificate names one of those identities: a certificate from the same CA
naming another identity is refused. Identities have a type, and a subject
alternative name matches only an identity of its own type: a URI (such as a
SPIFFE ID) only a URI SAN, a DNS name only a DNS SAN (case aside), so a DNS or
e-mail SAN spelling a URI names no URI. The coordinator reaches model services
over TLS when given ``--upstream-ca`` (and presents ``--upstream-cert`` /
``--upstream-key``).

The server re-reads its certificate, key and CA when their files change: the
next connection uses the new ones, connections already open (and their
streams) go on. The coordinator reads its upstream files again for each
replica client it makes (a replica that joins, or comes back at a new
address); a client already made keeps the certificate it was made with.
Incomplete settings fail at start-up; nothing falls back to plaintext.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
import logging
import os
import re
import ssl
import threading
from collections.abc import Callable

import grpc
from cryptography import x509

log = logging.getLogger(__name__)

# The peer's certificate, as gRPC's auth context gives it: its subject
# alternative names are read from it with their types (never the common name:
# a CA may let requesters choose it).
_PEER_CERT = "x509_pem_cert"
_SAN_TYPES = {"uri": x509.UniformResourceIdentifier, "dns": x509.DNSName, "email": x509.RFC822Name}
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
_DNS_NAME = re.compile(r"[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*")


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key, and the CA its clients must be signed by ("": none asked)."""

    cert: str
    key: str
    ca: str = ""

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert, self.key, self.ca) if f)


def check_settings(values: dict[str, str], needs: dict[str, tuple[str, ...]], names: tuple[str, ...] = ()) -> None:
    """Settings that only make sense together: ``needs[flag]`` are the flags
    ``flag`` needs; each given one not in ``names`` (values that are not files)
    must be an existing file. ValueError names the flags."""
    for flag, value in values.items():
        if not value:
            continue
        missing = [other for other in needs.get(flag, ()) if not values.get(other)]
        if missing:
            raise ValueError(f"{flag} needs {' and '.join(missing)} (TLS settings are never half applied)")
        if flag not in names and not os.path.isfile(value):
            raise ValueError(f"{flag} {value}: no such file")


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an IP, IPv6 in brackets or not) is this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """Credentials that re-read the files when they change, at the next handshake."""

    def configuration() -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(_read(tls.key), _read(tls.cert))], root_certificates=_read(tls.ca) if tls.ca else None)

    lock = threading.Lock()
    seen = {"stamp": _stamp(tls.files())}

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        stamp = _stamp(tls.files())
        with lock:
            if stamp == seen["stamp"]:
                return None
            try:
                new = configuration()
            except (OSError, ValueError, RuntimeError) as e:  # a rotation half written: the last good one stays
                log.warning("TLS files changed but could not be read (%s): keeping the certificate in use", e)
                return None  # (tried again at the next handshake)
            seen["stamp"] = stamp
        log.info("TLS certificate files changed: new connections use the new certificate")
        return new

    return grpc.dynamic_ssl_server_credentials(configuration(), fetch,
                                               require_client_authentication=bool(tls.ca))


def _stamp(files: tuple[str, ...]) -> tuple:
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


def channel_credentials(ca: str, cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """A client's TLS: the CA to verify the server with, and its own certificate (mutual TLS)."""
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key) if key else None,
                                        certificate_chain=_read(cert) if cert else None)


def renewed_channel_credentials(ca: str, cert: str = "", key: str = "") -> Callable[[], grpc.ChannelCredentials]:
    """``channel_credentials`` that follow the files: each call returns the
    credentials of the files as they are now (read again only when they
    changed; a half-written renewal keeps the last good ones). A channel keeps
    the credentials it was made with, so a client made after a renewal presents
    the renewed certificate."""
    files = tuple(f for f in (ca, cert, key) if f)
    lock = threading.Lock()
    state = {"stamp": _stamp(files), "credentials": channel_credentials(ca, cert, key)}

    def current() -> grpc.ChannelCredentials:
        stamp = _stamp(files)
        with lock:
            if stamp != state["stamp"]:
                try:
                    _check_pem(ca, cert, key)
                    state["credentials"], state["stamp"] = channel_credentials(ca, cert, key), stamp
                    log.info("upstream TLS files changed: clients made from now on present the new certificate")
                except OSError as e:  # (ssl.SSLError included) tried again at the next call
                    log.warning("upstream TLS files changed but could not be read (%s): keeping the last ones", e)
            return state["credentials"]

    return current


def _check_pem(ca: str, cert: str, key: str) -> None:
    """OSError (ssl.SSLError) unless the files parse and the key is the certificate's:
    gRPC itself would find out only at the next handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key or None)


def accepted_identities(text: str) -> frozenset[str]:
    """``--tls-peer-identity``'s comma-separated identities, each as its type
    and value: ``uri:URI`` or ``dns:NAME``. A ``uri:`` or ``dns:`` prefix says
    the type; without one, an identity with a scheme (``spiffe://…``,
    ``https://…``) is a URI, any other a DNS name. ValueError names one that is neither."""
    return frozenset(_typed(item.strip()) for item in text.split(",") if item.strip())


def _typed(identity: str) -> str:
    kind, sep, value = identity.partition(":")
    if not (sep and kind.lower() in ("uri", "dns")):
        kind, value = ("uri" if _SCHEME.match(identity) else "dns"), identity
    kind = kind.lower()
    if (kind == "uri" and not _SCHEME.match(value)) or (kind == "dns" and not _DNS_NAME.fullmatch(value)):
        raise ValueError(f"must be URIs (with a scheme, as spiffe://…, or uri:URI) or DNS names (NAME or "
                         f"dns:NAME): {identity!r} is neither")
    return f"dns:{value.lower()}" if kind == "dns" else f"uri:{value}"


def peer_identities(context) -> frozenset[str]:
    """The identities the calling peer's certificate names, each as its type
    and value (``uri:…``, ``dns:…``, ``email:…``), as :func:`accepted_identities`
    gives those accepted (empty: no certificate, or none readable)."""
    pem = next(iter((context.auth_context() or {}).get(_PEER_CERT, ())), None)
    if not pem:
        return frozenset()
    return certificate_identities(pem if isinstance(pem, bytes) else str(pem).encode())


@functools.lru_cache(maxsize=256)  # every call of a connection presents the same certificate
def certificate_identities(pem: bytes) -> frozenset[str]:
    """The subject alternative names of a PEM certificate, with their types."""
    try:
        names = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return frozenset()
    except (ValueError, x509.DuplicateExtension, x509.UnsupportedGeneralNameType) as e:
        log.warning("a peer's certificate could not be read for its identities: %s", e)
        return frozenset()
    typed = {kind: names.value.get_values_for_type(san) for kind, san in _SAN_TYPES.items()}
    typed["dns"] = [name.lower() for name in typed["dns"]]
    return frozenset(f"{kind}:{value}" for kind, values in typed.items() for value in values)
