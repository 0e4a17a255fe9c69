"""``specdec coordinator``: the client-facing service (default port 50051), and
its OpenAI-compatible HTTP API (``--http-port``, default 8000; 0: off).

    specdec coordinator --draft HOST:PORT --target HOST:PORT [--port 50051] [--http-port 8000] [--tokenizer DIR]

It holds no model: it drives rounds between a draft service and a target service
and keeps each session's token history. The gRPC server and the HTTP server
run on one event loop and share one :class:`ClientStreams` (limits, drain),
one set of tokens and the TLS settings. Every flag falls back to an environment
variable (``SPECDEC_COORDINATOR_PORT``, ``SPECDEC_COORDINATOR_DRAFT`` ...; see
``--help``), then to a default.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging

from specdec.coordinator.http_server import HttpServer
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import errors
from specdec.serving.config import CoordinatorConfig, add_flags
from specdec.serving.server import (
    COORDINATOR_SERVICE,
    GrpcServer,
    bind_or_close,
    freeze_startup_objects,
    serve_until_signal,
    setup_logging,
)
from specdec.telemetry.setup import ServiceTelemetry, start_telemetry

log = logging.getLogger("specdec.coordinator")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CoordinatorConfig)


@dataclasses.dataclass
class RunningCoordinator:
    """A started coordinator (for ``run`` below, ``specdec serve`` and tests)."""

    server: GrpcServer
    engine: object
    port: int
    telemetry: ServiceTelemetry | None = None
    servicer: object = None
    watcher: asyncio.Task | None = None  # the directory's reachability -> health
    checking: asyncio.Task | None = None  # the first check of the model pair
    http: HttpServer | None = None  # the OpenAI-compatible API (--http-port)

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    @property
    def servers(self) -> list:
        """What SIGTERM drains: the gRPC server, and the HTTP server if it runs."""
        return [self.server] + ([self.http] if self.http is not None else [])

    async def stop(self, grace_s: float | None = None) -> None:
        if grace_s is None:
            await asyncio.gather(*(server.stop() for server in self.servers))
        else:
            if self.servicer is not None:
                await self.servicer.shutting_down(grace_s)
            await asyncio.gather(*(server.drain(grace_s) for server in self.servers))
        await self.finish_work()
        if self.telemetry is not None:
            self.telemetry.close()

    async def finish_work(self) -> None:
        """After the server has stopped: give the requests it cut short up to the
        info timeout to end their sessions in both services, then close the
        channels."""
        await asyncio.sleep(0.05)  # the cancelled calls' handlers start their cleanups on this loop
        streams = self.servicer.streams if self.servicer is not None else None
        pending = set(streams.turns) | set(streams.closing) if streams is not None else set()
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.engine.config.info_timeout_s)
            if late:
                log.warning("%d cancelled requests still ending after %.0f s: closing their channels",
                            len(late), self.engine.config.info_timeout_s)
        if self.watcher is not None:
            self.watcher.cancel()
        if self.checking is not None:
            self.checking.cancel()
        await self.engine.close()


async def start_coordinator(config: CoordinatorConfig, telemetry: ServiceTelemetry | None = None) -> RunningCoordinator:
    """Load the tokenizer, listen, report SERVING, and check the model pair (a
    pair that is not up yet is checked again at the first request). ``telemetry``
    adds tracing/metrics interceptors and the ``/metrics`` endpoint."""
    from specdec.coordinator.admission import ClientLimits, StreamLimits
    from specdec.coordinator.engine import Coordinator
    from specdec.coordinator.service import CoordinatorServicer
    from specdec.coordinator.streams import ClientStreams
    from specdec.coordinator.tokenizer_source import TokenizerSource
    from specdec.serving.auth import parse_tokens

    tokenizers = TokenizerSource.for_config(config)
    if config.tokenizer == "none":
        log.warning("no tokenizer (--tokenizer none): only prompt_ids requests work, deltas carry no text")
    if telemetry is not None:  # first: a busy metrics port fails before anything listens
        telemetry.serve_metrics(config.host)
    try:
        engine = Coordinator(config, tokenizers=tokenizers, metrics=telemetry.metrics if telemetry else None)
    except BaseException:
        if telemetry is not None:
            telemetry.close()
        raise
    # A dns:/// pool's first lookup, before the first request needs its replicas.
    await asyncio.gather(*(pool.resolve_now() for pool in engine.pools.values()))
    tokens = parse_tokens(config.auth_tokens, config.auth_tokens_file)  # once, for both servers
    server = GrpcServer([COORDINATOR_SERVICE], max_message_bytes=config.max_message_bytes,
                        metrics=telemetry.metrics if telemetry else None, tokens=tokens,
                        reflection=config.reflection, tls=config.server_tls, peers=config.peer_identities)
    limits = ClientLimits(config.client_max_streams, config.client_rate, config.client_burst)
    streams = StreamLimits(config.max_streams, config.max_stream_memory_mb << 20)
    clients = ClientStreams(engine, streams, limits)  # one for both servers: their streams count together
    servicer = CoordinatorServicer(engine, clients=clients)
    pb_grpc.add_CoordinatorServicer_to_server(servicer, server.server)
    http = make_http_server(config, engine, clients, server, tokens, telemetry) if config.http_port else None
    try:
        port = await bind_or_close(server, config, telemetry)
    except OSError:
        await engine.close()
        raise
    if http is not None:
        try:
            http.bind()  # a busy port fails here, as the gRPC port does above
        except OSError:
            await server.stop()
            await engine.close()
            if telemetry is not None:
                telemetry.close()
            raise
    await server.start()
    if http is not None:
        try:
            await http.start()  # uvicorn loads the TLS files here: a bad one fails start-up, and stops gRPC
        except BaseException:
            await http.stop()
            await server.stop()
            await engine.close()
            if telemetry is not None:
                telemetry.close()
            raise
    await server.set_serving(await directory_reachable(engine.directory))
    log.info("coordinator serving specdec.v1.Coordinator on %s:%d (draft %s, target %s, tokenizer %s, "
             "sessions %s, %s)", config.host, port, config.draft, config.target,
             tokenizers.directory or ("the target's" if tokenizers.from_target else "none"),
             f"in Redis at {engine.directory.where}" if config.redis else "in memory",
             f"{len(tokens.by_digest)} clients by token" if tokens else "no authentication")
    def checked(future: asyncio.Future) -> None:
        if not future.cancelled() and future.exception() is not None:  # not fatal: Generate checks again
            log.warning("model pair not checked yet (%s); will check at the first request", future.exception())

    # In the background: the services may still be loading their models.
    checking = asyncio.create_task(engine.pair())
    checking.add_done_callback(checked)
    watcher = asyncio.create_task(watch_directory(server, engine.directory)) if config.redis else None
    return RunningCoordinator(server, engine, port, telemetry, servicer, watcher, checking, http)


def make_http_server(config: CoordinatorConfig, engine, clients, server: GrpcServer, tokens,
                     telemetry: ServiceTelemetry | None) -> HttpServer:
    """The OpenAI-compatible API on ``--http-port``: the gRPC server's tokens,
    streams, limits and TLS; healthy while the gRPC server is SERVING."""
    from specdec.coordinator.openai_api import OpenAIApi, make_app

    api = OpenAIApi(engine, clients, config, serving=lambda: server.serving and not server.draining)
    app = make_app(api, max_body_bytes=config.max_message_bytes, tokens=tokens,
                   metrics=telemetry.metrics if telemetry else None)
    return HttpServer(app, config.host, config.http_port, tls=config.server_tls, peers=config.peer_identities)


async def directory_reachable(directory, quiet: bool = False) -> bool:
    """Whether the session directory takes writes now (logged when it does not,
    unless ``quiet``): its check writes (Redis: a key of its own, short-lived), so
    a Redis that answers PING but refuses writes (full, under ``noeviction``) fails it."""
    try:
        await directory.check()
        return True
    except errors.Unavailable as e:
        if not quiet:
            log.warning("%s; health NOT_SERVING until it answers", e)
        return False


async def watch_directory(server: GrpcServer, directory, every_s: float = 1.0) -> None:
    """Health NOT_SERVING while the shared session directory cannot be reached or
    written (a load balancer then sends new work to other coordinators; the
    turns in flight wait for it, see ``--directory-outage``), SERVING again when
    it takes writes."""
    reachable = server.serving
    while True:
        await asyncio.sleep(every_s)
        now = await directory_reachable(directory, quiet=not reachable)  # one line per outage
        if now != reachable:
            if now:
                log.info("the session directory is reachable again: serving")
            await server.set_serving(now)
            reachable = now


def run(args: argparse.Namespace) -> int:
    config = CoordinatorConfig.load(vars(args))
    setup_logging(config.log_level)
    telemetry = start_telemetry("coordinator", config.trace_file, config.metrics_port)

    async def main() -> None:
        coordinator = await start_coordinator(config, telemetry)
        freeze_startup_objects("coordinator")
        try:
            await serve_until_signal(coordinator.servers, config.drain_grace_s,
                                     before_drain=coordinator.servicer.shutting_down)
        finally:
            await coordinator.finish_work()

    asyncio.run(main())
    log.info("coordinator exited cleanly")
    return 0
