"""DraftService: decode the request, draft with :func:`specdec.models.local.draft_steps`
on the session's sequence (each step one forward pass, batched with other
sessions'); ``Propose`` streams each token as soon as it exists, ``ProposeAll``
answers with all of them in one message.

Validation, sessions, the batched model passes and timings are shared with the
target service (:mod:`specdec.serving.model_host`); what a draft session is, it
says itself (:func:`draft_sessions`, passed in as :data:`DRAFT`).
"""

from __future__ import annotations

import asyncio
import time

from specdec.core.interfaces import DraftToken
from specdec.models.local import (
    DRAFT_BRANCHES,
    DraftRule,
    branch_steps,
    draft_ahead_steps,
    draft_steps,
    held_tokens,
    new_draft_sequence,
)
from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import convert as pc
from specdec.serving.config import DraftConfig
from specdec.serving.model_host import ModelHost, ServiceRole
from specdec.serving.sessions import SessionKind
from specdec.serving.timing import ServerTiming
from specdec.serving.validation import check_round, sampling_key

# Drafting ahead goes this many drafts beyond the round it bets on: room for the
# heuristic schedule's +2 after a fully accepted round.
DRAFT_AHEAD_EXTRA = 2


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, host: ModelHost):
        self.host = host

    def _checked(self, request: pb.ProposeRequest):
        """The request's sampling parameters, draft rule and replay key (INVALID_ARGUMENT if it is bad)."""
        runner = self.host.worker.require_ready()
        own = runner.vocab_size
        target_vocab = request.target_vocab_size or own
        params = check_round(runner, self.host.config.gamma_max, request.session_id, request.position,
                             request.new_tokens, request.sampling, gamma=request.gamma,
                             vocab_size=max(own, target_vocab))
        rule = DraftRule(top_k=request.draft_top_k, vocab=target_vocab if target_vocab < own else 0)
        key = (request.position, tuple(request.new_tokens), request.gamma, rule, sampling_key(request.sampling))
        return params, rule, key

    async def ProposeAll(self, request: pb.ProposeRequest, context):
        worker, gamma = self.host.worker, request.gamma
        params, rule, key = self._checked(request)
        key = ("all", *key)
        reserve = len(request.new_tokens) + gamma
        async with self.host.sessions.open(request.session_id, request.position, reserve=reserve) as session:
            recorded = session.replay(request.round_id, key)
            if recorded is not None:  # a retried round: the same tokens, not drafted twice
                return recorded
            timing, made = ServerTiming(), []
            started = time.perf_counter()
            steps = draft_steps(worker.runner, session.state, request.position, list(request.new_tokens), gamma,
                                params, rule)

            def on_draft(draft: DraftToken) -> None:  # on the model's thread
                made.append((DraftToken(draft.token, worker.to_host(draft.q, timing)), time.perf_counter()))

            reused = await worker.run_steps(steps, timing, on_draft)
            reply = pb.Proposal(drafts=[pc.draft_token_to_proto(d) for d, _ in made],
                                timing=pc.timing_to_proto(timing), prepared=bool(gamma) and reused == gamma)
            if made:
                reply.first_draft_s, reply.last_draft_s = made[0][1] - started, made[-1][1] - started
            session.record(request.round_id, key, reply)
            self._after_round(session, params, rule, gamma, reused)
            return reply

    async def Propose(self, request: pb.ProposeRequest, context):
        worker, gamma = self.host.worker, request.gamma
        params, rule, key = self._checked(request)
        new_tokens = list(request.new_tokens)
        reserve = len(new_tokens) + gamma
        async with self.host.sessions.open(request.session_id, request.position, reserve=reserve) as session:
            recorded = session.replay(request.round_id, key)
            if recorded is not None:  # a retried round: the same tokens, not drafted twice
                for msg in recorded:
                    yield msg
                return
            timing = ServerTiming()
            steps = draft_steps(worker.runner, session.state, request.position, new_tokens, gamma, params, rule)
            # Each token is handed to the event loop as soon as it exists (on the
            # model's thread, its q already copied to the host) and streamed from there.
            loop = asyncio.get_running_loop()
            drafted: asyncio.Queue[DraftToken] = asyncio.Queue()

            def on_draft(draft: DraftToken) -> None:
                on_host = DraftToken(draft.token, worker.to_host(draft.q, timing))
                loop.call_soon_threadsafe(drafted.put_nowait, on_host)

            job = asyncio.ensure_future(worker.run_steps(steps, timing, on_draft))
            sent = []
            for i in range(gamma):
                if i == gamma - 1:
                    await job  # the last message carries the call's timing: drafting must be over
                draft = await _next_or_failure(drafted, job)
                msg = pc.draft_token_to_proto(draft, timing if i == gamma - 1 else None)
                sent.append(msg)
                yield msg
            reused = await job  # drafts made ahead and reused; γ = 0: the roll-back and append still happen
            session.record(request.round_id, key, sent)
            self._after_round(session, params, rule, gamma, reused)

    def _after_round(self, session, params, rule: DraftRule, gamma: int, reused: int) -> None:
        """While the target verifies the drafts just sent, prepare the next
        round's: for the outcome that every draft is accepted (on the session's
        sequence), and for the first DRAFT_BRANCHES rejection positions, where
        most of the remaining probability lies (on forks of it)."""
        host = self.host
        if host.metrics is not None and reused:
            host.metrics.observe_draft_ahead(reused=reused)
        if gamma and host.config.draft_ahead:
            base = len(session.state.tokens) - gamma  # where this round's drafts begin
            host.worker.run_in_background(self._prepare(session, base, params, rule, gamma))

    def _prepare(self, session, base: int, params, rule: DraftRule, gamma: int):
        """One outcome after the other, most promising first (a whole round
        ready saves its Propose the model's time; a part of one saves less),
        each in passes of its own, so that a prepared draft is bit-identical to
        the one a fresh request would make (float rounding depends on how
        tokens are grouped into passes)."""
        yield from self._draft_ahead(session, params, rule, gamma)
        for j in range(min(DRAFT_BRANCHES, gamma)):
            yield from self._branch(session, base + j, params, rule, gamma)

    def _draft_ahead(self, session, params, rule: DraftRule, gamma: int):
        """While the target verifies, this device would idle: draft the next round
        as if every draft is accepted (:func:`specdec.models.local.draft_ahead_steps`):
        the guess at the target's token, then γ + DRAFT_AHEAD_EXTRA drafts. Lossless
        either way: a later Propose reuses only drafts it would make itself. Runs in
        passes no call waits for; stops when a call arrives or the session ends."""
        host, worker, seq = self.host, self.host.worker, session.state
        scheduler = worker.scheduler
        try:
            yield from draft_ahead_steps(worker.runner, seq, params, rule, 1 + gamma + DRAFT_AHEAD_EXTRA,
                                         lambda: scheduler.calls_waiting() or not host.sessions.holds(session))
        finally:  # also when closed: the drafts made so far stay usable
            drafts = seq.ahead.drafts if seq.ahead is not None else []
            # q leaves the device now rather than on the next call's critical path.
            drafts[:] = [DraftToken(d.token, worker.to_host(d.q, ServerTiming())) for d in drafts]
            if host.metrics is not None:
                host.metrics.observe_draft_ahead(made=max(0, len(drafts) - 1))  # the guess is never reused

    def _branch(self, session, position: int, params, rule: DraftRule, gamma: int):
        """:func:`specdec.models.local.branch_steps` for the rejection at
        ``position``, as a background job like :meth:`_draft_ahead`."""
        host, worker, seq = self.host, self.host.worker, session.state
        scheduler = worker.scheduler
        made = 0
        try:
            made = yield from branch_steps(worker.runner, seq, position, params, rule, gamma,
                                           lambda: scheduler.calls_waiting() or not host.sessions.holds(session))
        finally:
            branch = next((b for b in seq.branches if b.position == position), None)
            if branch is not None:
                branch.drafts[:] = [DraftToken(d.token, worker.to_host(d.q, ServerTiming())) for d in branch.drafts]
                made = len(branch.drafts)
            if host.metrics is not None:
                host.metrics.observe_draft_ahead(branched=made)

    async def EndSession(self, request, context):
        return self.host.end_session(request)

    async def GetModelInfo(self, request, context):
        return self.host.model_info()


async def _next_or_failure(queue: asyncio.Queue, job: asyncio.Future):
    """The next drafted token, or the drafting job's exception if it failed first."""
    if queue.empty():
        getter = asyncio.ensure_future(queue.get())
        await asyncio.wait({getter, job}, return_when=asyncio.FIRST_COMPLETED)
        if getter.done():
            return getter.result()
        getter.cancel()
        job.result()  # raises what drafting raised
        raise RuntimeError("drafting ended before producing every token")
    return queue.get_nowait()


def draft_sessions(config: DraftConfig) -> SessionKind:
    """A draft session: a sequence that keeps runner-ups only where branches are
    drafted (``--draft-ahead``), sized by the tokens its callers know of
    (:func:`~specdec.models.local.held_tokens`). Drafting ahead may hold, beyond
    the budget, per session at most γ + 3 positions on its own sequence, and on
    each of DRAFT_BRANCHES forks a copied block and γ + 1 more, in whole blocks."""
    branching = config.draft_ahead

    def kv_headroom(block_size: int) -> int:
        if not branching:
            return 0
        per_round = -(-(config.gamma_max + 3) // block_size) + 1
        return config.max_sessions * per_round * (1 + DRAFT_BRANCHES) * block_size

    return SessionKind(new_state=lambda runner: new_draft_sequence(runner, branching), size=held_tokens,
                       kv_headroom=kv_headroom)


def add_to_server(host: ModelHost, server) -> None:
    pb_grpc.add_DraftServiceServicer_to_server(DraftServicer(host), server)


DRAFT = ServiceRole("draft", add_to_server, draft_sessions)
