"""Drafting ahead: while the target verifies, the draft service drafts the next
round as if every draft will be accepted. A later Propose reuses those drafts only
when it would have made exactly them, so reuse must be invisible in the output
and visible only in the work done."""

from __future__ import annotations

import pytest
import torch

from service_harness import LoopThread, channel, start_service
from specdec import proto_convert as pc
from specdec.local import draft_ahead, draft_tokens
from specdec.model_runner import ModelRunner
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.sampling import SamplingParams

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, top_k=10, seed=1234)
NEVER = lambda: False  # noqa: E731 -- a stop() that never asks to stop


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return ModelRunner(tiny_pair[1])


class CountForwards:
    """Counts the draft model's forward passes while installed."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.real, self.calls = runner, runner.logits, 0

        def logits(*a, **k):
            self.calls += 1
            return self.real(*a, **k)

        runner.logits = logits

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.runner.logits = self.real


def fresh(runner, tokens, gamma, params, k):
    """The drafts a sequence that never drafted ahead makes after ``tokens``."""
    return list(draft_tokens(runner, runner.new_sequence(), 0, tokens, gamma, params, k))


def assert_same_drafts(got, want):
    assert [d.token for d in got] == [d.token for d in want]
    for g, w in zip(got, want):
        if w.q is None:
            assert g.q is None
        elif isinstance(w.q, torch.Tensor):  # dense q
            assert torch.allclose(g.q, w.q, atol=1e-6)
        else:
            assert torch.equal(g.q.ids, w.q.ids) and torch.allclose(g.q.probs, w.q.probs, atol=1e-6)


def round_then_ahead(runner, params, k, gamma=3, count=6):
    """One round of ``gamma`` drafts after PROMPT, then drafting ahead."""
    seq = runner.new_sequence()
    drafts = list(draft_tokens(runner, seq, 0, PROMPT, gamma, params, k))
    made = draft_ahead(runner, seq, params, k, count, NEVER)
    return seq, drafts, made


@pytest.mark.parametrize("params,k", [(GREEDY, 0), (SAMPLED, 0), (SAMPLED, 6)], ids=["greedy", "dense", "top6"])
def test_all_accepted_and_bonus_guessed_reuses_the_drafts_made_ahead(draft, params, k):
    seq, drafts, made = round_then_ahead(draft, params, k)
    assert made == 6 and seq.ahead is not None
    guess = seq.ahead.drafts[0].token  # the draft's own pick for the target's bonus token
    history = PROMPT + [d.token for d in drafts] + [guess]
    with CountForwards(draft) as forwards:
        reused = list(draft_tokens(draft, seq, len(PROMPT) + 3, [guess], 4, params, k))
    assert forwards.calls == 0  # all four existed already
    assert_same_drafts(reused, fresh(draft, history, 4, params, k))
    assert seq.tokens == history + [d.token for d in reused]
    # and the sequence goes on exactly as a fresh one would
    nxt = list(draft_tokens(draft, seq, len(seq.tokens), [], 2, params, k))
    assert_same_drafts(nxt, fresh(draft, seq.tokens[: len(history) + 4], 2, params, k))


def test_fewer_drafts_made_ahead_than_asked_for_are_topped_up(draft):
    seq, drafts, _ = round_then_ahead(draft, SAMPLED, 6, count=3)  # the guess and two drafts
    guess = seq.ahead.drafts[0].token
    history = PROMPT + [d.token for d in drafts] + [guess]
    with CountForwards(draft) as forwards:
        got = list(draft_tokens(draft, seq, len(PROMPT) + 3, [guess], 5, SAMPLED, 6))
    assert forwards.calls == 3  # two reused, three drafted
    assert_same_drafts(got, fresh(draft, history, 5, SAMPLED, 6))


@pytest.mark.parametrize("case", ["other bonus", "drafts rejected", "other params", "other k"])
def test_anything_but_the_guessed_history_drafts_afresh(draft, case):
    seq, drafts, _ = round_then_ahead(draft, SAMPLED, 6)
    guess = seq.ahead.drafts[0].token
    position, new, params, k = len(PROMPT) + 3, [(guess + 1) % 32], SAMPLED, 6
    if case == "drafts rejected":  # one draft accepted, the target's correction is the guess
        position, new = len(PROMPT) + 1, [guess]
    elif case == "other params":
        new, params = [guess], SamplingParams(temperature=0.7, top_k=10, seed=1234)
    elif case == "other k":
        new, k = [guess], 5
    history = seq.tokens[:position] + new
    with CountForwards(draft) as forwards:
        got = list(draft_tokens(draft, seq, position, new, 3, params, k))
    assert forwards.calls == 3
    assert_same_drafts(got, fresh(draft, history, 3, params, k))
    assert seq.ahead is None


def test_drafts_made_ahead_serve_one_request_only(draft):
    seq, drafts, _ = round_then_ahead(draft, GREEDY, 0)
    ahead = seq.ahead
    list(draft_tokens(draft, seq, len(PROMPT), [7], 2, GREEDY, 0))  # another history: drafts afresh
    assert seq.ahead is None
    seq.ahead = ahead  # even put back, drafts made after a history that changed are not reused
    guess = ahead.drafts[0].token
    with CountForwards(draft) as forwards:
        list(draft_tokens(draft, seq, len(PROMPT) + 1, [guess], 2, GREEDY, 0))
    assert forwards.calls == 2


def test_stop_is_asked_before_every_token(draft):
    seq = draft.new_sequence()
    list(draft_tokens(draft, seq, 0, PROMPT, 2, GREEDY, 0))
    held = list(seq.tokens)
    assert draft_ahead(draft, seq, GREEDY, 0, 5, lambda: True) == 0
    assert seq.tokens == held and seq.ahead is None
    asked = iter([False, False, True])
    assert draft_ahead(draft, seq, GREEDY, 0, 5, lambda: next(asked)) == 2


def test_drafting_ahead_stops_at_the_context(draft):
    seq = draft.new_sequence()
    room = draft.max_context - len(PROMPT) - 2
    list(draft_tokens(draft, seq, 0, PROMPT + [1] * room, 1, GREEDY, 0))
    assert draft_ahead(draft, seq, GREEDY, 0, 5, NEVER) == 1
    assert len(seq.tokens) == draft.max_context


# ---------------------------------------------------------------- in the draft service


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def settle(service):
    """Wait until the model's executor has finished the background drafting."""
    service.host.executor.submit(lambda: None).result(20)


@pytest.mark.parametrize("ahead", [True, False], ids=["draft-ahead", "no-draft-ahead"])
def test_service_answers_a_guessed_round_without_running_the_model(loop, tiny_pair, draft, ahead):
    service = start_service(loop, "draft", tiny_pair[1], draft_ahead=ahead)
    try:
        with channel(service) as ch:
            stub = pb_grpc.DraftServiceStub(ch)
            first = list(stub.Propose(pc.propose_request("s", 1, 0, PROMPT, 3, SAMPLED, 6), timeout=20))
            settle(service)
            history = PROMPT + [m.token for m in first]
            guess = fresh(draft, history, 1, SAMPLED, 6)[0].token
            second = list(stub.Propose(pc.propose_request("s", 2, len(history), [guess], 3, SAMPLED, 6),
                                       timeout=20))
        expected = fresh(draft, history + [guess], 3, SAMPLED, 6)
        assert_same_drafts([pc.draft_token_from_proto(m, vocab_size=32) for m in second], expected)
        assert second[-1].timing.computed_tokens == (0 if ahead else 2 + 2)  # last draft + bonus, 2 drafts
    finally:
        loop.call(service.stop())
