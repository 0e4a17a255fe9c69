"""Client authentication on the coordinator: bearer tokens, each with a client name.

A request carries ``authorization: Bearer TOKEN`` in its metadata; the server's
interceptor (:mod:`specdec.serving.interceptor`) checks it before the handler
runs, for every RPC but gRPC health, and makes the client's name current
(:func:`current_client`) for the handler: sessions belong to the client that
created them. A missing or unknown token is UNAUTHENTICATED.

Tokens come from ``--auth-tokens-file`` (one ``NAME TOKEN`` a line, ``#``
comments) or ``--auth-tokens`` (``NAME:TOKEN,NAME:TOKEN``: for the environment
variable, not the command line, where every process could read it). Only their
SHA-256 digests are kept, and a token is compared with every known one in
constant time, so neither timing nor a memory dump gives one away.
"""

from __future__ import annotations

import contextvars
import dataclasses
import hashlib
import hmac
import pathlib
import re

from specdec.serving import errors

METADATA_KEY = "authorization"
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}")

# The client of the call being handled ("" : authentication is off).
_client: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_client", default="")

# What needs no token: a load balancer's or kubelet's health probe.
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


def current_client() -> str:
    """The authenticated client's name in the call being handled; "" when the
    server authenticates no one."""
    return _client.get()


# The address of the call being handled, less its port, where a servicer sets it.
_peer: contextvars.ContextVar[str] = contextvars.ContextVar("specdec_peer", default="")


def current_caller() -> str:
    """Who the call being handled counts against for per-client limits: its
    client's name, or without authentication its address (see :func:`enter_peer`;
    "" where neither is known)."""
    return _client.get() or _peer.get()


def enter_peer(host: str) -> None:
    """Make ``host`` (the caller's address, less its port) the current context's
    caller (the coordinator runs each turn in a context of its own)."""
    _peer.set(host)


@dataclasses.dataclass(frozen=True)
class Tokens:
    """The clients that may call, by the SHA-256 of their token."""

    by_digest: dict[bytes, str]

    def client(self, metadata) -> str:
        """The client a call's metadata authenticates; Unauthenticated otherwise."""
        given = next((value for key, value in metadata or () if key == METADATA_KEY), None)
        if given is None:
            raise errors.Unauthenticated("no credentials: send 'authorization: Bearer <token>' metadata")
        scheme, _, token = str(given).partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthenticated("the authorization metadata must be 'Bearer <token>'")
        digest = hashlib.sha256(token.strip().encode()).digest()
        found = ""
        for known, name in self.by_digest.items():  # every one, whichever matches: constant time
            if hmac.compare_digest(digest, known):
                found = name
        if not found:
            raise errors.Unauthenticated("the token is not one this coordinator accepts")
        return found

    def enter(self, metadata) -> contextvars.Token:
        """Authenticate a call and make its client current (undo with :func:`leave`)."""
        return _client.set(self.client(metadata))


def leave(token: contextvars.Token) -> None:
    _client.reset(token)


def parse_tokens(pairs: str = "", file: str = "") -> Tokens | None:
    """The tokens of ``--auth-tokens`` and ``--auth-tokens-file`` together; None
    when both are empty (authentication off). ValueError names what is wrong,
    never a token."""
    entries: list[tuple[str, str, str]] = []  # (name, token, where)
    for i, item in enumerate(p for p in pairs.split(",") if p.strip()):
        name, sep, token = item.strip().partition(":")
        entries.append((name if sep else "", token, f"--auth-tokens entry {i + 1}"))
    if file:
        path = pathlib.Path(file)
        if not path.is_file():
            raise ValueError(f"--auth-tokens-file {file}: no such file")
        for n, line in enumerate(path.read_text().splitlines(), 1):
            line = line.strip()
            if line and not line.startswith("#"):
                line = re.split(r"\s#", line, maxsplit=1)[0].strip()  # a comment after the entry, not a # in a token
                name, _, token = line.partition(" ")
                entries.append((name, token.strip(), f"{file} line {n}"))
    if not entries:
        return None
    by_digest: dict[bytes, str] = {}
    for name, token, where in entries:
        # The messages name where, never what: a NAME that is really a token must not reach a log.
        if not _NAME.fullmatch(name):
            raise ValueError(f"{where}: expected NAME TOKEN (or NAME:TOKEN), NAME of letters, digits and _.@-")
        if len(token) < 16:
            raise ValueError(f"{where}: the token is shorter than 16 characters")
        digest = hashlib.sha256(token.encode()).digest()
        if digest in by_digest:
            raise ValueError(f"{where}: the same token as another entry")
        by_digest[digest] = name
    return Tokens(by_digest)
