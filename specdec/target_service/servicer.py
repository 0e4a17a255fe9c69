"""TargetService: decode the request, judge the drafts with
:func:`specdec.models.local.verify_steps` on the session's sequence (one forward
pass, batched with other sessions'; then one per token asked for by
``decode_tokens``), answer the verdict.

Validation, sessions, the batched model passes and timings are shared with the
draft service (:mod:`specdec.serving.model_host`); a target session is a plain
sequence (:data:`TARGET`).
"""

from __future__ import annotations

from specdec.core.interfaces import DraftToken
from specdec.models.local import verify_steps
from specdec.models.runner import ModelRunner
from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import convert as pc
from specdec.serving.config import ServiceConfig
from specdec.serving.errors import InvalidRequest
from specdec.serving.model_host import ModelHost, ServiceRole
from specdec.serving.sessions import SessionKind
from specdec.serving.timing import ServerTiming
from specdec.serving.validation import check_round, check_vocab, sampling_key


class TargetServicer(pb_grpc.TargetServiceServicer):
    def __init__(self, host: ModelHost):
        self.host = host

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        worker = self.host.worker
        runner = worker.require_ready()
        tokens, decode = list(request.draft_tokens), request.decode_tokens
        params = check_round(runner, self.host.config.gamma_max, request.session_id, request.position,
                             request.new_tokens, request.sampling, gamma=len(tokens), gamma_field="draft_tokens",
                             decode=decode)
        check_vocab(runner, tokens, "draft_tokens")
        qs = [None] * len(tokens) if params.greedy else self._draft_q(request, tokens)
        new_tokens = list(request.new_tokens)
        key = (request.position, tuple(new_tokens), tuple(tokens), sampling_key(request.sampling), decode)
        grows = len(new_tokens) + len(tokens) + 1 + decode
        async with self.host.sessions.open(request.session_id, request.position, reserve=grows) as session:
            recorded = session.replay(request.round_id, key)
            if recorded is not None:  # a retried round: answered, not applied twice
                return recorded
            timing = ServerTiming()

            def steps():
                drafts = [DraftToken(t, worker.to_device(q, timing)) for t, q in zip(tokens, qs, strict=True)]
                return (yield from verify_steps(runner, session.state, request.position, new_tokens, drafts,
                                                params, decode))

            verdict = await worker.run_steps(steps(), timing)
            response = pc.verdict_to_proto(verdict, timing)
            session.record(request.round_id, key, response)
            return response

    def _draft_q(self, request: pb.VerifyRequest, tokens: list[int]):
        """Sampling needs each draft's q: one per draft, each giving its token
        probability > 0 (a token q could not have produced cannot be judged)."""
        if len(request.draft_q) != len(tokens):
            raise InvalidRequest(
                f"draft_q has {len(request.draft_q)} distributions for {len(tokens)} draft_tokens; "
                "sampling needs exactly one per draft"
            )
        vocab = self.host.worker.runner.vocab_size
        qs = []
        for i, (token, msg) in enumerate(zip(tokens, request.draft_q, strict=True)):
            q = pc.dist_from_proto(msg, vocab, f"draft_q[{i}]")
            if pc.dist_prob(q, token) <= 0:
                raise InvalidRequest(f"draft_q[{i}] gives draft token {token} probability 0")
            qs.append(q)
        return qs

    async def EndSession(self, request, context):
        return self.host.end_session(request)

    async def GetModelInfo(self, request, context):
        return self.host.model_info()

    async def GetTokenizer(self, request, context):
        async for name, data in self.host.tokenizer_chunks():
            yield pb.TokenizerChunk(file=name, data=data)


def target_sessions(config: ServiceConfig) -> SessionKind:
    """A target session: a plain sequence, sized by its tokens; no KV beyond the budget."""
    return SessionKind(new_state=ModelRunner.new_sequence)


def add_to_server(host: ModelHost, server) -> None:
    pb_grpc.add_TargetServiceServicer_to_server(TargetServicer(host), server)


TARGET = ServiceRole("target", add_to_server, target_sessions)
