"""One turn: a validated request on one session, from its history to its stats.

    open (the session's record, the context check)
      -> run rounds (the core round loop with the remote proposer and verifier),
         each round's delta written to the directory, then streamed
      -> commit (the history grows) or leave the turn unfinished
      -> stats

A turn's tokens join the session's history only when it finishes. One that does
not (the client went away, a service or this coordinator failed) stays in the
directory as the session's unfinished last turn, its deltas up to the last one
streamed: a request with ``resume_after`` continues it from the delta the client
got last, on this coordinator or on any other sharing the directory; any other
request drops it, so the history is as before that turn.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

from specdec.coordinator.admission import KVWaits
from specdec.coordinator.directory import Lease, SessionDirectory, SessionRecord, TurnRecord
from specdec.coordinator.learned_gamma import regime
from specdec.coordinator.pair import PairInfo, PairRegistry
from specdec.coordinator.pinning import Pinned
from specdec.coordinator.pools import Replica
from specdec.coordinator.remote import RemoteProposer, RemoteSession, RemoteVerifier, SideStats
from specdec.coordinator.requests import Request
from specdec.core.gamma import AdaptiveGamma, StaticGamma
from specdec.core.interfaces import RoundObserver, RoundResult, SamplingParams, SessionState
from specdec.core.rounds import Limits, RoundMachine, run_rounds_async
from specdec.core.text import TextStream
from specdec.serving import errors
from specdec.serving.generation import Delta, GenerationStats

log = logging.getLogger("specdec.coordinator")


@dataclasses.dataclass(frozen=True)
class Services:
    """What a turn runs on: its draft replica (None: the turn does not draft)
    and target replica, the pair they serve, the round observer and the metrics."""

    draft: Pinned | None
    target: Pinned
    pairs: PairRegistry
    observer: RoundObserver
    metrics: object = None  # a CoordinatorMetrics, or None
    pair_draft: object = None  # the draft client the pair is read with when the turn pins no draft
    kv_waits: KVWaits | None = None  # how long a verification may wait for the target's KV room

    def clients(self, role: str = "", replica: Replica | None = None) -> tuple:
        draft = self.draft.client if self.draft is not None and self.draft.client is not None else self.pair_draft
        target = self.target.client
        if role == "draft":
            draft = replica.client
        elif role == "target":
            target = replica.client
        return draft, target

    async def serves(self, pair: PairInfo, replica: Replica) -> bool:
        """Whether ``replica`` may take its role in the turn over: it answers,
        and serves what ``pair`` says of that role (only it is asked)."""
        try:
            why = await self.pairs.differs(pair, replica.client)
        except errors.SpecdecError as e:
            log.warning("%s replica %s cannot take the turn over: %s", replica.client.role, replica.address, e)
            return False
        if why:
            log.warning("%s replica %s cannot take the turn over: it %s", replica.client.role, replica.address, why)
        return not why


async def open_record(directory: SessionDirectory, session_id: str) -> SessionRecord:
    """The session's record, stored or new ("" : a one-shot session, never
    stored). A new named session gets a fresh name in the services: what
    they may hold under an earlier record of this id (forgotten here, or
    another coordinator's) is not this session's history; their TTL frees it."""
    record = await directory.get(session_id) if session_id else None
    if record is not None:
        return record
    if not session_id:
        sid = f"oneshot-{uuid.uuid4().hex}"
        return SessionRecord(session_id=sid, service_session_id=sid)
    log.info("%s: a new session (no history here: stats.history_tokens is 0)", session_id)
    return SessionRecord(session_id=session_id, service_session_id=fresh_service_name(session_id))


def fresh_service_name(session_id: str) -> str:
    return f"{session_id}~{uuid.uuid4().hex[:12]}"


def resumed_turn(record: SessionRecord, job) -> TurnRecord | None:
    """The turn a ``resume_after`` request continues, or None when it asks for
    a turn the directory never recorded before any delta was streamed (it
    starts afresh)."""
    turn = record.turn
    if turn is None or turn.turn_id != job.turn_id:
        if job.resume_after == 0:
            return None
        raise errors.FailedPrecondition(
            f"turn {job.turn_id!r} of session {record.session_id!r} is not in the session directory (it forgot "
            f"the session, or another turn followed): its deltas cannot be resumed; send it as a new turn")
    if job.resume_after > len(turn.deltas):
        raise errors.InvalidRequest(f"resume_after {job.resume_after}: turn {job.turn_id!r} of session "
                                    f"{record.session_id!r} has streamed only {len(turn.deltas)} deltas")
    return turn


class Turn:
    def __init__(self, services: Services, directory: SessionDirectory, request: Request, pair: PairInfo,
                 record: SessionRecord, *, tokenizer=None, lease: Lease | None = None):
        self.services, self.directory, self.request, self.pair = services, directory, request, pair
        self.tokenizer, self.lease = tokenizer, lease
        self.record = record
        self.named = bool(request.job.session_id)
        resumed = resumed_turn(self.record, request.job) if request.job.resume_after is not None else None
        self.resume_after = request.job.resume_after if resumed is not None else None
        if self.record.turn is not None and not self.record.turn.finished:
            self._forget_services_state()
        self.turn = resumed or self._new_turn()
        self.params = SamplingParams(**self.turn.sampling)
        before = self.record.tokens  # the session's tokens before this turn
        if self.turn.finished:  # (a resumed turn that finished: they hold it)
            before = before[:len(before) - len(self.turn.prompt_ids) - len(self.turn.generated)]
        self.history = len(before)
        self.drafting = not (isinstance(request.policy, StaticGamma) and request.policy.gamma == 0)
        self.state = SessionState(tokens=before + self.turn.prompt_ids + self.turn.generated,
                                  draft_synced=self.record.draft_synced, target_synced=self.record.target_synced)
        if len(self.state.tokens) >= pair.context and self.resume_after is None:
            history = f" ({len(self.state.tokens)} with the session history)" if self.record.tokens else ""
            raise errors.InvalidRequest(
                f"prompt of {len(self.turn.prompt_ids)} tokens{history} does not fit the model context of "
                f"{pair.context} (at least one position must be left to generate)")
        self.machine: RoundMachine | None = None  # the rounds, once they start
        self.draft_stats, self.target_stats = SideStats(), SideStats()
        self.rounds: list[RoundResult] = []
        self.ended_before: str | None = None  # a resumed turn that had ended before it was cut short

    def _forget_services_state(self) -> None:
        """The last turn did not finish: what the services hold of this session
        (if anything: a coordinator that died could not end it) is unknown, so
        the turn continues, or the next one starts, under a fresh name there,
        re-pre-filled from the history. Their TTL frees the old name."""
        self.record.service_session_id = fresh_service_name(self.record.session_id)
        self.record.draft_synced = self.record.target_synced = 0
        if self.services.metrics is not None:
            for role in ("draft", "target"):
                self.services.metrics.prefills.labels(role, "turn cut short").inc()

    def _new_turn(self) -> TurnRecord:
        record, request = self.record, self.request
        if record.turn is not None and not record.turn.finished:
            log.info("%s: turn %d did not finish and is not resumed: dropped, the history stays as before it",
                     record.session_id, record.turn.number)
        number = record.turn.number + 1 if record.turn is not None else 1
        return TurnRecord(number, list(request.prompt_ids), request.job.max_new_tokens,
                          dataclasses.asdict(request.params), list(request.job.stop), request.job.turn_id)

    @property
    def key(self) -> str:
        """The session's name in the services."""
        return self.record.service_session_id

    async def run(self, cancelled: asyncio.Event, started: float) -> AsyncIterator[Delta | GenerationStats]:
        """A Delta per round as soon as it commits, then the stats. ``cancelled``
        set (the client has gone): no round starts after it. Closing this
        generator early frees what the services hold for the turn."""
        if self.resume_after is not None:
            for ids, text in self.turn.deltas[self.resume_after:]:  # what the client missed
                yield Delta(list(ids), text)
            if self.turn.finished:
                yield self._stats(time.perf_counter() - started)
                return
        elif self.named:
            self.record.turn = self.turn
            await self.directory.put(self.record, self.lease)  # resumable from its first round on
        text = self._text_stream()
        rounds = self._rounds(text)
        done = False
        try:
            async for result in rounds:
                self.rounds.append(result)
                delta = text.take() if text is not None else ""
                if result.tokens or delta:
                    yield await self._streamed(Delta(list(result.tokens), delta))
                if cancelled.is_set():
                    return
            tail = text.finish() if text is not None else ""
            if tail:
                yield await self._streamed(Delta([], tail))
            done = True
        finally:
            if not done:  # cancelled or failed: a request waiting for the session knows this one is ending
                cancelled.set()
            await rounds.aclose()
            await asyncio.shield(self._settle(done))
        yield self._stats(time.perf_counter() - started)

    def _text_stream(self) -> TextStream | None:
        """Text for the turn's deltas; a resumed turn's stream is fed what the
        turn generated so far, so it goes on exactly where it was (a stop
        string straddling the resume point included)."""
        if self.tokenizer is None:
            return None
        generated = self.turn.generated
        text = TextStream(self.tokenizer, self.turn.stop, context_ids=self.state.tokens[:len(self.state.tokens)
                                                                                     - len(generated)])
        if generated:
            text.stop_after(generated)
            text.take()  # already streamed
        if self.turn.deltas and not self.turn.deltas[-1][0]:
            text.finish()  # so was the text held back to the end (a delta of no tokens)
        return text

    async def _streamed(self, delta: Delta) -> Delta:
        """Record the delta in the session's turn before the client gets it."""
        self.turn.deltas.append([delta.token_ids, delta.text])
        if self.named:
            await self.directory.add_delta(self.record, self.lease)
        return delta

    def _rounds(self, text: TextStream | None) -> AsyncIterator[RoundResult]:
        req, pair, services = self.request, self.pair, self.services
        session = RemoteSession(self.key, lambda client: services.pairs.check_unchanged(pair, client),
                                lambda replica: services.serves(pair, replica), services.metrics,
                                services.kv_waits)
        proposer = None
        if self.drafting and services.draft is not None:
            proposer = RemoteProposer(services.draft, session, self.draft_stats, req.draft_top_k, pair.vocab_size)
        verifier = RemoteVerifier(services.target, session, self.target_stats)
        self.ended_before = self._complete(text)
        budget = 0 if self.ended_before else self.turn.max_new_tokens - len(self.turn.generated)
        limits = Limits(budget, pair.context, pair.eos_token_ids, text, req.plain_tokens)
        self.machine = RoundMachine(self.state, params=self.params, gamma_policy=req.policy, limits=limits,
                                    drafting=proposer is not None, round_id=self.record.next_round_id,
                                    observer=services.observer)
        return run_rounds_async(proposer, verifier, self.machine)

    def _complete(self, text: TextStream | None) -> str | None:
        """Why a resumed turn had already ended before it was cut short (its
        last delta was streamed, its end not recorded), or None."""
        generated = self.turn.generated
        if text is not None and text.stopped:
            return "stop"
        if generated and generated[-1] in self.pair.eos_token_ids:
            return "eos"
        return "length" if len(generated) >= self.turn.max_new_tokens else None

    @property
    def finish_reason(self) -> str:
        if self.turn.finished:
            return self.turn.finish_reason
        if self.rounds and self.rounds[-1].finish_reason:
            return self.rounds[-1].finish_reason
        return self.ended_before or "length"

    async def _settle(self, done: bool) -> None:
        """Commit the turn to the session's history, or leave it unfinished (and
        resumable) and free what the services hold (best effort)."""
        record, state = self.record, self.state
        # A failed round may have left its id recorded in one service: skip it.
        if self.machine is not None:
            record.next_round_id = self.machine.round_id + (0 if done else 1)
        if not done:
            log.info("%s: stopped after %d new tokens (cancelled or failed): ending it in both services; "
                     "the turn can be resumed, or is dropped by the next one", record.session_id, self.generated)
            await self._end_in_services(draft=True)
            record.draft_synced = record.target_synced = 0  # re-pre-filled if the session continues
            if self.named:
                try:
                    await self.directory.put(record, self.lease)
                except errors.SpecdecError as e:  # not to hide why the turn stopped; the next one starts fresh
                    log.warning("%s: the unfinished turn was not recorded: %s", record.session_id, e)
        elif self.named:
            self.turn.finish_reason = self.finish_reason
            record.tokens = state.tokens
            record.sampling = dict(self.turn.sampling)
            record.gamma_policy = self.request.gamma_policy
            if isinstance(self.request.policy, AdaptiveGamma):
                record.gamma_state = {"regime": list(regime(self.params, self.request.draft_top_k)),
                                      **self.request.policy.acceptance()}
            record.draft_synced, record.target_synced = state.draft_synced, state.target_synced
            await self.directory.put(record, self.lease, keep_deltas=True)  # added round by round
        else:
            await self._end_in_services(draft=self.drafting)

    async def _end_in_services(self, draft: bool) -> None:
        sides = [self.services.draft] if draft else []
        clients = [p.client for p in (*sides, self.services.target) if p is not None and p.client is not None]
        await asyncio.gather(*(client.end_session(self.key) for client in clients))

    @property
    def generated(self) -> int:
        """The turn's generated tokens, those streamed before a resume included."""
        return len(self.state.tokens) - self.history - len(self.turn.prompt_ids)

    def _stats(self, elapsed: float) -> GenerationStats:
        d, t = self.draft_stats, self.target_stats
        gammas, accepted = [r.gamma for r in self.rounds], [r.accepted for r in self.rounds]
        finish = self.finish_reason
        prompt = len(self.turn.prompt_ids)
        log.info("%s: %d prompt + %d new tokens in %.2f s, %d rounds, accepted %d/%d drafts, finish %s",
                 self.record.session_id, prompt, self.generated, elapsed, len(gammas), sum(accepted), sum(gammas),
                 finish)
        return GenerationStats(
            session_id=self.request.job.session_id, finish_reason=finish, prompt_tokens=prompt,
            generated_tokens=self.generated, rounds=len(gammas), drafted_tokens=sum(gammas),
            accepted_tokens=sum(accepted), gammas=gammas, accepted_per_round=accepted, elapsed_s=elapsed,
            tokens_per_second=self.generated / elapsed if elapsed > 0 else 0.0,
            target_prefill_tokens=t.prefill_tokens, draft_prefill_tokens=d.prefill_tokens,
            draft_compute_s=d.total("compute_s"), target_compute_s=t.total("compute_s"),
            queue_s=d.total("queue_s") + t.total("queue_s"), copy_s=d.total("copy_s") + t.total("copy_s"),
            draft_network_s=d.network_s, target_network_s=t.network_s,
            bytes_sent=int(d.total("bytes_out") + t.total("bytes_out")),
            bytes_received=int(d.total("bytes_in") + t.total("bytes_in")),
            history_tokens=self.history, prepared_rounds=d.prepared_rounds,
        )
