"""The round step machine, driven by fake sides (synchronously and on an event
loop): rejections, cuts, evictions and re-pre-fills, failover and resume all
leave the output exactly the target's, and positions and round ids are the
machine's alone."""

from __future__ import annotations

import asyncio

import pytest

from specdec.core.gamma import StaticGamma
from specdec.core.interfaces import Drafted, DraftToken, SamplingParams, SessionLost, SessionState, Verdict
from specdec.core.rounds import Limits, Propose, RoundMachine, Verify, run_machine, run_rounds_async

V = 50
EOS = 0
GREEDY = SamplingParams(seed=1)


def target_next(prefix: list[int]) -> int:
    """The fake target's greedy choice after ``prefix`` (never EOS)."""
    return 1 + (sum(prefix) * 31 + len(prefix) * 7) % (V - 1)


def target_only(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(target_next(tokens))
    return tokens[len(prompt):]


class Side:
    """What a service holds of the session: a sequence it rolls back and extends
    as calls say, refusing a position beyond it (the services' FAILED_PRECONDITION)."""

    def __init__(self, name: str):
        self.name, self.seq, self.round_ids = name, [], []
        self.evict_at: set[int] = set()  # round ids at which it has lost the session

    def apply(self, call) -> None:
        self.round_ids.append(call.round_id)
        if call.round_id in self.evict_at and call.position > 0:
            self.evict_at.discard(call.round_id)
            self.seq = []
            raise SessionLost(self.name, "evicted")
        assert call.position <= len(self.seq), f"{self.name}: position {call.position} beyond {len(self.seq)}"
        self.seq[call.position:] = call.new_tokens


class FakeDraft(Side):
    """Drafts the target's choice except where ``wrong(prefix)`` says."""

    def __init__(self, wrong=lambda prefix: len(prefix) % 3 == 0):
        super().__init__("draft")
        self.wrong = wrong

    def propose(self, call: Propose):
        self.apply(call)
        for _ in range(call.gamma):
            token = target_next(self.seq)
            token = token % (V - 1) + 1 if self.wrong(self.seq) else token
            self.seq.append(token)
            yield DraftToken(token, None)


class FakeTarget(Side):
    def __init__(self):
        super().__init__("target")

    def verify(self, call: Verify) -> Verdict:
        self.apply(call)
        accepted = 0
        for d in call.drafts:
            if d.token != target_next(self.seq):
                break
            self.seq.append(d.token)
            accepted += 1
        nxt = target_next(self.seq)
        self.seq.append(nxt)
        decoded = []
        for _ in range(call.decode):
            decoded.append(target_next(self.seq))
            self.seq.append(decoded[-1])
        return Verdict(accepted, nxt, decoded=tuple(decoded))


class AsyncSides:
    """The same sides, awaited."""

    def __init__(self, draft: FakeDraft, target: FakeTarget):
        self.draft, self.target = draft, target

    async def propose(self, call):
        await asyncio.sleep(0)
        return Drafted(list(self.draft.propose(call)), 0.0)

    async def verify(self, call):
        await asyncio.sleep(0)
        return self.target.verify(call)


PROMPT = [3, 1, 4, 1, 5]


def machine(prompt=PROMPT, gamma=4, n=40, **limits) -> RoundMachine:
    return RoundMachine(SessionState(list(prompt)), params=GREEDY, gamma_policy=StaticGamma(gamma),
                        limits=Limits(n, limits.pop("context", 1000), **limits), drafting=gamma > 0)


def drive(m: RoundMachine, draft, target, mode: str):
    if mode == "sync":
        return list(run_machine(draft, target, m))

    async def collect():
        sides = AsyncSides(draft, target)
        return [r async for r in run_rounds_async(sides if draft else None, sides, m)]
    return asyncio.run(collect())


MODES = ["sync", "async"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("gamma", [0, 1, 4])
def test_greedy_output_is_the_targets_through_rejections(mode, gamma):
    m, draft, target = machine(gamma=gamma), FakeDraft(), FakeTarget()
    results = drive(m, draft if gamma else None, target, mode)
    assert m.state.tokens[len(PROMPT):] == target_only(PROMPT, 40)
    assert results[-1].finish_reason == "length" and sum(len(r.tokens) for r in results) == 40
    if gamma:
        assert any(r.accepted < r.gamma for r in results) and any(r.accepted == r.gamma for r in results)
    # both sides hold what the machine says they do
    assert target.seq[:m.state.target_synced] == m.state.tokens[:m.state.target_synced]
    assert draft.seq[:m.state.draft_synced] == m.state.tokens[:m.state.draft_synced] if gamma else True


def test_a_propose_and_its_verify_share_a_round_id_and_ids_grow():
    m, draft, target = machine(), FakeDraft(), FakeTarget()
    m.round_id = 10
    results = drive(m, draft, target, "sync")
    assert draft.round_ids == target.round_ids == list(range(10, 10 + len(results)))
    assert m.round_id == 10 + len(results)


def test_plain_rounds_ask_for_several_tokens_after_the_first():
    m, target = machine(gamma=0, n=20, plain_tokens=4), FakeTarget()
    calls = []
    while (call := m.next_call()) is not None:
        calls.append(call)
        m.verified(target.verify(call))
    assert [c.decode for c in calls] == [0, 3, 3, 3, 3, 2]  # the first token alone, then 4 at a time
    assert m.state.tokens[len(PROMPT):] == target_only(PROMPT, 20)


@pytest.mark.parametrize("mode", MODES)
def test_cut_by_eos_budget_and_context(mode):
    # EOS: the target's choice at the 7th new token is declared EOS.
    eos = target_only(PROMPT, 7)[-1]
    m = machine(eos_token_ids=frozenset({eos}))
    results = drive(m, FakeDraft(), FakeTarget(), mode)
    assert m.state.tokens[len(PROMPT):] == target_only(PROMPT, 7) and results[-1].finish_reason == "eos"
    # a budget ending mid-round
    m = machine(n=6, gamma=8)
    results = drive(m, FakeDraft(lambda p: False), FakeTarget(), mode)
    assert m.state.tokens[len(PROMPT):] == target_only(PROMPT, 6) and results[-1].finish_reason == "length"
    # the context: room for 3 more
    m = machine(context=len(PROMPT) + 3)
    drive(m, FakeDraft(), FakeTarget(), mode)
    assert len(m.state.tokens) == len(PROMPT) + 3


class StopAfter:
    """A stop sequence: the token ``word`` ends generation, kept."""

    def __init__(self, word: int):
        self.word = word

    def stop_after(self, tokens):
        return tokens.index(self.word) + 1 if self.word in tokens else None


def test_a_stop_sequence_cuts_inside_a_round_and_both_sides_stay_consistent():
    expected = target_only(PROMPT, 40)
    word = expected[9]
    m, draft, target = machine(gamma=6, stop=StopAfter(word)), FakeDraft(lambda p: False), FakeTarget()
    results = drive(m, draft, target, "sync")
    assert m.state.tokens[len(PROMPT):] == expected[:expected.index(word) + 1]
    assert results[-1].finish_reason == "stop"
    assert target.seq[:m.state.target_synced] == m.state.tokens[:m.state.target_synced]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("side", ["draft", "target"])
def test_a_side_that_lost_the_session_is_re_pre_filled_from_position_0(mode, side):
    m, draft, target = machine(), FakeDraft(), FakeTarget()
    lost = draft if side == "draft" else target
    lost.evict_at = {3, 6}
    results = drive(m, draft, target, mode)
    assert m.state.tokens[len(PROMPT):] == target_only(PROMPT, 40)
    assert not lost.evict_at
    # each loss: the call again from 0, under a fresh round id; the round counts the pre-fill
    refills = [r for r in results if (r.draft_caught_up if side == "draft" else r.target_caught_up) > 0]
    assert len(refills) >= 3  # the first round's pre-fill, and the two losses
    assert len(set(lost.round_ids)) == len(lost.round_ids)  # no id reused for another form of a call
    assert m.round_id == len(results) + 1 + 2


def test_failover_mid_turn_moves_the_target_to_a_fresh_replica():
    m, draft = machine(), FakeDraft()
    replicas = [FakeTarget(), FakeTarget()]
    current = [0]

    class Pool:
        def verify(self, call):
            if call.round_id == 4 and current[0] == 0:  # the first replica dies: the turn moves
                current[0] = 1
                raise SessionLost("target", "moved")
            return replicas[current[0]].verify(call)

    drive(m, draft, Pool(), "sync")
    assert m.state.tokens[len(PROMPT):] == target_only(PROMPT, 40)
    first_call = replicas[1].round_ids[0]
    assert first_call == 5  # a fresh id for the replica that took over
    assert replicas[1].seq[:m.state.target_synced] == m.state.tokens[:m.state.target_synced]


def test_a_resumed_turn_goes_on_from_what_was_committed():
    m, draft, target = machine(n=40), FakeDraft(), FakeTarget()
    rounds = run_machine(draft, target, m)
    for _ in range(3):
        next(rounds)
    rounds.close()  # the coordinator died: what it committed is in the directory
    committed = list(m.state.tokens)
    done = len(committed) - len(PROMPT)
    fresh = RoundMachine(SessionState(committed), params=GREEDY, gamma_policy=StaticGamma(4),
                         limits=Limits(40 - done, 1000), round_id=m.round_id + 1)
    drive(fresh, FakeDraft(), FakeTarget(), "sync")  # services that hold nothing of it
    assert fresh.state.tokens[len(PROMPT):] == target_only(PROMPT, 40)


def test_a_failed_call_ends_the_round_and_is_reported():
    seen = []

    class Observer:
        def round_started(self, index):
            seen.append(("start", index))

        def round_finished(self, result):
            seen.append(("done",))

        def round_failed(self, error):
            seen.append(("failed", str(error)))

    class Broken(FakeTarget):
        def verify(self, call):
            if call.round_id == 2:
                raise RuntimeError("target down")
            return super().verify(call)

    m = RoundMachine(SessionState(list(PROMPT)), params=GREEDY, gamma_policy=StaticGamma(2), limits=Limits(20, 99),
                     observer=Observer())
    with pytest.raises(RuntimeError):
        list(run_machine(FakeDraft(), Broken(), m))
    assert seen == [("start", 0), ("done",), ("start", 1), ("failed", "target down")]


def test_answers_out_of_turn_are_refused():
    m = machine()
    with pytest.raises(RuntimeError, match="not waiting"):
        m.verified(Verdict(0, 1))
    call = m.next_call()
    assert isinstance(call, Propose) and call.position == 0 and call.new_tokens == PROMPT
    with pytest.raises(RuntimeError, match="not waiting for a Verify"):
        m.verified(Verdict(0, 1))
    with pytest.raises(ValueError, match="side"):
        m.lost("coordinator")
