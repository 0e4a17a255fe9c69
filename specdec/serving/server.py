"""Server hygiene shared by the draft, target and coordinator services.

:class:`GrpcServer` is a grpc.aio server with everything a specdec service needs
besides its own servicer:

* message size limits large enough for dense distributions (configurable);
* the one interceptor (:class:`specdec.serving.interceptor.ServiceInterceptor`):
  handlers just raise, and every call is traced and counted;
* the standard health service: NOT_SERVING from start until :meth:`set_serving`
  (i.e. until the model is loaded) and again while draining;
* server reflection (``grpcurl`` can list and call the services);
* optionally a second, plaintext port answering health checks only
  (:meth:`GrpcServer.bind_health`): the kubelet's gRPC probes cannot speak TLS;
* graceful drain: :func:`serve_until_signal` waits for SIGTERM/SIGINT, flips
  health to NOT_SERVING, stops accepting calls, lets in-flight calls finish
  within a grace period and returns, so the process exits 0.

Typical use (what every service's ``run`` does)::

    server = GrpcServer(["specdec.v1.Coordinator"], max_message_bytes=64 << 20)
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server.server)
    port = server.bind("0.0.0.0", 50051)
    await server.start()
    await server.set_serving(True)
    await serve_until_signal(server, grace_s=30)
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection

from specdec.serving import auth
from specdec.serving.interceptor import ServiceInterceptor
from specdec.serving.tls import ServerTls, is_loopback, server_credentials
from specdec.telemetry.metrics import RpcMetrics

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# The health service name a liveness probe asks for: SERVING from start-up to drain.
LIVENESS = "liveness"

# Fully qualified service names, as health checks and reflection know them.
DRAFT_SERVICE = "specdec.v1.DraftService"
TARGET_SERVICE = "specdec.v1.TargetService"
COORDINATOR_SERVICE = "specdec.v1.Coordinator"


def setup_logging(level: str = "INFO") -> None:
    """One log format for every service; ``SPECDEC_LOG_LEVEL`` or the config sets the level."""
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def freeze_startup_objects(what: str) -> None:
    """Put every object alive now out of the garbage collector's reach
    (``gc.freeze``), once a service has started: the model, the libraries'
    modules and the rest live as long as the process. A loaded model service
    holds ~400,000 such objects, and each full collection walks them all:
    hundreds of milliseconds of CPU, a stall for whichever round it falls in.
    Afterwards a full collection walks only what came later.

    Only the service processes' own ``run`` calls it: frozen objects are never
    collected, and a test process starts and stops many services."""
    gc.collect()  # garbage is not frozen
    gc.freeze()
    log.info("%s: %d objects alive after start-up frozen (the garbage collector skips them)",
             what, gc.get_freeze_count())


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC options for a channel or server exchanging messages up to this size
    (use the same limit on clients of a service)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


class GrpcServer:
    """A grpc.aio server with health, reflection, the one interceptor and limits.
    ``metrics``: the service's RPC metrics (None: not counted); ``tokens``: the
    clients that may call (None: anyone); ``reflection``: serve gRPC reflection;
    ``tls``: serve TLS only (None: plaintext); ``peers``: with mutual TLS, the
    client certificate identities accepted (None: any the CA signed)."""

    def __init__(self, service_names: Sequence[str], *, max_message_bytes: int = 64 << 20,
                 metrics: RpcMetrics | None = None, tokens: auth.Tokens | None = None, reflection: bool = True,
                 tls: ServerTls | None = None, peers: frozenset[str] | None = None):
        self.service_names = list(service_names)
        self.tls = tls
        self.server = grpc.aio.server(
            interceptors=[ServiceInterceptor(metrics, tokens, peers)],
            options=[
                *channel_options(max_message_bytes),
                # Fail loudly if the port is taken, instead of sharing it silently.
                ("grpc.so_reuseport", 0),
            ],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflection:
            grpc_reflection.enable_server_reflection(
                [*self.service_names, health.SERVICE_NAME, grpc_reflection.SERVICE_NAME], self.server
            )
        self.health_server: grpc.aio.Server | None = None  # see bind_health
        self.port: int | None = None
        self.address: str | None = None
        self.draining = False
        self.serving = False

    def bind(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0: any free port). Returns the bound port."""
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        try:
            if self.tls is not None:
                bound = self.server.add_secure_port(address, server_credentials(self.tls))
            else:
                bound = self.server.add_insecure_port(address)
                if not is_loopback(host):
                    log.warning("listening on %s without TLS: anyone who reaches it may call; give --tls-cert "
                                "and --tls-key (and --tls-ca for mutual TLS)", address)
        except RuntimeError:  # grpc raises RuntimeError when it cannot bind (and logs why)
            raise OSError(f"cannot listen on {address}: the port is in use, or the host is not "
                          f"an address of this machine") from None
        if bound == 0:
            raise OSError(f"cannot listen on {address} (address in use?)")
        self.port = bound
        self.address = f"{host}:{bound}"
        return bound

    def bind_health(self, host: str, port: int) -> int:
        """Answer gRPC health checks, and nothing else, in plaintext on
        ``host:port`` too: for the kubelet's gRPC probes, which cannot speak TLS.
        The answers are those of the service port (one health servicer). Returns
        the bound port."""
        # The interceptor without metrics or checks: a body that does not parse
        # is answered INVALID_ARGUMENT there too (health calls make no span).
        self.health_server = grpc.aio.server(interceptors=[ServiceInterceptor()],
                                             options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        try:
            bound = self.health_server.add_insecure_port(address)
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {address} for health checks: the port is in use, or the host is "
                          f"not an address of this machine")
        log.info("gRPC health checks, in plaintext, on %s too", address)
        return bound

    async def start(self) -> None:
        """Start answering calls; health stays NOT_SERVING until :meth:`set_serving`,
        but for ``liveness``, SERVING while the process answers at all (what a
        liveness probe asks: a service waiting on Redis must not be restarted)."""
        await self._set_health(NOT_SERVING)
        await self.health.set(LIVENESS, SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def set_serving(self, serving: bool) -> None:
        if self.draining and serving:
            return
        self.serving = serving
        await self._set_health(SERVING if serving else NOT_SERVING)

    async def _set_health(self, status) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop_serving(self) -> None:
        """Health NOT_SERVING, for good: load balancers send no new work. Calls
        are still answered (see :meth:`drain`)."""
        self.serving = False
        await self.health.enter_graceful_shutdown()  # every service, and later set()s are ignored

    async def drain(self, grace_s: float) -> None:
        """Health NOT_SERVING, refuse new calls, give in-flight calls ``grace_s``
        seconds to finish (then cancel them)."""
        if self.draining:
            return
        self.draining = True
        await self.stop_serving()
        log.info("draining %s: finishing in-flight calls (grace %.0f s)", self.address, grace_s)
        await self.server.stop(grace_s)  # (the health port answers NOT_SERVING meanwhile)
        await self._stop_health()
        log.info("stopped %s", self.address)

    async def stop(self) -> None:
        """Stop at once (tests)."""
        self.draining = True
        await self.server.stop(None)
        await self._stop_health()

    async def _stop_health(self) -> None:
        if self.health_server is not None:
            await self.health_server.stop(None)


async def bind_or_close(server: GrpcServer, config, telemetry=None) -> int:
    """:meth:`GrpcServer.bind` to ``config.host`` and ``config.port``, and
    :meth:`GrpcServer.bind_health` to ``config.health_port`` if set; if either
    fails, stop the server (and the metrics endpoint) before raising, so the
    process exits with the message alone. Returns the service port."""
    try:
        port = server.bind(config.host, config.port)
        if config.health_port:
            server.bind_health(config.host, config.health_port)
        return port
    except OSError:
        await server.stop()
        if telemetry is not None:
            telemetry.close()
        raise


async def wait_for_signal(signals: Iterable[int] = (signal.SIGTERM, signal.SIGINT)) -> int:
    """Return the first of ``signals`` this process receives."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[int] = loop.create_future()
    installed = []
    for sig in signals:
        try:
            loop.add_signal_handler(sig, lambda s=sig: got.done() or got.set_result(s))
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread / not POSIX
            pass
    try:
        return await got
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


async def serve_until_signal(
    servers: GrpcServer | Sequence[GrpcServer],
    grace_s: float,
    *,
    stop: Awaitable | None = None,
    before_drain: Callable[[float], Awaitable] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or until ``stop`` completes), then drain every
    server (in parallel; anything with ``drain(grace_s)``, such as the
    coordinator's HTTP server, may be one of them) and return. ``before_drain(grace_s)``, if given, runs
    first, and what it takes of the grace is not given to the drain."""
    servers = [servers] if isinstance(servers, GrpcServer) else list(servers)
    waiters = [asyncio.ensure_future(wait_for_signal())]
    if stop is not None:
        waiters.append(asyncio.ensure_future(stop))
    done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in done:
        if not task.cancelled() and task.exception() is None and isinstance(task.result(), int):
            log.info("received %s", signal.Signals(task.result()).name)
    if before_drain is not None:
        started = time.monotonic()
        await before_drain(grace_s)
        grace_s = max(0.0, grace_s - (time.monotonic() - started))
    await asyncio.gather(*(s.drain(grace_s) for s in servers))


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (for tests and ``serve``)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
