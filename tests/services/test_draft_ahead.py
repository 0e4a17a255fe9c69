"""Drafting ahead: while the target verifies, the draft service drafts the next
round as if every draft will be accepted. A later Propose reuses those drafts only
when it would have made exactly them, so reuse must be invisible in the output
and visible only in the work done."""

from __future__ import annotations

import random

import grpc
import pytest
import torch

from specdec.core.interfaces import SamplingParams
from specdec.draft_service.servicer import DRAFT
from specdec.models.local import (
    DraftRule,
    branch_steps,
    draft_ahead,
    draft_tokens,
    new_draft_sequence,
    result_alone,
)
from specdec.models.runner import ModelRunner
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving import convert as pc
from specdec.serving.config import DraftConfig
from specdec.serving.model_host import start_model_service
from specdec.telemetry.metrics import ServiceMetrics
from specdec.telemetry.setup import ServiceTelemetry

from service_harness import LoopThread, channel, start_service

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, top_k=10, seed=1234)
NEVER = lambda: False  # noqa: E731 -- a stop() that never asks to stop


@pytest.fixture(scope="module")
def draft(tiny_pair):
    return ModelRunner(tiny_pair[1], lean=True)  # as the draft service runs it


class CountForwards:
    """Counts the draft model's forward passes while installed."""

    def __init__(self, runner: ModelRunner):
        self.runner, self.real, self.calls = runner, runner.run_passes, 0

        def run_passes(passes):
            self.calls += len(passes)
            return self.real(passes)

        runner.run_passes = run_passes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.runner.run_passes = self.real


def replay(runner, requests):
    """The drafts of the last of ``requests`` -- (position, new_tokens, gamma,
    params, k) -- made on a sequence that never drafted ahead."""
    seq = new_draft_sequence(runner)
    for position, new_tokens, gamma, params, k in requests:
        drafts = list(draft_tokens(runner, seq, position, new_tokens, gamma, params, DraftRule(k)))
    return drafts


def assert_same_drafts(got, want):
    """Same tokens and bit-identical q: the same passes ran (float rounding
    depends on how tokens are grouped into passes)."""
    assert [d.token for d in got] == [d.token for d in want]
    for g, w in zip(got, want, strict=True):
        if w.q is None:
            assert g.q is None
        elif isinstance(w.q, torch.Tensor):  # dense q
            assert torch.equal(g.q, w.q)
        else:
            assert torch.equal(g.q.ids, w.q.ids) and torch.equal(g.q.probs, w.q.probs)


START = len(PROMPT) + 3  # where drafting ahead starts after the first round's three drafts


def round_then_ahead(runner, params, k, count=6):
    """A first round of three drafts after PROMPT, then drafting ahead; returns
    the sequence, the first request and the guess at the target's token."""
    seq = new_draft_sequence(runner, branching=True)
    first = (0, PROMPT, 3, params, k)
    list(draft_tokens(runner, seq, *first[:3], params, DraftRule(k)))
    assert draft_ahead(runner, seq, params, DraftRule(k), count, NEVER) == count
    return seq, first, seq.ahead.drafts[0].token


@pytest.mark.parametrize("params,k", [(GREEDY, 0), (SAMPLED, 0), (SAMPLED, 6)], ids=["greedy", "dense", "top6"])
def test_all_accepted_and_guessed_reuses_the_drafts_made_ahead(draft, params, k):
    seq, first, guess = round_then_ahead(draft, params, k)
    second = (START, [guess], 4, params, k)  # every draft accepted; the target's token is the guess
    with CountForwards(draft) as forwards:
        reused = list(draft_tokens(draft, seq, *second[:3], params, DraftRule(k)))
    assert forwards.calls == 0  # all four existed already
    assert_same_drafts(reused, replay(draft, [first, second]))
    assert len(seq.tokens) == START + 1 + 4
    # and the sequence goes on exactly as one that never drafted ahead
    third = (len(seq.tokens), [7], 2, params, k)
    assert_same_drafts(list(draft_tokens(draft, seq, *third[:3], params, DraftRule(k))),
                       replay(draft, [first, second, third]))


def test_fewer_drafts_made_ahead_than_asked_for_are_topped_up(draft):
    seq, first, guess = round_then_ahead(draft, SAMPLED, 6, count=3)  # the guess and two drafts
    second = (START, [guess], 5, SAMPLED, 6)
    with CountForwards(draft) as forwards:
        got = list(draft_tokens(draft, seq, *second[:3], SAMPLED, DraftRule(6)))
    assert forwards.calls == 3  # two reused, three drafted
    assert_same_drafts(got, replay(draft, [first, second]))


@pytest.mark.parametrize("case", ["other token", "drafts rejected", "re-sent drafts", "other seed", "other k"])
def test_anything_but_the_round_bet_on_drafts_afresh(draft, case):
    seq, first, guess = round_then_ahead(draft, SAMPLED, 6)
    position, new, params, k = START, [(guess + 1) % 32], SAMPLED, 6
    if case == "drafts rejected":  # one draft accepted; the target's correction happens to be the guess
        position, new = len(PROMPT) + 1, [guess]
    elif case == "re-sent drafts":  # the same history, but the request re-sends held drafts
        position, new = len(PROMPT) + 1, seq.tokens[len(PROMPT) + 1:START] + [guess]
    elif case == "other seed":
        new, params = [guess], SamplingParams(temperature=1.0, top_k=10, seed=4321)
    elif case == "other k":
        new, k = [guess], 5
    second = (position, new, 3, params, k)
    with CountForwards(draft) as forwards:
        got = list(draft_tokens(draft, seq, *second[:3], params, DraftRule(k)))
    assert forwards.calls == 3
    assert_same_drafts(got, replay(draft, [first, second]))
    assert seq.ahead is None


@pytest.mark.parametrize("params,k", [(GREEDY, 0), (SAMPLED, 6)], ids=["greedy", "top6"])
def test_random_rounds_run_the_same_passes_with_and_without_drafting_ahead(draft, params, k):
    """Coordinator-like rounds with random γ (0 included), random acceptance,
    a next token that is the guess half the time, drafting ahead stopped after a
    random number of steps, and now and then a re-pre-fill from position 0: after
    every request both sequences hold the same tokens and cache, and every draft
    and q is bit-identical."""
    rng = random.Random(f"{params}{k}")
    reused = 0
    for _ in range(3):  # episodes within the tiny model's context of 128
        reused += _random_episode(draft, params, k, rng)
    assert reused >= 5  # the reuse path ran, not just the fallback


def _random_episode(draft, params, k, rng) -> int:
    ahead_seq, plain_seq = new_draft_sequence(draft), new_draft_sequence(draft)
    committed, synced, reused = list(PROMPT), 0, 0
    while len(committed) + 2 * 7 < draft.max_context:
        gamma = rng.choice([0, 1, 2, 3, 4])
        guess = None
        if gamma:
            if rng.random() < 0.1:  # the coordinator re-pre-fills after an eviction
                synced = 0
            request = (synced, committed[synced:], gamma)
            with CountForwards(draft) as forwards:
                got = list(draft_tokens(draft, ahead_seq, *request, params, DraftRule(k)))
            reused += forwards.calls < gamma
            want = list(draft_tokens(draft, plain_seq, *request, params, DraftRule(k)))
            assert_same_drafts(got, want)
            assert ahead_seq.tokens == plain_seq.tokens and ahead_seq.cache_length == plain_seq.cache_length
            steps = iter(range(rng.randint(0, gamma + 3), -1, -1))
            draft_ahead(draft, ahead_seq, params, DraftRule(k), gamma + 3, lambda steps=steps: next(steps) == 0)
            guess = ahead_seq.ahead.drafts[0].token if ahead_seq.ahead.drafts else None
        accepted = rng.randint(0, gamma)
        nxt = guess if accepted == gamma and guess is not None and rng.random() < 0.5 else rng.randrange(32)
        base = len(committed)
        committed += [d.token for d in got[:accepted]] + [nxt] if gamma else [nxt]
        if gamma:
            synced = base + accepted
    return reused


def test_drafts_made_ahead_serve_one_request_only(draft):
    seq, first, guess = round_then_ahead(draft, GREEDY, 0)
    ahead = seq.ahead
    list(draft_tokens(draft, seq, START, [(guess + 1) % 32], 2, GREEDY))  # another token: drafts afresh
    assert seq.ahead is None
    seq.ahead = ahead  # even put back, drafts made after a history that changed are not reused
    with CountForwards(draft) as forwards:
        list(draft_tokens(draft, seq, START, [guess], 2, GREEDY))
    assert forwards.calls == 2


def test_stop_is_asked_before_every_token(draft):
    seq = new_draft_sequence(draft)
    list(draft_tokens(draft, seq, 0, PROMPT, 2, GREEDY))
    held = list(seq.tokens)
    assert draft_ahead(draft, seq, GREEDY, DraftRule(), 5, lambda: True) == 0
    assert seq.tokens == held and not seq.ahead.drafts
    asked = iter([False, False, True])
    assert draft_ahead(draft, seq, GREEDY, DraftRule(), 5, lambda: next(asked)) == 2


def test_drafting_ahead_stops_at_the_context(draft):
    seq = new_draft_sequence(draft)
    room = draft.max_context - len(PROMPT) - 2
    list(draft_tokens(draft, seq, 0, PROMPT + [1] * room, 1, GREEDY))
    assert draft_ahead(draft, seq, GREEDY, DraftRule(), 5, NEVER) == 1
    assert len(seq.tokens) == draft.max_context


@pytest.mark.parametrize("params,k", [(GREEDY, 0), (SAMPLED, 0), (SAMPLED, 6)], ids=["greedy", "dense", "top6"])
@pytest.mark.parametrize("rejected", [0, 1])
def test_a_rejection_corrected_with_the_runner_up_reuses_the_branch_drafted_for_it(draft, params, k, rejected):
    """The target rejects draft ``rejected`` and corrects it with the draft's
    own runner-up there: the next round's drafts exist already, on a fork that
    shares the session's blocks, bit for bit what a fresh request makes; and the
    session goes on from them as one that never branched."""
    seq, first, _ = round_then_ahead(draft, params, k)
    position = len(PROMPT) + rejected
    correction = seq.runner_ups[position]
    for j in range(2):
        assert result_alone(draft, branch_steps(draft, seq, len(PROMPT) + j, params, DraftRule(k), 4, NEVER)) == 4
    second = (position, [correction], 3, params, k)
    with CountForwards(draft) as forwards:
        got = list(draft_tokens(draft, seq, *second[:3], params, DraftRule(k)))
    assert forwards.calls == 0  # all three existed already
    assert_same_drafts(got, replay(draft, [first, second]))
    assert seq.tokens[:position] == replay_tokens(draft, [first])[:position] and not seq.branches
    third = (len(seq.tokens), [7], 2, params, k)
    assert_same_drafts(list(draft_tokens(draft, seq, *third[:3], params, DraftRule(k))),
                       replay(draft, [first, second, third]))


def test_another_correction_than_the_runner_up_drafts_afresh(draft):
    seq, first, _ = round_then_ahead(draft, SAMPLED, 6)
    position = len(PROMPT)
    result_alone(draft, branch_steps(draft, seq, position, SAMPLED, DraftRule(6), 4, NEVER))
    other = (seq.runner_ups[position] + 1) % 32
    second = (position, [other], 3, SAMPLED, 6)
    with CountForwards(draft) as forwards:
        got = list(draft_tokens(draft, seq, *second[:3], SAMPLED, DraftRule(6)))
    assert forwards.calls == 3
    assert_same_drafts(got, replay(draft, [first, second]))


def replay_tokens(runner, requests) -> list[int]:
    seq = new_draft_sequence(runner)
    for position, new_tokens, gamma, params, k in requests:
        list(draft_tokens(runner, seq, position, new_tokens, gamma, params, DraftRule(k)))
    return seq.tokens


# ---------------------------------------------------------------- in the draft service


@pytest.fixture(scope="module")
def loop():
    lt = LoopThread()
    yield lt
    lt.close()


def settle(service):
    """Wait until the background drafting has finished."""
    if service.host.worker.background is not None:
        service.host.worker.background.result(20)


@pytest.mark.parametrize("ahead", [True, False], ids=["draft-ahead", "no-draft-ahead"])
def test_service_answers_a_guessed_round_without_running_the_model(loop, tiny_pair, draft, ahead):
    metrics = ServiceMetrics("draft")
    config = DraftConfig(model=str(tiny_pair[1]), host="127.0.0.1", port=0, draft_ahead=ahead)
    service, _ = loop.call(start_model_service(config, DRAFT, telemetry=ServiceTelemetry("draft", metrics)))
    try:
        with channel(service) as ch:
            stub = pb_grpc.DraftServiceStub(ch)
            first = list(stub.Propose(pc.propose_request("s", 1, 0, PROMPT, 3, SAMPLED, 6), timeout=20))
            settle(service)
            history = PROMPT + [m.token for m in first]
            guess = replay(draft, [(0, PROMPT, 4, SAMPLED, 6)])[-1].token  # the draft's own next pick
            second = list(stub.Propose(pc.propose_request("s", 2, len(history), [guess], 3, SAMPLED, 6),
                                       timeout=20))
        expected = replay(draft, [(0, PROMPT, 3, SAMPLED, 6), (len(history), [guess], 3, SAMPLED, 6)])
        assert_same_drafts([pc.draft_token_from_proto(m, vocab_size=32) for m in second], expected)
        assert second[-1].timing.computed_tokens == (0 if ahead else 2 + 2)  # last draft + bonus, 2 drafts
        settle(service)

        def counted(outcome):
            return metrics.registry.get_sample_value(
                "specdec_draft_ahead_tokens_total", {"service": "draft", "outcome": outcome}) or 0

        # two rounds drafted ahead (after the guess, 3 + 2 drafts each); the second round reused three
        assert (counted("made"), counted("reused")) == ((10, 3) if ahead else (0, 0))
    finally:
        loop.call(service.stop())


def test_positions_inside_drafts_made_ahead_are_refused(loop, tiny_pair):
    """Drafts made ahead are the service's bet, not what the caller was told it
    holds: a position among them is refused exactly as without drafting ahead."""
    service = start_service(loop, "draft", tiny_pair[1])
    try:
        with channel(service) as ch:
            stub = pb_grpc.DraftServiceStub(ch)
            list(stub.Propose(pc.propose_request("p", 1, 0, PROMPT, 3, GREEDY, 0), timeout=20))
            settle(service)
            with pytest.raises(grpc.RpcError) as refused:
                list(stub.Propose(pc.propose_request("p", 2, len(PROMPT) + 4, [5], 1, GREEDY, 0), timeout=20))
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            # the session is intact: the round bet on still works
            assert len(list(stub.Propose(pc.propose_request("p", 3, len(PROMPT) + 3, [5], 2, GREEDY, 0),
                                         timeout=20))) == 2
    finally:
        loop.call(service.stop())


def test_serve_turns_drafting_ahead_off_where_the_draft_would_take_the_targets_compute():
    """What the two compete for is the core that drives each model's passes, on a
    GPU too; one GPU shared by both is no reason (docs/gpu-check.md)."""
    from specdec.cli.serve import draft_shares_target_cores as shares

    assert shares({"draft": {1}, "target": {1}, "coordinator": {1}})
    assert not shares({"draft": {0}, "target": {1}, "coordinator": {1}})


def test_the_service_answers_a_round_after_an_early_rejection_from_the_branch_it_prepared(loop, tiny_pair, draft):
    """ProposeAll: the target rejected the first draft and corrected it with the
    draft's runner-up; the service had drafted that round while the target
    verified (``prepared``, no forward pass), the very drafts of a fresh request."""
    service = start_service(loop, "draft", tiny_pair[1])
    try:
        with channel(service) as ch:
            stub = pb_grpc.DraftServiceStub(ch)
            first = stub.ProposeAll(pc.propose_request("b", 1, 0, PROMPT, 3, GREEDY, 0), timeout=20)
            assert not first.prepared and len(first.drafts) == 3
            settle(service)
            seq = new_draft_sequence(draft)
            seq.tokens.extend(PROMPT)
            logits = draft.logits(seq)[0]
            correction = next(t for t in torch.topk(logits, 2).indices.tolist() if t != first.drafts[0].token)
            second = stub.ProposeAll(pc.propose_request("b", 2, len(PROMPT), [correction], 3, GREEDY, 0),
                                     timeout=20)
        assert second.prepared and second.timing.computed_tokens == 0
        expected = replay(draft, [(0, PROMPT, 3, GREEDY, 0), (len(PROMPT), [correction], 3, GREEDY, 0)])
        assert [d.token for d in second.drafts] == [d.token for d in expected]
    finally:
        loop.call(service.stop())
