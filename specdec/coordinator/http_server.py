"""The HTTP API's server: uvicorn, on the coordinator's own event loop.

``uvicorn.Server.serve()`` runs as one task on the loop that serves gRPC (no
thread, no second loop), on a socket bound here first, so a busy port fails
start-up with one clear line, as the gRPC port does. Signals stay the
coordinator's (uvicorn's own handlers are not installed): SIGTERM drains both
servers together (:meth:`HttpServer.drain`, beside
:meth:`specdec.serving.server.GrpcServer.drain`).

TLS: the coordinator's ``--tls-cert`` / ``--tls-key``; with ``--tls-ca`` a
client certificate signed by that CA is required, and with
``--tls-peer-identity`` a connection whose certificate names none of those
identities is closed before any request is read. The certificate is read at
start-up (the gRPC port also follows a renewed file; restart to renew this one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from specdec.serving.tls import ServerTls, certificate_identities, is_loopback

log = logging.getLogger("specdec.coordinator")


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server inside a process that handles its own signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class HttpServer:
    """``app`` (an ASGI application) on ``host:port`` (0: any free port)."""

    def __init__(self, app, host: str, port: int, tls: ServerTls | None = None,
                 peers: frozenset[str] | None = None):
        self.app, self.host, self.requested_port, self.tls, self.peers = app, host, port, tls, peers
        self.port: int | None = None
        self._socket: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    def bind(self) -> int:
        """Listen (not yet serving); OSError naming the address if it cannot. Returns the port."""
        address = f"[{self.host}]:{self.requested_port}" if ":" in self.host else f"{self.host}:{self.requested_port}"
        try:
            family, kind, proto, _, where = socket.getaddrinfo(
                self.host.strip("[]"), self.requested_port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
        except OSError as e:
            raise OSError(f"cannot serve the HTTP API on {address}: {e}") from None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT, never a listening one
            sock.bind(where)
            sock.listen(2048)
        except OSError:
            sock.close()
            raise OSError(f"cannot serve the HTTP API on {address} (--http-port): the port is in use, or the host "
                          "is not an address of this machine") from None
        sock.setblocking(False)
        self._socket, self.port = sock, sock.getsockname()[1]
        if self.tls is None and not is_loopback(self.host):
            log.warning("the HTTP API on %s:%d is served without TLS: anyone who reaches it may call; give "
                        "--tls-cert and --tls-key", self.host, self.port)
        return self.port

    async def start(self) -> None:
        """Serve, as a task of this loop, once :meth:`bind` has listened."""
        assert self._socket is not None, "bind() first"
        self._server = _EmbeddedServer(uvicorn.Config(self.app, **self._options()))
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started and not self._task.done():
            await asyncio.sleep(0.005)
        if self._task.done():
            self._socket.close()  # (uvicorn failed before it took the socket over)
            try:
                self._task.result()  # its start-up error: a TLS file it could not load, ...
            except OSError as e:
                files = " with --tls-cert / --tls-key / --tls-ca" if self.tls is not None else ""
                raise OSError(f"cannot serve the HTTP API on {self.host}:{self.port}{files}: {e}") from e
            raise OSError("the HTTP API server stopped as it started")
        scheme = "https" if self.tls else "http"
        log.info("OpenAI-compatible HTTP API on %s://%s:%d/v1", scheme, self.host, self.port)

    def _options(self) -> dict:
        options = dict(log_config=None, access_log=False, lifespan="off", server_header=False,
                       timeout_graceful_shutdown=0, http="h11")
        if self.tls is not None:
            options.update(ssl_certfile=self.tls.cert, ssl_keyfile=self.tls.key)
            if self.tls.ca:
                options.update(ssl_ca_certs=self.tls.ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
            if self.tls.ca and self.peers is not None:
                options["http"] = identity_checked(self.peers)
        return options

    async def drain(self, grace_s: float) -> None:
        """Take no new connections; give the requests in flight ``grace_s``
        seconds to finish, then cancel them (their turns end their sessions)."""
        if self._server is None or self._task is None:
            return
        # (a moment even for none: closing the listener and idle connections takes one)
        self._server.config.timeout_graceful_shutdown = max(0.1, grace_s)
        self._server.should_exit = True
        await asyncio.wait([self._task])
        log.info("stopped the HTTP API on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        """Stop at once: the requests in flight are cancelled."""
        if self._server is None or (self._task is not None and self._task.done()):  # never served, or failed to
            if self._socket is not None:
                self._socket.close()
            return
        await self.drain(0)


def identity_checked(peers: frozenset[str]) -> type:
    """uvicorn's HTTP/1.1 protocol, closing a connection whose client
    certificate names none of ``peers`` (``--tls-peer-identity``)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class IdentityChecked(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            ssl_object = transport.get_extra_info("ssl_object")
            der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
            names = certificate_identities(ssl.DER_cert_to_PEM_cert(der).encode()) if der else frozenset()
            if not names & peers:
                log.info("HTTP API: closed a connection whose certificate names %s, none of the identities "
                         "accepted (--tls-peer-identity)", sorted(names) or "no identity")
                transport.close()

    return IdentityChecked
