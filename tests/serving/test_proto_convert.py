"""protobuf <-> core conversions (specdec.serving.convert)."""

from __future__ import annotations

import pytest
import torch

from specdec.core.interfaces import DraftToken, SamplingParams, Verdict
from specdec.core.sampling import SparseDist
from specdec.proto import specdec_pb2 as pb
from specdec.serving import convert as pc
from specdec.serving.errors import InvalidRequest
from specdec.serving.timing import ServerTiming


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
    assert pc.timing_from_proto(msg.timing) == timing
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


def test_model_facts_come_out_of_model_info_as_plain_values():
    facts = pc.model_facts_from_proto(pb.ModelInfo(model_name="t", vocab_size=32, vocab_fingerprint="fp",
                                                   max_context=64, eos_token_ids=[2, 3], gamma_max=8,
                                                   has_tokenizer=True))
    assert facts.eos_token_ids == frozenset({2, 3}) and facts.gamma_max == 8 and facts.has_tokenizer
    assert pc.model_facts_from_proto(pb.ModelInfo(model_name="old")).gamma_max is None  # not reported
