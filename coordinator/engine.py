"""The coordinator's work, independent of gRPC serving, as a pipeline of named
pieces:

* :class:`coordinator.pair.PairRegistry` — what the draft and target serve,
  checked to work together;
* :class:`coordinator.requests.RequestCheck` — a job's checks, before any
  session is touched;
* :class:`coordinator.directory.SessionDirectory` — each session's history and
  last turn, and its lease: one request per session at a time (in memory, or
  in Redis shared by coordinator replicas);
* :class:`coordinator.learned_gamma.LearnedGamma` — adaptive γ's warm start;
* :class:`coordinator.turn.Turn` — the session's rounds, committed or rolled
  back, and the stats;

and the telemetry around them (a span per Generate, the round observer).

:meth:`Coordinator.generate` is a plain synchronous generator; the servicer runs
each step on a worker thread, so the event loop stays free for other streams and
health checks. Closing the generator early (the client went away) frees the
session's state in both services.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pathlib
import threading
import time
from collections.abc import Iterator

from coordinator.directory import InMemoryDirectory, SessionDirectory
from coordinator.learned_gamma import LearnedGamma, regime
from coordinator.pair import PairInfo, PairRegistry
from coordinator.remote import ServiceClient
from coordinator.requests import Request, RequestCheck
from coordinator.turn import Services, Turn
from specdec.serving import errors
from specdec.serving.config import CoordinatorConfig
from specdec.serving.generation import Delta, GenerateJob, GenerationStats
from specdec.telemetry.observer import CoordinatorObserver, GenerationInfo, generation_span, record_generation

log = logging.getLogger("specdec.coordinator")


class Coordinator:
    """Drives sessions between one draft service and one target service."""

    def __init__(self, config: CoordinatorConfig, tokenizer=None, directory: SessionDirectory | None = None,
                 tokenizer_dir: str | os.PathLike | None = None, metrics=None):
        self.config = config
        self.metrics = metrics  # a specdec.telemetry.metrics.CoordinatorMetrics, or None
        self.tokenizer = tokenizer
        self.directory: SessionDirectory = directory or make_directory(config, metrics)
        timeouts = dict(call_timeout_s=config.call_timeout_s, info_timeout_s=config.info_timeout_s, metrics=metrics)
        self.draft = ServiceClient("draft", config.draft, **timeouts)
        self.target = ServiceClient("target", config.target, **timeouts)
        self.learned = LearnedGamma()
        self.pairs = PairRegistry(self.draft, self.target, config.gamma_max,
                                  pathlib.Path(tokenizer_dir) if tokenizer_dir is not None else None,
                                  on_change=self.learned.forget)
        self.checks = RequestCheck(config, tokenizer)
        self.services = Services(self.draft, self.target, self.pairs, CoordinatorObserver(metrics))

    def pair(self, fresh: bool = False) -> PairInfo:
        return self.pairs.get(fresh)

    def generate(self, job: GenerateJob, cancelled: threading.Event | None = None
                 ) -> Iterator[Delta | GenerationStats]:
        """Stream one completion: a Delta per round as soon as it commits, then
        the stats. Named sessions continue their history; one-shot sessions are
        freed at the end. ``cancelled``, set by the caller once its client has
        gone: no round starts after it, and the next request on the session
        waits for this one to end."""
        cancelled = cancelled or threading.Event()
        started = time.perf_counter()
        pair = self.pairs.get()
        request = self.checks.validate(job, pair)
        key = regime(request.params, request.draft_top_k)
        request = dataclasses.replace(request, policy=self.learned.warm_start(request.policy, key))
        # A resumed turn takes over from a coordinator that may have died
        # holding the session: its lease runs out within the lease time.
        wait_s = None if job.resume_after is None else self.config.lease_s + 1.0
        with self.directory.hold(job.session_id, cancelled, wait_s) as lease:
            if lease is None:
                return
            turn = Turn(self.services, self.directory, request, pair, self.tokenizer, lease)
            if turn.resume_after is not None and self.metrics is not None:
                self.metrics.turns_resumed.inc()
            with generation_span(_info(request, pair, turn)) as span, \
                    contextlib.closing(turn.run(cancelled, started)) as events:
                for event in events:
                    if isinstance(event, GenerationStats):
                        record_generation(span, self.metrics, event)
                        self.learned.finished(request.policy, key)
                    elif self.metrics is not None:
                        self.metrics.observe_streamed(len(event.token_ids))
                    yield event

    def close_session(self, session_id: str) -> bool:
        """Forget a named session and free its state in both services."""
        if not session_id:
            raise errors.InvalidRequest("session_id is empty: name the session to close")
        with self.directory.hold(session_id) as lease:  # no Generate may start on it meanwhile
            record = self.directory.get(session_id)
            if record is None:
                raise errors.SessionNotFound(f"session {session_id!r} is unknown (never started, or already closed)")
            self.directory.delete(session_id, lease)
            self.draft.end_session(record.service_session_id)
            self.target.end_session(record.service_session_id)
            return True

    def close(self) -> None:
        self.draft.close()
        self.target.close()
        self.directory.close()


def make_directory(config: CoordinatorConfig, metrics=None) -> SessionDirectory:
    """``--redis URL``: the directory every coordinator given that URL shares;
    otherwise one in this process's memory."""
    if not config.redis:
        return InMemoryDirectory(config.max_sessions)
    from coordinator.redis_directory import RedisDirectory

    return RedisDirectory(config.redis, ttl_s=config.redis_ttl_s, lease_s=config.lease_s, metrics=metrics)


def _info(request: Request, pair: PairInfo, turn: Turn) -> GenerationInfo:
    job = request.job
    return GenerationInfo(model=pair.target_name, draft_model=pair.draft_name, max_tokens=job.max_new_tokens,
                          temperature=request.params.temperature, input_tokens=len(request.prompt_ids),
                          conversation_id=turn.record.session_id, gamma_policy=job.gamma_policy)
