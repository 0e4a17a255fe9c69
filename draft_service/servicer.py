"""DraftService: decode the request, draft with :func:`specdec.local.draft_tokens`
on the session's sequence, stream each token as soon as it exists.

Validation, sessions, the model executor and timings are shared with the target
service in :mod:`specdec.model_service`.
"""

from __future__ import annotations

from specdec import proto_convert as pc
from specdec.local import draft_tokens
from specdec.model_service import ModelHost, sampling_key
from specdec.proto import specdec_pb2 as pb, specdec_pb2_grpc as pb_grpc
from specdec.rounds import DraftToken
from specdec.timing import ServerTiming


class DraftServicer(pb_grpc.DraftServiceServicer):
    def __init__(self, host: ModelHost):
        self.host = host

    async def Propose(self, request: pb.ProposeRequest, context):
        host, gamma = self.host, request.gamma
        params = host.check_round(request.session_id, request.position, request.new_tokens,
                                  request.sampling, gamma=gamma)
        new_tokens = list(request.new_tokens)
        key = (request.position, tuple(new_tokens), gamma, request.draft_top_k, sampling_key(request.sampling))
        async with host.session(request.session_id, request.position, len(new_tokens) + gamma) as session:
            recorded = session.replay(request.round_id, key)
            if recorded is not None:  # a retried round: the same tokens, not drafted twice
                for msg in recorded:
                    yield msg
                return
            timing = ServerTiming()
            steps = draft_tokens(host.runner, session.state, request.position, new_tokens, gamma,
                                 params, request.draft_top_k)
            if gamma == 0:  # nothing to draft: just roll back and append
                await host.run(timing, list, steps)
            sent = []
            for i in range(gamma):
                # One step per executor job: the token goes out before the next is drafted,
                # and other sessions' work can interleave.
                draft = await host.run(timing, self._step, steps, timing)
                msg = pc.draft_token_to_proto(draft, timing if i == gamma - 1 else None)
                sent.append(msg)
                yield msg
            session.record(request.round_id, key, sent)

    def _step(self, steps, timing: ServerTiming) -> DraftToken:
        draft = next(steps)
        return DraftToken(draft.token, self.host.to_host(draft.q, timing))

    async def EndSession(self, request, context):
        return self.host.end_session(request)

    async def GetModelInfo(self, request, context):
        return self.host.model_info()


def add_to_server(host: ModelHost, server) -> None:
    pb_grpc.add_DraftServiceServicer_to_server(DraftServicer(host), server)
