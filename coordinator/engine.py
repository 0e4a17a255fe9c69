"""The coordinator's work, independent of gRPC serving: validate a request, pin
the session to the draft and target services, run the core round loop
(:func:`specdec.core.rounds.run_rounds`) with remote proposer/verifier, and turn
committed tokens into streamed deltas.

:meth:`Coordinator.generate` is a plain synchronous generator; the servicer runs
each step on a worker thread, so the event loop stays free for other streams and
health checks. Closing the generator early (the client went away) frees the
session's state in both services.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import pathlib
import threading
import time
import uuid
from typing import Iterator

from specdec.serving import errors
from specdec.serving.config import CoordinatorConfig
from specdec.core import gamma as gamma_policies
from specdec.core.gamma import AdaptiveGamma, GammaPolicy, StaticGamma
from specdec.core.vocabulary import check_same_vocabulary, check_token_ids
from specdec.models.tokenizer import vocabulary_fingerprint
from specdec.core.interfaces import SessionState
from specdec.core.rounds import Limits, run_rounds
from specdec.core.sampling import SamplingParams
from specdec.telemetry.observe import RoundObserver, observe_generation
from specdec.serving.stats import GenerationStats

from coordinator.directory import InMemoryDirectory, SessionDirectory, SessionRecord
from coordinator.remote import RemoteProposer, RemoteVerifier, RoundIds, ServiceClient, SideStats
from specdec.core.text import TextStream

log = logging.getLogger("specdec.coordinator")

MAX_SESSION_ID_LEN = 256
MAX_LEARNED_REGIMES = 64  # adaptive γ estimates kept for warm starts, one per decoding regime
CLOSING_WAIT_S = 10.0  # a new request waits this long for a cancelled one on its session to end


@dataclasses.dataclass(frozen=True)
class GenerateJob:
    """A client request in core types (the servicer converts the protobuf)."""

    prompt: str = ""  # text; needs a tokenizer
    prompt_ids: tuple[int, ...] = ()  # or token ids: exactly one of the two
    max_new_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    gamma_policy: str = ""  # "" = the configured default
    stop: tuple[str, ...] = ()
    session_id: str = ""  # "" = one-shot
    draft_top_k: int | None = None  # None: the coordinator's default; 0: dense q


@dataclasses.dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str


@dataclasses.dataclass(frozen=True)
class PairInfo:
    """What the coordinator needs to know about the model pair."""

    vocab_size: int
    context: int  # the smaller of the two models' context windows
    eos_token_ids: frozenset[int]
    draft_name: str
    target_name: str
    gamma_max: int  # the largest γ a request may use: the coordinator's limit or the services', if lower


def parse_gamma_policy(spec: str, gamma_max: int) -> GammaPolicy:
    """"static:N" | "heuristic" | "adaptive" -> a fresh policy object
    (:func:`specdec.core.gamma.parse_gamma_policy`), bad specs as INVALID_ARGUMENT."""
    try:
        return gamma_policies.parse_gamma_policy(spec, gamma_max)
    except ValueError as e:
        raise errors.InvalidRequest(str(e)) from None


def _regime(job: GenerateJob) -> tuple:
    """What acceptance depends on besides the pair: greedy, or the sampling
    settings (the seed aside) and the draft's top-k."""
    s = job.sampling
    if s.temperature == 0:
        return ("greedy",)
    return ("sampling", s.temperature, s.top_k, s.top_p, job.draft_top_k)


class Coordinator:
    """Drives sessions between one draft service and one target service."""

    def __init__(self, config: CoordinatorConfig, tokenizer=None, directory: SessionDirectory | None = None,
                 tokenizer_dir: str | os.PathLike | None = None, metrics=None):
        self.config = config
        self.metrics = metrics  # a specdec.telemetry.metrics.CoordinatorMetrics, or None
        self.observer = RoundObserver(metrics)
        self.tokenizer = tokenizer
        self.tokenizer_dir = pathlib.Path(tokenizer_dir) if tokenizer_dir is not None else None
        self.directory: SessionDirectory = directory or InMemoryDirectory(config.max_sessions)
        timeouts = dict(call_timeout_s=config.call_timeout_s, info_timeout_s=config.info_timeout_s, metrics=metrics)
        self.draft = ServiceClient("draft", config.draft, **timeouts)
        self.target = ServiceClient("target", config.target, **timeouts)
        # The pair's facts, asked for at the first request and again after either
        # connection dropped (the service may be back with another model, context
        # or γ limit); _pair_epoch counts the drops, so a check that started
        # before one does not store what it read.
        self._pair: PairInfo | None = None
        self._pair_epoch = 0
        self._last_pair: PairInfo | None = None  # the last one read, to log a change
        # Sessions with a request in progress -> that request's cancellation
        # event (set: its client has gone, its cleanup is under way);
        # _released is notified when one ends.
        self._busy: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._learned_adaptive: dict[tuple, AdaptiveGamma] = {}  # by _regime(), least recent first
        self._first_request = True  # set until a request has finished
        self.draft.on_connection_lost(lambda: self._forget_pair("draft"))
        self.target.on_connection_lost(lambda: self._forget_pair("target"))

    # ------------------------------------------------------------- the pair

    def _forget_pair(self, role: str) -> None:
        with self._lock:
            self._pair_epoch += 1
            known, self._pair = self._pair, None
        if known is not None:
            log.info("lost the connection to the %s service: the model pair is checked again at the next request",
                     role)

    def pair(self, fresh: bool = False) -> PairInfo:
        """Ask both services what they serve and check they can work together:
        same vocabulary size and tokenizer fingerprint. Asked once, and again
        after a connection to either dropped (or when ``fresh``)."""
        with self._lock:
            pair, epoch = self._pair, self._pair_epoch
        if pair is None or fresh:
            d, t = self.draft.model_info(), self.target.model_info()
            where = (f"draft {d.model_name!r} at {self.draft.address}", f"target {t.model_name!r} at {self.target.address}")
            try:
                check_same_vocabulary(where[0], d.vocab_size, d.vocab_fingerprint,
                                      where[1], t.vocab_size, t.vocab_fingerprint)
            except ValueError as e:
                raise errors.FailedPrecondition(str(e)) from None
            if self.tokenizer_dir is not None and (self.tokenizer_dir / "tokenizer.json").is_file():
                mine = vocabulary_fingerprint(self.tokenizer_dir, t.vocab_size)
                if mine != t.vocab_fingerprint:
                    raise errors.FailedPrecondition(
                        f"tokenizer mismatch: the coordinator's tokenizer {self.tokenizer_dir} (fingerprint {mine}) "
                        f"is not the one of {where[1]} (fingerprint {t.vocab_fingerprint}): give --tokenizer DIR"
                    )
            # A policy growing past a service's limit would fail mid-stream (older services report none).
            limits = [info.gamma_max for info in (d, t) if info.HasField("gamma_max")]
            pair = PairInfo(
                vocab_size=t.vocab_size, context=min(d.max_context, t.max_context),
                eos_token_ids=frozenset(t.eos_token_ids), draft_name=d.model_name, target_name=t.model_name,
                gamma_max=min([self.config.gamma_max, *limits]),
            )
            with self._lock:
                if self._pair_epoch == epoch:
                    self._pair = pair
                before, self._last_pair = self._last_pair, pair
            if pair != before:  # the first check, or the services came back different
                log.log(logging.INFO if before is None else logging.WARNING,
                        "model pair%s: %s + %s (vocab %d, context %d, eos %s, gamma max %d)",
                        "" if before is None else " changed", where[0], where[1], pair.vocab_size, pair.context,
                        sorted(pair.eos_token_ids), pair.gamma_max)
                if before is not None:  # what adaptive γ learnt belongs to the old pair
                    with self._lock:
                        self._learned_adaptive.clear()
                        self._first_request = True
                if pair.gamma_max < self.config.gamma_max:
                    log.warning("gamma is capped at %d, the services' limit (--gamma-max %d here; raise theirs with "
                                "their --gamma-max)", pair.gamma_max, self.config.gamma_max)
        return pair

    # ------------------------------------------------------------- γ policies

    def _warm_start(self, policy: GammaPolicy, job: GenerateJob) -> GammaPolicy:
        """An adaptive policy starts from the estimates the last finished adaptive
        request of the same regime ended with: round costs and acceptance belong
        to the deployment (network, devices, model pair), so a new request need
        not learn them again. Acceptance depends on how tokens are chosen
        (greedy acceptance can be twice that of sampling) and on the prompt, so
        it is kept per regime and only partly carried over."""
        with self._lock:
            learned = self._learned_adaptive.get(_regime(job))
        if isinstance(policy, AdaptiveGamma) and learned is not None and learned.gamma_max == policy.gamma_max:
            return learned.for_new_request()
        return policy

    def _remember(self, policy: GammaPolicy, job: GenerateJob) -> None:
        if isinstance(policy, AdaptiveGamma):
            log.debug("adaptive γ after %s: %s", job.session_id or "a request", policy.describe())
            with self._lock:
                self._learned_adaptive.pop(_regime(job), None)
                self._learned_adaptive[_regime(job)] = policy
                while len(self._learned_adaptive) > MAX_LEARNED_REGIMES:  # clients choose the settings freely
                    self._learned_adaptive.pop(next(iter(self._learned_adaptive)))

    # ------------------------------------------------------------- sessions

    def close_session(self, session_id: str) -> bool:
        """Forget a named session and free its state in both services."""
        if not session_id:
            raise errors.InvalidRequest("session_id is empty: name the session to close")
        self._claim(session_id)  # no Generate may start on it meanwhile (never False: nothing cancels it)
        try:
            record = self.directory.get(session_id)
            if record is None:
                raise errors.SessionNotFound(f"session {session_id!r} is unknown (never started, or already closed)")
            self.directory.delete(session_id)
            self.draft.end_session(record.service_session_id)
            self.target.end_session(record.service_session_id)
            return True
        finally:
            self._release(session_id)

    def _claim(self, session_id: str, cancelled: threading.Event | None = None) -> bool:
        """One request per session at a time. A request whose client has gone
        (its ``cancelled`` event set) but which is still ending (its round in
        flight, EndSession on both services) is waited for, up to
        ``CLOSING_WAIT_S``: "stop, then send the next message" is how chat
        clients work, and they cannot know when the cleanup is over. False: this
        request was itself cancelled before it got the session (nothing to do)."""
        cancelled = cancelled or threading.Event()
        with self._released:
            deadline = time.monotonic() + CLOSING_WAIT_S
            while session_id in self._busy and not cancelled.is_set():
                remaining = deadline - time.monotonic()
                if not self._busy[session_id].is_set() or remaining <= 0:
                    raise errors.FailedPrecondition(
                        f"session {session_id!r} is already generating: one request per session at a time"
                    )
                self._released.wait(min(remaining, 0.5))  # also notice our own cancellation
            if cancelled.is_set():
                return False
            self._busy[session_id] = cancelled
            return True

    def _release(self, session_id: str) -> None:
        with self._released:
            self._busy.pop(session_id, None)
            self._released.notify_all()

    # ------------------------------------------------------------- generate

    @functools.cached_property
    def _longest_token_chars(self) -> int:
        """The most characters of text one token can stand for (its string in the
        vocabulary: byte-level BPE spells each byte as one character), so a text
        prompt longer than context × this many characters cannot fit."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    def validate(self, job: GenerateJob, pair: PairInfo) -> tuple[list[int], GammaPolicy]:
        """Everything that can be checked before touching a session; returns the
        prompt ids and a fresh γ policy. Raises InvalidRequest naming the problem."""
        if job.prompt and job.prompt_ids:
            raise errors.InvalidRequest("both prompt and prompt_ids are set: give exactly one")
        if not job.prompt and not job.prompt_ids:
            raise errors.InvalidRequest("prompt is empty: give a prompt (text) or prompt_ids")
        if len(job.session_id) > MAX_SESSION_ID_LEN:
            raise errors.InvalidRequest(f"session_id is longer than {MAX_SESSION_ID_LEN} characters")
        cap = self.config.max_new_tokens_cap
        if not 0 < job.max_new_tokens <= cap:
            raise errors.InvalidRequest(f"max_new_tokens must be in [1, {cap}], got {job.max_new_tokens}")
        if any(not s for s in job.stop):
            raise errors.InvalidRequest("stop strings must not be empty")
        if (job.prompt or job.stop) and self.tokenizer is None:
            what = "a text prompt" if job.prompt else "stop strings"
            raise errors.InvalidRequest(f"this coordinator has no tokenizer, so it cannot take {what}: send prompt_ids")
        if job.draft_top_k is not None and not 0 <= job.draft_top_k <= pair.vocab_size:
            raise errors.InvalidRequest(f"draft_top_k must be in [0, {pair.vocab_size}], got {job.draft_top_k}")
        policy = parse_gamma_policy(job.gamma_policy or self.config.default_gamma_policy, pair.gamma_max)
        if job.prompt:
            longest = self._longest_token_chars
            if len(job.prompt) > pair.context * longest:  # tokenizing megabytes takes seconds: refuse first
                raise errors.InvalidRequest(
                    f"prompt of {len(job.prompt)} characters cannot fit the model context of {pair.context} "
                    f"tokens (no token stands for more than {longest} characters)")
            # No BOS/special tokens: the same ids as `specdec generate --local`, and a
            # later turn of a session appends plain text to the history.
            ids = list(self.tokenizer.encode(job.prompt, add_special_tokens=False))
            if not ids:
                raise errors.InvalidRequest("prompt is empty after tokenization")
        else:
            ids = list(job.prompt_ids)
        try:
            check_token_ids(ids, pair.vocab_size, "prompt_ids")
        except ValueError as e:
            raise errors.InvalidRequest(str(e)) from None
        return ids, policy

    def generate(self, job: GenerateJob, cancelled: threading.Event | None = None
                 ) -> Iterator[Delta | GenerationStats]:
        """Stream one completion: a Delta per round as soon as it commits, then
        Stats. Named sessions continue their history; one-shot sessions are freed
        at the end. Closing the generator early frees the services' state.

        ``cancelled``, set by the caller once its client has gone: no round
        starts after it (a step queued behind others ends at once), and the
        next request on the session waits for this one to end."""
        cancelled = cancelled or threading.Event()
        started = time.perf_counter()
        pair = self.pair()
        prompt_ids, policy = self.validate(job, pair)
        top_k = self.config.default_draft_top_k if job.draft_top_k is None else job.draft_top_k
        job = dataclasses.replace(job, draft_top_k=min(top_k, pair.vocab_size))  # from here on: the k in force
        policy = self._warm_start(policy, job)
        named = bool(job.session_id)
        sid = job.session_id or f"oneshot-{uuid.uuid4().hex}"
        if not self._claim(sid, cancelled):
            return
        try:
            record = self.directory.get(sid) if named else None
            existed = record is not None
            if record is None:
                # A fresh name in the services: what they may hold under an earlier
                # record of this id (forgotten here, or another coordinator's) is
                # not this session's history. Their TTL frees it.
                record = SessionRecord(session_id=sid,
                                       service_session_id=f"{sid}~{uuid.uuid4().hex[:12]}" if named else sid)
                if named:
                    log.info("%s: a new session (no history here: stats.history_tokens is 0)", sid)
            tokens = record.tokens + prompt_ids
            if len(tokens) >= pair.context:
                history = f" ({len(tokens)} with the session history)" if record.tokens else ""
                raise errors.InvalidRequest(
                    f"prompt of {len(prompt_ids)} tokens{history} does not fit the model context of "
                    f"{pair.context} (at least one position must be left to generate)"
                )
            params = job.sampling.with_seed()
            state = SessionState(tokens=tokens, draft_synced=record.draft_synced, target_synced=record.target_synced)
            events = self._run(job, sid, named, existed, record, state, prompt_ids, params, policy, pair, started,
                               cancelled)
            yield from observe_generation(
                events, metrics=self.metrics, model=pair.target_name, max_tokens=job.max_new_tokens,
                temperature=params.temperature, input_tokens=len(prompt_ids), conversation_id=sid,
                extra={"specdec.draft.model": pair.draft_name, "specdec.gamma_policy": job.gamma_policy
                       or self.config.default_gamma_policy},
            )
        finally:
            self._release(sid)

    def _run(self, job, sid, named, existed, record, state, prompt_ids, params, policy, pair, started, cancelled):
        """The rounds of one turn. A turn is all or nothing for the session's
        history: one that does not finish (the client cancelled, a service
        failed) leaves it as it was before the turn, its prompt included. What
        the client received of it cannot be known (gRPC buffers a stream's
        messages), so a client that wants to keep it sends it again."""
        ids = RoundIds(record.next_round_id)
        key = record.service_session_id  # the session's name in the services

        def same_pair() -> None:
            """Before a service that lost the session mid-turn (as a restarted one
            has) gets the history again: one turn never mixes two models."""
            now = self.pair(fresh=True)
            if now != pair:
                raise errors.Unavailable(
                    f"the services changed during this turn (now draft {now.draft_name!r}, target "
                    f"{now.target_name!r}, context {now.context}; the turn began with {pair.draft_name!r}, "
                    f"{pair.target_name!r}, context {pair.context}): the turn is stopped, send it again")

        draft_stats, target_stats = SideStats(), SideStats()
        proposer = None
        if not (isinstance(policy, StaticGamma) and policy.gamma == 0):
            proposer = RemoteProposer(self.draft, key, state, ids, draft_stats, same_pair)
        verifier = RemoteVerifier(self.target, key, state, ids, target_stats, same_pair)
        text = TextStream(self.tokenizer, job.stop, context_ids=state.tokens) if self.tokenizer else None
        start_len = len(state.tokens)
        gammas, accepted = [], []
        finish = "length"
        limits = Limits(job.max_new_tokens, pair.context, pair.eos_token_ids, text)
        rounds = run_rounds(proposer, verifier, state, params=params, gamma_policy=policy, limits=limits,
                            draft_top_k=job.draft_top_k, observer=self.observer)
        done = False
        try:
            for result in rounds:
                gammas.append(result.gamma)
                accepted.append(result.accepted)
                delta = text.take() if text is not None else ""
                if result.tokens or delta:
                    yield Delta(list(result.tokens), delta)
                if cancelled.is_set():  # the client has gone (this step may have queued behind others)
                    return  # no more rounds; the turn did not finish
                finish = result.finish_reason or finish
            rounds.close()
            if text is not None and finish != "stop":
                tail = text.finish()
                if tail:
                    yield Delta([], tail)
            done = True
            if self._first_request:
                # The first request runs the channels' and services' slow first
                # calls: its round costs (seen: a verify slope of 4.4 ms per draft
                # where ~1 is usual, γ 0 "best") would mislead the requests that
                # start from them, and those would idle for dozens of rounds.
                self._first_request = False
            else:
                self._remember(policy, job)
        finally:
            rounds.close()
            elapsed = time.perf_counter() - started
            # A failed round may have left its id recorded in one service: skip it.
            record.next_round_id = ids.next_id + (0 if done else 1)
            if not done:
                # Cancelled by the client, or a service failed: free what the
                # services hold (best effort). A named session keeps its history
                # from before this turn and is re-pre-filled if it continues.
                log.info("%s: stopped after %d new tokens (cancelled or failed): ending it in both services; "
                         "the session's history stays as before this turn", sid, len(state.tokens) - start_len)
                self.draft.end_session(key)
                self.target.end_session(key)
                if existed:
                    record.draft_synced = record.target_synced = 0
                    self.directory.put(record)
            elif named:
                record.tokens = state.tokens
                record.sampling = dataclasses.asdict(params)
                record.gamma_policy = job.gamma_policy
                record.draft_synced, record.target_synced = state.draft_synced, state.target_synced
                self.directory.put(record)
            else:
                if proposer is not None:
                    self.draft.end_session(key)
                self.target.end_session(key)
        generated = len(state.tokens) - start_len
        log.info("%s: %d prompt + %d new tokens in %.2f s, %d rounds, accepted %d/%d drafts, finish %s",
                 sid, len(prompt_ids), generated, elapsed, len(gammas), sum(accepted), sum(gammas), finish)
        yield GenerationStats(
            session_id=job.session_id, finish_reason=finish, prompt_tokens=len(prompt_ids),
            generated_tokens=generated, rounds=len(gammas), drafted_tokens=sum(gammas),
            accepted_tokens=sum(accepted), gammas=gammas, accepted_per_round=accepted,
            elapsed_s=elapsed, tokens_per_second=generated / elapsed if elapsed > 0 else 0.0,
            target_prefill_tokens=target_stats.prefill_tokens, draft_prefill_tokens=draft_stats.prefill_tokens,
            draft_compute_s=draft_stats.total("compute_s"), target_compute_s=target_stats.total("compute_s"),
            queue_s=draft_stats.total("queue_s") + target_stats.total("queue_s"),
            copy_s=draft_stats.total("copy_s") + target_stats.total("copy_s"),
            draft_network_s=draft_stats.network_s, target_network_s=target_stats.network_s,
            bytes_sent=int(draft_stats.total("bytes_out") + target_stats.total("bytes_out")),
            bytes_received=int(draft_stats.total("bytes_in") + target_stats.total("bytes_in")),
            history_tokens=start_len - len(prompt_ids),
        )

    def close(self) -> None:
        self.draft.close()
        self.target.close()
