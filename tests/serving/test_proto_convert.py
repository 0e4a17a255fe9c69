"""protobuf <-> core conversions (specdec.serving.convert)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specdec.core.interfaces import DraftToken, PassLoad, SamplingParams, Verdict
from specdec.core.sampling import SparseDist
from specdec.proto import specdec_pb2 as pb
from specdec.serving import convert as pc
from specdec.serving.errors import InvalidRequest
from specdec.serving.timing import CallTiming, ServerTiming


def test_sampling_round_trip_and_defaults():
    for params in [SamplingParams(), SamplingParams(0.7, 5, 0.9, 42), SamplingParams(1.0, seed=0)]:
        assert pc.sampling_from_proto(pc.sampling_to_proto(params)) == params
    unset = pc.sampling_from_proto(pb.SamplingParams(temperature=1.0))
    assert unset.top_p == 1.0 and unset.seed is None
    assert pc.sampling_from_proto(None) == SamplingParams()
    with pytest.raises(InvalidRequest, match="top_p"):
        pc.sampling_from_proto(pb.SamplingParams(temperature=1.0, top_p=0.0))


def test_distributions_round_trip_exactly(monkeypatch):
    dense = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(0)), -1)
    # The tensors are made from writable arrays: one over the message's bytes
    # would be read-only, and writing into it undefined (torch only warns, once).
    from_numpy = torch.from_numpy

    def from_writable_numpy(array):
        assert array.flags.writeable
        return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", from_writable_numpy)
    back = pc.dist_from_proto(pc.dist_to_proto(dense), vocab_size=50)
    assert back.dtype == torch.float32 and torch.equal(back, dense)
    sparse = SparseDist(ids=torch.tensor([7, 3, 40]), probs=torch.tensor([0.5, 0.3, 0.2]))
    msg = pc.dist_to_proto(sparse)
    assert len(msg.probs) == 12 and list(msg.ids) == [7, 3, 40]
    back = pc.dist_from_proto(msg, vocab_size=50)
    assert torch.equal(back.ids, sparse.ids) and torch.equal(back.probs, sparse.probs)
    assert pc.dist_prob(back, 3) == pytest.approx(0.3) and pc.dist_prob(back, 4) == 0.0


@pytest.mark.parametrize("msg, words", [
    (pb.Distribution(probs=b"\0\0\0"), "whole number"),
    (pb.Distribution(probs=b""), "empty"),
    (pb.Distribution(ids=[1, 2], probs=pc.dist_to_proto(torch.ones(1)).probs), "2 ids but 1"),
    (pb.Distribution(ids=[60], probs=pc.dist_to_proto(torch.ones(1)).probs), "60 is outside"),
    (pb.Distribution(ids=[1, 1], probs=pc.dist_to_proto(torch.ones(2)).probs), "not unique"),
    (pb.Distribution(ids=[9, 3, 7, 3], probs=pc.dist_to_proto(torch.ones(4)).probs), "not unique"),
    (pb.Distribution(ids=[2, -1], probs=pc.dist_to_proto(torch.ones(2)).probs), "-1 is outside"),
    (pc.dist_to_proto(torch.tensor([0.5, -0.1] + [0.0] * 48)), "finite and >= 0"),
    (pc.dist_to_proto(torch.full((51,), 1 / 51)), "51 values, the vocabulary has 50"),
    (pc.dist_to_proto(torch.tensor([float("nan")] * 50)), "finite"),
    (pc.dist_to_proto(torch.zeros(50)), "all probabilities are 0"),
    (pc.dist_to_proto(torch.full((50,), 1 / 25)), "must sum to 1, got 2"),
    (pb.Distribution(ids=[3, 4], probs=pc.dist_to_proto(torch.tensor([0.5, 0.4])).probs), "must sum to 1, got 0.9"),
    (pc.dist_to_proto(torch.full((50,), 3.4e38)), "sum to 1, got 1.7e"),  # each finite, the total is not in float32
])
def test_bad_distributions_are_invalid_requests(msg, words):
    with pytest.raises(InvalidRequest, match=words):
        pc.dist_from_proto(msg, vocab_size=50)


def test_a_dense_distribution_may_cover_only_the_first_ids():
    """A draft that holds fewer vocabulary rows than its target sends q over its
    own: the ids past them have probability 0."""
    q = pc.dist_from_proto(pc.dist_to_proto(torch.full((40,), 1 / 40)), 50)
    assert q.shape == (40,)


def test_draft_tokens_verdicts_timings():
    d = DraftToken(5, torch.softmax(torch.randn(10), -1))
    timing = ServerTiming(0.1, 0.2, 0.01, 7)
    msg = pc.draft_token_to_proto(d, timing)
    back = pc.draft_token_from_proto(msg, 10)
    assert back.token == 5 and torch.equal(back.q, d.q)
    assert pc.timing_from_proto(msg.timing) == timing.reported()
    assert pc.draft_token_from_proto(pc.draft_token_to_proto(DraftToken(3, None))).q is None
    reply = pc.verdict_to_proto(Verdict(2, 9), timing)
    assert pc.verdict_from_proto(reply) == Verdict(2, 9)
    # A batching service reports the passes a call was in, per pass.
    shared = ServerTiming(compute_s=0.06, passes=2, pass_sequences=6, pass_tokens=20, pass_seconds=0.05)
    wire = pc.timing_to_proto(shared)
    assert (wire.batch_sequences, wire.batch_tokens, wire.pass_s) == (3.0, 10.0, pytest.approx(0.025))
    assert pc.timing_to_proto(ServerTiming()).batch_sequences == 0.0  # no pass: nothing to report
    req = pc.verify_request("s", 1, 4, [1], [d], SamplingParams(1.0, seed=1))
    assert list(req.draft_tokens) == [5] and len(req.draft_q) == 1
    assert len(pc.verify_request("s", 1, 4, [1], [d], SamplingParams()).draft_q) == 0  # greedy: no q


def test_timing_round_trip_keeps_every_field():
    sent = ServerTiming(0.1, 0.2, 0.01, 7, passes=2, pass_sequences=6, pass_tokens=20, pass_seconds=0.05)
    back = pc.timing_from_proto(pb.ServerTiming.FromString(pc.timing_to_proto(sent).SerializeToString()))
    assert back == sent.reported() == CallTiming(0.1, 0.2, 0.01, 7, 3.0, 10.0, 0.025)
    assert {f.name for f in pb.ServerTiming.DESCRIPTOR.fields} == {f.name for f in dataclasses.fields(CallTiming)}
    assert back.pass_load() == PassLoad(3.0, 10.0, 0.025)
    assert CallTiming(compute_s=0.1).pass_load() is None  # a service that does not batch reports no pass


def _off_the_wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_a_draft_reply_decodes_at_the_boundary_and_its_q_is_forwarded_as_sent():
    dense = pc.dist_to_proto(torch.softmax(torch.randn(50), -1))
    sparse = pc.dist_to_proto(SparseDist(ids=torch.tensor([7, 3]), probs=torch.tensor([0.75, 0.25])))
    timing = ServerTiming(0.001, 0.02, 0.003, 9, passes=1, pass_sequences=2, pass_tokens=5, pass_seconds=0.01)
    sent = pb.Proposal(drafts=[pb.DraftToken(token=4, q=dense), pb.DraftToken(token=7, q=sparse)],
                       timing=pc.timing_to_proto(timing), first_draft_s=0.01, last_draft_s=0.03, prepared=True)
    wire = _off_the_wire(sent)
    reply = pc.draft_reply_from_proto(wire)
    assert [d.token for d in reply.drafts] == [4, 7]
    assert all(isinstance(d.q, pc.WireDist) for d in reply.drafts)
    assert reply.timing == timing.reported() and reply.prepared and reply.wire_bytes == wire.ByteSize()
    assert (reply.first_draft_s, reply.last_draft_s) == (0.01, 0.03) and reply.drafting_s == pytest.approx(0.02)
    request = pc.verify_request("s", 1, 4, [1], reply.drafts, SamplingParams(1.0, seed=1))
    assert list(request.draft_tokens) == [4, 7] and list(request.draft_q) == [dense, sparse]
    assert len(pc.verify_request("s", 1, 4, [1], reply.drafts, SamplingParams()).draft_q) == 0  # greedy: no q
    greedy = pc.draft_reply_from_proto(_off_the_wire(pb.Proposal(drafts=[pb.DraftToken(token=4)])))
    assert greedy.drafts == [DraftToken(4, None)] and not greedy.prepared and greedy.timing == CallTiming()


def test_a_verify_reply_decodes_at_the_boundary():
    timing = ServerTiming(0.002, 0.03, 0.001, 6, passes=2, pass_sequences=8, pass_tokens=24, pass_seconds=0.04)
    wire = _off_the_wire(pc.verdict_to_proto(Verdict(2, 9, decoded=(5, 6)), timing))
    reply = pc.verify_reply_from_proto(wire)
    assert reply.verdict == Verdict(2, 9, PassLoad(4.0, 12.0, 0.02), (5, 6)) == pc.verdict_from_proto(wire)
    assert reply.timing == timing.reported() and reply.wire_bytes == wire.ByteSize()
    assert pc.verify_reply_from_proto(pb.VerifyResponse(accepted=1)).verdict.passes is None  # not reported


def test_small_replies_and_requests_of_the_coordinator():
    assert pc.ended_from_proto(pb.EndSessionResponse(existed=True))
    assert pc.end_session_request("s").session_id == "s"
    assert pc.tokenizer_file_from_proto(pb.TokenizerChunk(file="tokenizer.json", data=b"{}")) == ("tokenizer.json",
                                                                                                  b"{}")
    request = pc.propose_request("s", 1, 0, [1, 2], 4, SamplingParams())
    assert pc.wire_bytes(request) == len(request.SerializeToString())


def test_model_facts_come_out_of_model_info_as_plain_values():
    facts = pc.model_facts_from_proto(pb.ModelInfo(model_name="t", vocab_size=32, vocab_fingerprint="fp",
                                                   max_context=64, eos_token_ids=[2, 3], gamma_max=8,
                                                   has_tokenizer=True))
    assert facts.eos_token_ids == frozenset({2, 3}) and facts.gamma_max == 8 and facts.has_tokenizer
    assert pc.model_facts_from_proto(pb.ModelInfo(model_name="old")).gamma_max is None  # not reported
