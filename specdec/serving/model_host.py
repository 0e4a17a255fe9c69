"""What the draft and target services share: the host that composes their
model (:mod:`specdec.serving.model_worker`) with their session store
(:mod:`specdec.serving.sessions`) and answers ModelInfo, EndSession and
GetTokenizer; and the process entry point.

The servicers in ``specdec/draft_service/`` and ``specdec/target_service/`` only say what their
RPC does (decode -> validate (:mod:`specdec.serving.validation`) ->
:func:`specdec.models.local.draft_steps` / ``verify_steps`` on the worker ->
encode), and what their sessions are (a :class:`ServiceRole`, passed in when
the service starts); everything else is written once.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import pathlib
import time
from collections.abc import Callable
from typing import Any

from specdec.models.runner import ModelRunner
from specdec.models.tokenizer import tokenizer_files
from specdec.proto import specdec_pb2 as pb
from specdec.serving.config import CONFIG_CLASSES, ServiceConfig
from specdec.serving.errors import NotFound
from specdec.serving.model_worker import ModelWorker
from specdec.serving.server import (
    DRAFT_SERVICE,
    TARGET_SERVICE,
    GrpcServer,
    bind_or_close,
    freeze_startup_objects,
    serve_until_signal,
    setup_logging,
)
from specdec.serving.sessions import SessionKind, SessionStore
from specdec.serving.validation import check_session_id
from specdec.telemetry.metrics import ServiceMetrics
from specdec.telemetry.setup import ServiceTelemetry, start_telemetry

log = logging.getLogger(__name__)

SERVICE_NAMES = {"draft": DRAFT_SERVICE, "target": TARGET_SERVICE}
# A session with a call this recent is taken to be in the middle of a generation
# (its calls come one round apart: milliseconds, or a few round trips).
GENERATION_GAP_S = 2.0
# GetTokenizer's pieces: well inside any gRPC message limit.
TOKENIZER_CHUNK = 1 << 20


class ModelHost:
    """One model on one device (``worker``), serving many sessions (``sessions``,
    once the model is loaded) of the given kind."""

    def __init__(self, config: ServiceConfig, kind: SessionKind, metrics: ServiceMetrics | None = None):
        self.config = config
        self.kind = kind
        self.metrics = metrics  # what the servicers count beyond the RPCs
        self.worker = ModelWorker(config, metrics)
        self.sessions: SessionStore | None = None
        self._sweeper: asyncio.Future | None = None

    async def load(self, runner: ModelRunner | None = None) -> None:
        """Load the model off the event loop (``runner``: an already-loaded one),
        then start its scheduler and open the session store."""
        cfg, kind = self.config, self.kind
        if runner is None:
            runner = await self.worker.load(kind.kv_headroom)
        budget = session_budget(cfg, runner, kind.kv_headroom(runner.kv_block_size))
        self.worker.start(runner)
        self.sessions = SessionStore(
            lambda: kind.new_state(runner),
            max_sessions=cfg.max_sessions,
            max_cached_tokens=budget,
            ttl_s=cfg.session_ttl_s,
            size=kind.size,
            granule=runner.kv_block_size,
        )
        self._sweeper = asyncio.ensure_future(self.sessions.expire_forever())

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.worker.close()

    # ------------------------------------------------------------------ shared RPCs

    def model_info(self) -> pb.ModelInfo:
        runner = self.worker.require_ready()
        stats = self.sessions.stats()
        return pb.ModelInfo(
            model_name=runner.name,
            vocab_size=runner.vocab_size,
            vocab_fingerprint=runner.fingerprint,
            max_context=runner.max_context,
            eos_token_ids=sorted(runner.eos_token_ids),
            device=str(runner.device),
            active_sessions=stats.active_sessions,
            cached_tokens=stats.cached_tokens,
            gamma_max=self.config.gamma_max,
            kv_bytes_per_token=runner.kv_bytes_per_token,
            kv_budget_tokens=self.sessions.max_cached_tokens,
            architecture=runner.architecture,
            kv_block_size=runner.kv_block_size,
            has_tokenizer=bool(tokenizer_files(runner.path)),
        )

    async def tokenizer_chunks(self):
        """(file name, bytes) pieces of the model's tokenizer files, each at most
        TOKENIZER_CHUNK bytes, read off the event loop; NotFound when it has none."""
        runner = self.worker.require_ready()
        files = tokenizer_files(runner.path)
        if not files:
            raise NotFound(f"the {self.config.role} model {runner.name} has no tokenizer files")
        for path in files:
            data = await asyncio.to_thread(path.read_bytes)
            for start in range(0, max(1, len(data)), TOKENIZER_CHUNK):
                yield path.name, data[start:start + TOKENIZER_CHUNK]

    def end_session(self, request: pb.EndSessionRequest) -> pb.EndSessionResponse:
        self.worker.require_ready()
        check_session_id(request.session_id)
        return pb.EndSessionResponse(existed=self.sessions.end(request.session_id))


def session_budget(config: ServiceConfig, runner: ModelRunner, headroom: int) -> int:
    """The sessions' KV budget: ``--max-cached-tokens``, within what ``runner``'s
    pool holds beside ``headroom`` positions; ValueError if no session fits."""
    budget = min(config.max_cached_tokens, runner.kv_capacity - headroom)
    if budget < runner.kv_block_size:
        raise ValueError(f"the {config.role} model's KV pool holds {runner.kv_capacity} positions, too few for "
                         f"{headroom} positions of drafting ahead and any session: "
                         "lower --max-sessions or --gamma-max, or raise --kv-memory-fraction")
    return budget


@dataclasses.dataclass(frozen=True)
class ServiceRole:
    """What one model service brings to the shared host, passed in when it starts:
    its ``name`` (``draft`` or ``target``: its settings and gRPC service);
    ``add_servicer(host, grpc_server)`` registers its RPCs; ``session_kind(config)``
    says what its sessions are (:class:`~specdec.serving.sessions.SessionKind`)."""

    name: str
    add_servicer: Callable[[ModelHost, Any], None]
    session_kind: Callable[[ServiceConfig], SessionKind]


# ====================================================================== process entry


@dataclasses.dataclass
class RunningService:
    """A started model service (for ``run`` below, ``specdec serve`` and tests)."""

    server: GrpcServer
    host: ModelHost
    port: int
    telemetry: ServiceTelemetry | None = None

    async def finish_generations(self, within_s: float, gap_s: float = GENERATION_GAP_S) -> None:
        """On SIGTERM, before the server stops taking calls: health NOT_SERVING,
        no new sessions (refused UNAVAILABLE), and up to ``within_s`` seconds for
        the generations going through this service to end, i.e. until no session
        it holds has had a call for ``gap_s``. A generation is many calls, so
        finishing only the calls in flight would cut every stream in a rolling
        restart."""
        await self.server.stop_serving()
        sessions = self.host.sessions
        if sessions is None:  # still loading: nothing in flight
            return
        sessions.accept_new = False
        deadline = time.monotonic() + within_s
        if sessions.quiet_for() < gap_s:
            log.info("%s service: finishing the generations in flight (up to %.0f s)", self.host.config.role, within_s)
        while sessions.quiet_for() < gap_s and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def stop(self, grace_s: float | None = None) -> None:
        self.host.worker.drain()
        if grace_s is None:
            await self.server.stop()
        else:
            await self.server.drain(grace_s)
        self.host.close()
        if self.telemetry is not None:
            self.telemetry.close()


async def start_model_service(
    config: ServiceConfig,
    role: ServiceRole,
    *,
    runner: ModelRunner | None = None,
    wait_loaded: bool = True,
    telemetry: ServiceTelemetry | None = None,
    freeze_after_load: bool = False,
) -> tuple[RunningService, asyncio.Task]:
    """Listen first (health NOT_SERVING), load the model off the event loop, then
    report SERVING. ``role``: the draft's or the target's RPCs and sessions.
    Returns the service and the loading task (already finished when
    ``wait_loaded``). ``runner`` skips loading (an already-loaded model).
    ``telemetry`` adds tracing/metrics interceptors and the ``/metrics`` endpoint;
    ``freeze_after_load``: the process's objects are frozen once the model is
    loaded (:func:`specdec.serving.server.freeze_startup_objects`; service processes only)."""
    metrics = telemetry.metrics if telemetry is not None and isinstance(telemetry.metrics, ServiceMetrics) else None
    host = ModelHost(config, role.session_kind(config), metrics)
    if telemetry is not None:  # first: a busy metrics port fails before anything listens
        telemetry.serve_metrics(config.host, sessions=lambda: host.sessions.stats() if host.sessions else None)
    server = GrpcServer([SERVICE_NAMES[config.role]], max_message_bytes=config.max_message_bytes,
                        metrics=telemetry.metrics if telemetry else None, reflection=config.reflection,
                        tls=config.server_tls, peers=config.peer_identities)
    role.add_servicer(host, server.server)
    port = await bind_or_close(server, config, telemetry)
    await server.start()
    log.info("%s service listening on %s:%d (loading model %s on %s)",
             config.role, config.host, port, runner.path if runner else config.model_path(), config.device)

    async def load():
        try:
            await host.load(runner)
        except BaseException:
            await server.stop()
            host.close()
            raise
        if freeze_after_load:
            freeze_startup_objects(f"{config.role} service")
        await server.set_serving(True)
        r = host.worker.runner
        log.info("serving %s model %s (vocab %d, context %d, %s) on %s at %s:%d", config.role, r.path, r.vocab_size,
                 r.max_context, config.dtype, r.device, config.host, port)
        budget = host.sessions.max_cached_tokens
        log.info("%s KV budget: %d tokens x %d bytes per token = %.0f MiB in blocks of %d (%s attention); up to %d "
                 "sessions per forward pass", config.role, budget, r.kv_bytes_per_token,
                 budget * r.kv_bytes_per_token / (1 << 20), r.kv_block_size, r.forward.kernel,
                 host.worker.scheduler.max_sequences)

    task = asyncio.ensure_future(load())
    if wait_loaded:
        await task
    return RunningService(server, host, port, telemetry), task


def run_service(args: argparse.Namespace, service_role: ServiceRole) -> int:
    """``specdec draft-service`` / ``target-service``: serve until SIGTERM, drain, exit 0."""
    role = service_role.name
    config = CONFIG_CLASSES[role].load(vars(args))
    setup_logging(config.log_level)
    telemetry = start_telemetry(role, config.trace_file, config.metrics_port)
    model = pathlib.Path(config.model_path())
    if not (model / "config.json").is_file():  # fail before listening, with a hint
        hint = "" if config.model else f" (the bundled {role} model is missing: pass --model DIR)"
        raise ValueError(f"{model} is not a model directory (no config.json){hint}")

    async def main() -> int:
        service, loading = await start_model_service(config, service_role, wait_loaded=False, telemetry=telemetry,
                                                     freeze_after_load=True)
        try:
            # A signal during loading drains too; a failed load ends the process.
            await serve_until_signal(service.server, config.drain_grace_s, stop=_failed(loading),
                                     before_drain=service.finish_generations)
        finally:
            service.host.close()
        if loading.done() and not loading.cancelled() and loading.exception() is not None:
            e = loading.exception()
            log.error("could not load the %s model from %s: %s: %s", role, model, type(e).__name__, e)
            return 1
        loading.cancel()
        log.info("%s service exited cleanly", role)
        return 0

    return asyncio.run(main())


async def _failed(task: asyncio.Task) -> None:
    """Completes only if ``task`` fails (its success must not stop the server)."""
    try:
        await asyncio.shield(task)
    except BaseException:
        return
    await asyncio.Event().wait()  # loaded fine: wait forever (until cancelled)
