"""One turn: a validated request on one session, from its history to its stats.

    open (the session's record, the context check)
      -> run rounds (the core round loop with the remote proposer and verifier),
         streaming a Delta per round
      -> commit (the history grows) or roll back (it stays as before the turn)
      -> stats

A turn is all or nothing for the session's history: one that does not finish
(the client cancelled, a service failed) leaves it as it was before the turn,
its prompt included. What the client received of it cannot be known (gRPC
buffers a stream's messages), so a client that wants to keep it sends it again.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterator

from coordinator.directory import SessionDirectory, SessionRecord
from coordinator.pair import PairInfo, PairRegistry
from coordinator.remote import RemoteProposer, RemoteSession, RemoteVerifier, RoundIds, ServiceClient, SideStats
from coordinator.requests import Request
from specdec.core.gamma import StaticGamma
from specdec.core.interfaces import RoundObserver, RoundResult, SessionState
from specdec.core.rounds import Limits, run_rounds
from specdec.core.text import TextStream
from specdec.serving import errors
from specdec.serving.generation import Delta, GenerationStats

log = logging.getLogger("specdec.coordinator")


@dataclasses.dataclass(frozen=True)
class Services:
    """What a turn runs on: the two services, the pair they serve, and the
    round observer."""

    draft: ServiceClient
    target: ServiceClient
    pairs: PairRegistry
    observer: RoundObserver


def open_record(directory: SessionDirectory, session_id: str) -> tuple[SessionRecord, bool]:
    """The session's record and whether it existed ("" : a one-shot session,
    never stored). A new named session gets a fresh name in the services: what
    they may hold under an earlier record of this id (forgotten here, or
    another coordinator's) is not this session's history; their TTL frees it."""
    record = directory.get(session_id) if session_id else None
    if record is not None:
        return record, True
    if not session_id:
        sid = f"oneshot-{uuid.uuid4().hex}"
        return SessionRecord(session_id=sid, service_session_id=sid), False
    log.info("%s: a new session (no history here: stats.history_tokens is 0)", session_id)
    return SessionRecord(session_id=session_id, service_session_id=f"{session_id}~{uuid.uuid4().hex[:12]}"), False


class Turn:
    def __init__(self, services: Services, directory: SessionDirectory, request: Request, pair: PairInfo,
                 tokenizer=None):
        self.services, self.directory, self.request, self.pair = services, directory, request, pair
        self.tokenizer = tokenizer
        self.record, self.existed = open_record(directory, request.job.session_id)
        self.named = bool(request.job.session_id)
        self.history = len(self.record.tokens)  # the session's tokens before this turn
        self.drafting = not (isinstance(request.policy, StaticGamma) and request.policy.gamma == 0)
        self.state = SessionState(tokens=self.record.tokens + request.prompt_ids,
                                  draft_synced=self.record.draft_synced, target_synced=self.record.target_synced)
        if len(self.state.tokens) >= pair.context:
            history = f" ({len(self.state.tokens)} with the session history)" if self.record.tokens else ""
            raise errors.InvalidRequest(
                f"prompt of {len(request.prompt_ids)} tokens{history} does not fit the model context of "
                f"{pair.context} (at least one position must be left to generate)")
        self.ids = RoundIds(self.record.next_round_id)
        self.draft_stats, self.target_stats = SideStats(), SideStats()
        self.rounds: list[RoundResult] = []

    @property
    def key(self) -> str:
        """The session's name in the services."""
        return self.record.service_session_id

    def run(self, cancelled: threading.Event, started: float) -> Iterator[Delta | GenerationStats]:
        """A Delta per round as soon as it commits, then the stats. ``cancelled``
        set (the client has gone): no round starts after it. Closing this
        generator early frees what the services hold for the turn."""
        text = TextStream(self.tokenizer, self.request.job.stop, context_ids=self.state.tokens) \
            if self.tokenizer is not None else None
        rounds = self._rounds(text)
        done = False
        try:
            for result in rounds:
                self.rounds.append(result)
                delta = text.take() if text is not None else ""
                if result.tokens or delta:
                    yield Delta(list(result.tokens), delta)
                if cancelled.is_set():  # this step may have queued behind others
                    return
            tail = text.finish() if text is not None else ""
            if tail:
                yield Delta([], tail)
            done = True
        finally:
            rounds.close()
            self._settle(done)
        yield self._stats(time.perf_counter() - started)

    def _rounds(self, text: TextStream | None) -> Iterator[RoundResult]:
        req, pair, services = self.request, self.pair, self.services
        session = RemoteSession(self.key, self.state, self.ids, lambda: services.pairs.check_unchanged(pair))
        proposer = None
        if self.drafting:
            proposer = RemoteProposer(services.draft, session, self.draft_stats, req.draft_top_k)
        verifier = RemoteVerifier(services.target, session, self.target_stats)
        limits = Limits(req.job.max_new_tokens, pair.context, pair.eos_token_ids, text)
        return run_rounds(proposer, verifier, self.state, params=req.params, gamma_policy=req.policy,
                          limits=limits, observer=services.observer)

    def _settle(self, done: bool) -> None:
        """Commit the turn to the session's history, or leave it as it was and
        free what the services hold (best effort)."""
        record, state = self.record, self.state
        # A failed round may have left its id recorded in one service: skip it.
        record.next_round_id = self.ids.next_id + (0 if done else 1)
        if not done:
            log.info("%s: stopped after %d new tokens (cancelled or failed): ending it in both services; "
                     "the session's history stays as before this turn", record.session_id, self.generated)
            self._end_in_services(draft=True)
            if self.existed:  # the services' state is gone: re-pre-filled if the session continues
                record.draft_synced = record.target_synced = 0
                self.directory.put(record)
        elif self.named:
            record.tokens = state.tokens
            record.sampling = dataclasses.asdict(self.request.params)
            record.gamma_policy = self.request.gamma_policy
            record.draft_synced, record.target_synced = state.draft_synced, state.target_synced
            self.directory.put(record)
        else:
            self._end_in_services(draft=self.drafting)

    def _end_in_services(self, draft: bool) -> None:
        if draft:
            self.services.draft.end_session(self.key)
        self.services.target.end_session(self.key)

    @property
    def generated(self) -> int:
        return len(self.state.tokens) - self.history - len(self.request.prompt_ids)

    def _stats(self, elapsed: float) -> GenerationStats:
        d, t = self.draft_stats, self.target_stats
        gammas, accepted = [r.gamma for r in self.rounds], [r.accepted for r in self.rounds]
        finish = self.rounds[-1].finish_reason if self.rounds else None
        prompt = len(self.request.prompt_ids)
        log.info("%s: %d prompt + %d new tokens in %.2f s, %d rounds, accepted %d/%d drafts, finish %s",
                 self.record.session_id, prompt, self.generated, elapsed, len(gammas), sum(accepted), sum(gammas),
                 finish or "length")
        return GenerationStats(
            session_id=self.request.job.session_id, finish_reason=finish or "length", prompt_tokens=prompt,
            generated_tokens=self.generated, rounds=len(gammas), drafted_tokens=sum(gammas),
            accepted_tokens=sum(accepted), gammas=gammas, accepted_per_round=accepted, elapsed_s=elapsed,
            tokens_per_second=self.generated / elapsed if elapsed > 0 else 0.0,
            target_prefill_tokens=t.prefill_tokens, draft_prefill_tokens=d.prefill_tokens,
            draft_compute_s=d.total("compute_s"), target_compute_s=t.total("compute_s"),
            queue_s=d.total("queue_s") + t.total("queue_s"), copy_s=d.total("copy_s") + t.total("copy_s"),
            draft_network_s=d.network_s, target_network_s=t.network_s,
            bytes_sent=int(d.total("bytes_out") + t.total("bytes_out")),
            bytes_received=int(d.total("bytes_in") + t.total("bytes_in")),
            history_tokens=self.history,
        )
