"""What the draft and target services share: one model and the scheduler
that batches its passes, the session store, request validation, timings,
ModelInfo/EndSession, command-line flags and the process entry point.

The servicers in ``specdec/draft_service/`` and ``specdec/target_service/`` only say what their
RPC does (decode -> :func:`specdec.models.local.draft_steps` / ``verify_steps`` ->
encode); everything else is here, written once.

Why one model thread (:mod:`specdec.serving.scheduler`): forward passes are
long, blocking calls. Running them on the event loop would freeze health checks
and every other session; several threads would run passes on one device at once
for no gain. One thread per model serialises the device, batches the sessions'
passes, and leaves the loop free.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch

from specdec.core.interfaces import DraftToken, SamplingParams
from specdec.core.sampling import SparseDist
from specdec.core.vocabulary import check_token_ids
from specdec.models.local import DRAFT_BRANCHES, Steps
from specdec.models.runner import KVSettings, ModelRunner, Sequence, block_size_for
from specdec.models.tokenizer import tokenizer_files
from specdec.proto import specdec_pb2 as pb
from specdec.serving import convert as pc
from specdec.serving.config import CONFIG_CLASSES, ServiceConfig
from specdec.serving.errors import Draining, InvalidRequest, NotFound, Unavailable
from specdec.serving.names import MAX_SERVICE_NAME_LEN, check_name
from specdec.serving.scheduler import PassScheduler
from specdec.serving.server import (
    DRAFT_SERVICE,
    TARGET_SERVICE,
    GrpcServer,
    bind_or_close,
    freeze_startup_objects,
    serve_until_signal,
    setup_logging,
)
from specdec.serving.sessions import SessionStore
from specdec.serving.timing import ServerTiming
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
    """One model on one device, serving many sessions."""

    def __init__(self, config: ServiceConfig):
        self.config = config
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{config.role}-load")
        self.runner: ModelRunner | None = None
        self.scheduler: PassScheduler | None = None
        self.background: concurrent.futures.Future | None = None  # the last background work
        self.sessions: SessionStore[Sequence] | None = None
        self.draining = False
        self.metrics: ServiceMetrics | None = None  # what the servicers count beyond the RPCs
        # A session's state in this model, and how many tokens it holds (what
        # --max-cached-tokens bounds); the draft's servicer sets its own.
        self.new_state: Callable[[ModelRunner], Any] = ModelRunner.new_sequence
        self.state_size: Callable[[Any], int] = lambda seq: len(seq.tokens)
        self._sweeper: asyncio.Future | None = None

    # ------------------------------------------------------------------ lifecycle

    async def load(self, runner: ModelRunner | None = None) -> None:
        """Load the model on the executor (the event loop keeps answering health
        checks meanwhile), then open the session store."""
        cfg = self.config
        if runner is None:
            block = block_size_for(cfg.device, cfg.kv_block_size)
            kv = KVSettings(tokens=cfg.max_cached_tokens + self.kv_headroom(block), block_size=block,
                            memory_fraction=cfg.kv_memory_fraction, keep_behind=2 * cfg.gamma_max + 8,
                            kernel=None if cfg.attention_kernel == "auto" else cfg.attention_kernel)
            runner = await asyncio.get_running_loop().run_in_executor(
                self.executor,
                functools.partial(ModelRunner, cfg.model_path(), cfg.device, cfg.dtype, lean=cfg.lean_forward,
                                  cuda_graphs=cfg.cuda_graphs, kv=kv),
            )
        budget = min(cfg.max_cached_tokens, runner.kv_capacity - self.kv_headroom(runner.kv_block_size))
        if budget < runner.kv_block_size:
            raise ValueError(f"the {cfg.role} model's KV pool holds {runner.kv_capacity} positions, too few for "
                             f"{self.kv_headroom(runner.kv_block_size)} positions of drafting ahead and any session: "
                             "lower --max-sessions or --gamma-max, or raise --kv-memory-fraction")
        if cfg.max_batch > 1 and not runner.batched:
            log.info("%s service: one session per forward pass (%s's rotary embedding depends on the sequence "
                     "length)", cfg.role, runner.name)
        metrics = self.metrics
        self.scheduler = PassScheduler(
            runner, max_sequences=cfg.max_batch, max_tokens=cfg.max_batch_tokens, name=cfg.role,
            on_pass=metrics.observe_pass if metrics is not None else None,
            on_started=metrics.observe_queue_wait if metrics is not None else None)
        self.sessions = SessionStore(
            functools.partial(self.new_state, runner),
            max_sessions=self.config.max_sessions,
            max_cached_tokens=budget,
            ttl_s=self.config.session_ttl_s,
            size=self.state_size,
            granule=runner.kv_block_size,
        )
        self.runner = runner
        self._sweeper = asyncio.ensure_future(self._sweep_forever())

    def kv_headroom(self, block_size: int) -> int:
        """KV positions beyond the budget that drafting ahead may hold (draft
        service: per session at most γ + 3 on its own sequence, and on each of
        DRAFT_BRANCHES forks a copied block and γ + 1 more, in whole blocks); 0
        for the target."""
        cfg = self.config
        if cfg.role != "draft" or not getattr(cfg, "draft_ahead", False):
            return 0
        per_round = -(-(cfg.gamma_max + 3) // block_size) + 1
        return cfg.max_sessions * per_round * (1 + DRAFT_BRANCHES) * block_size

    async def _sweep_forever(self) -> None:
        """Expire idle sessions even when no call arrives to trigger it."""
        period = max(0.5, min(self.config.session_ttl_s / 4, 30.0))
        while True:
            await asyncio.sleep(period)
            self.sessions.sweep()

    def close(self) -> None:
        self.draining = True  # background work stops at its next step
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.scheduler is not None:
            self.scheduler.close()

    @property
    def ready(self) -> bool:
        return self.runner is not None

    def require_ready(self) -> ModelRunner:
        if self.draining:
            raise Draining(f"the {self.config.role} service is shutting down")
        if self.runner is None:
            raise Unavailable(f"the {self.config.role} service is still loading its model")
        return self.runner

    # ------------------------------------------------------------------ running model work

    async def run_steps(self, steps: Steps, timing: ServerTiming,
                        on_draft: Callable[[DraftToken], None] | None = None) -> Any:
        """Run a call's ``steps`` in the model's batched passes; what they return.
        ``timing`` gets its queue, compute and copy time and tokens run."""
        return await asyncio.wrap_future(self.scheduler.submit(steps, timing, on_draft))

    def run_in_background(self, steps: Steps) -> None:
        """Run ``steps`` in passes no call waits for (drafting ahead); they are
        closed when a call arrives. Their compute, copies and tokens go into the
        metrics like a call's: the device's load includes them. Failures are
        logged: they must not affect any call."""
        if self.draining or self.scheduler is None:
            return
        timing = ServerTiming()

        def finished(future: concurrent.futures.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                e = future.exception()
                # a full KV pool only ends drafting ahead early: it is a bet, not a call
                log.log(logging.DEBUG if isinstance(e, MemoryError) else logging.ERROR,
                        "background work on the %s model failed: %s: %s", self.config.role, type(e).__name__, e)
            if self.metrics is not None:
                self.metrics.observe_timing(timing)

        self.background = self.scheduler.submit_background(steps, timing)
        self.background.add_done_callback(finished)

    def _synchronize(self) -> None:
        device = self.runner.device if self.runner is not None else None
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    def _copy(self, q, device: torch.device, timing: ServerTiming):
        if q is None or _device_of(q) == device:
            return q
        self._synchronize()  # do not bill pending compute to the copy
        start = time.perf_counter()
        if isinstance(q, SparseDist):
            out = SparseDist(ids=q.ids.to(device), probs=q.probs.to(device))
        else:
            out = q.to(device)
        self._synchronize()
        timing.copy_s += time.perf_counter() - start
        return out

    def to_device(self, q, timing: ServerTiming):
        """A distribution moved host -> model device, timed as copy (worker thread)."""
        return self._copy(q, self.runner.device, timing)

    def to_host(self, q, timing: ServerTiming):
        """A distribution moved model device -> host, timed as copy (worker thread)."""
        return self._copy(q, torch.device("cpu"), timing)

    # ------------------------------------------------------------------ validation

    def check_round(
        self,
        session_id: str,
        position: int,
        new_tokens,  # a sequence of ids (the request's repeated field)
        sampling: pb.SamplingParams,
        *,
        gamma: int,
        gamma_field: str = "gamma",
        decode: int = 0,
        vocab_size: int | None = None,
    ) -> SamplingParams:
        """Validate what every round request carries; return its sampling params.

        ``gamma`` is how many tokens the call adds after ``new_tokens`` (drafted
        here, or drafts to verify); ``decode``, how many the target decodes after
        its verdict (``decode_tokens``); ``vocab_size``, the ids ``new_tokens``
        may hold (default: the model's)."""
        runner = self.require_ready()
        if not session_id:
            raise InvalidRequest("session_id is empty")
        check_name(session_id, "session_id", MAX_SERVICE_NAME_LEN)
        for value, field in ((gamma, gamma_field), (decode, "decode_tokens")):
            if not 0 <= value <= self.config.gamma_max:
                raise InvalidRequest(f"{field} {value} is out of range [0, {self.config.gamma_max}]")
        total = position + len(new_tokens) + gamma + decode  # (before any copy: a flood of ids is refused as it is)
        if total > runner.max_context:
            decoded = f" + {decode} decode_tokens" if decode else ""
            raise InvalidRequest(
                f"sequence of {total} tokens (position {position} + {len(new_tokens)} new_tokens + "
                f"{gamma} {gamma_field}{decoded}) exceeds the model context of {runner.max_context}"
            )
        if position + len(new_tokens) == 0:
            raise InvalidRequest("nothing to run: position is 0 and new_tokens is empty (empty prompt?)")
        try:
            check_token_ids(new_tokens, vocab_size or runner.vocab_size, "new_tokens")
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        params = pc.sampling_from_proto(sampling)
        if not params.greedy and params.seed is None:
            raise InvalidRequest("sampling.seed is required when temperature > 0 (both services derive "
                                 "their random draws from it)")
        return params

    def check_vocab(self, tokens: list[int], what: str) -> None:
        try:
            self.runner.check_tokens(tokens, what)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None

    def session(self, session_id: str, position: int, reserve: int):
        """The session store's context manager (see :meth:`SessionStore.open`)."""
        return self.sessions.open(session_id, position, reserve=reserve)

    # ------------------------------------------------------------------ shared RPCs

    def model_info(self) -> pb.ModelInfo:
        runner = self.require_ready()
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
        runner = self.require_ready()
        files = tokenizer_files(runner.path)
        if not files:
            raise NotFound(f"the {self.config.role} model {runner.name} has no tokenizer files")
        for path in files:
            data = await asyncio.to_thread(path.read_bytes)
            for start in range(0, max(1, len(data)), TOKENIZER_CHUNK):
                yield path.name, data[start:start + TOKENIZER_CHUNK]

    def end_session(self, request: pb.EndSessionRequest) -> pb.EndSessionResponse:
        self.require_ready()
        if not request.session_id:
            raise InvalidRequest("session_id is empty")
        check_name(request.session_id, "session_id", MAX_SERVICE_NAME_LEN)
        return pb.EndSessionResponse(existed=self.sessions.end(request.session_id))


def _device_of(q):
    if q is None:
        return None
    return q.probs.device if isinstance(q, SparseDist) else q.device


def sampling_key(sampling: pb.SamplingParams) -> bytes:
    """Sampling params as bytes, for a round's request key (see Session.replay)."""
    return sampling.SerializeToString(deterministic=True)


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
        self.host.draining = True
        if grace_s is None:
            await self.server.stop()
        else:
            await self.server.drain(grace_s)
        self.host.close()
        if self.telemetry is not None:
            self.telemetry.close()


async def start_model_service(
    config: ServiceConfig,
    add_servicer: Callable[[ModelHost, Any], None],
    *,
    runner: ModelRunner | None = None,
    wait_loaded: bool = True,
    telemetry: ServiceTelemetry | None = None,
    freeze_after_load: bool = False,
) -> tuple[RunningService, asyncio.Task]:
    """Listen first (health NOT_SERVING), load the model off the event loop, then
    report SERVING. Returns the service and the loading task (already finished
    when ``wait_loaded``). ``runner`` skips loading (an already-loaded model).
    ``telemetry`` adds tracing/metrics interceptors and the ``/metrics`` endpoint;
    ``freeze_after_load``: the process's objects are frozen once the model is
    loaded (:func:`specdec.serving.server.freeze_startup_objects`; service processes only)."""
    host = ModelHost(config)
    if telemetry is not None and isinstance(telemetry.metrics, ServiceMetrics):
        host.metrics = telemetry.metrics
    if telemetry is not None:  # first: a busy metrics port fails before anything listens
        telemetry.serve_metrics(config.host, sessions=lambda: host.sessions.stats() if host.sessions else None)
    server = GrpcServer([SERVICE_NAMES[config.role]], max_message_bytes=config.max_message_bytes,
                        metrics=telemetry.metrics if telemetry else None, reflection=config.reflection,
                        tls=config.server_tls, peers=config.peer_identities)
    add_servicer(host, server.server)
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
        r = host.runner
        log.info("serving %s model %s (vocab %d, context %d, %s) on %s at %s:%d", config.role, r.path, r.vocab_size,
                 r.max_context, config.dtype, r.device, config.host, port)
        budget = host.sessions.max_cached_tokens
        log.info("%s KV budget: %d tokens x %d bytes per token = %.0f MiB in blocks of %d (%s attention); up to %d "
                 "sessions per forward pass", config.role, budget, r.kv_bytes_per_token,
                 budget * r.kv_bytes_per_token / (1 << 20), r.kv_block_size, r.forward.kernel,
                 host.scheduler.max_sequences)

    task = asyncio.ensure_future(load())
    if wait_loaded:
        await task
    return RunningService(server, host, port, telemetry), task


def run_service(args: argparse.Namespace, role: str, add_servicer: Callable[[ModelHost, Any], None]) -> int:
    """``specdec draft-service`` / ``target-service``: serve until SIGTERM, drain, exit 0."""
    config = CONFIG_CLASSES[role].load(vars(args))
    setup_logging(config.log_level)
    telemetry = start_telemetry(role, config.trace_file, config.metrics_port)
    model = pathlib.Path(config.model_path())
    if not (model / "config.json").is_file():  # fail before listening, with a hint
        hint = "" if config.model else f" (the bundled {role} model is missing: pass --model DIR)"
        raise ValueError(f"{model} is not a model directory (no config.json){hint}")

    async def main() -> int:
        service, loading = await start_model_service(config, add_servicer, wait_loaded=False, telemetry=telemetry,
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
