"""scripts/replay_greedy_traces.py: the replay a γ schedule's analysis rests on,
checked against rounds counted by hand."""

import importlib.util
import pathlib

import pytest

from specdec.core.gamma import HeuristicGamma, RoundCost, StaticGamma

_SPEC = importlib.util.spec_from_file_location(
    "replay_greedy_traces", pathlib.Path(__file__).parents[2] / "scripts" / "replay_greedy_traces.py")
replay_script = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(replay_script)

# 1 s per draft, 10 s to verify plus 1 s per draft: round(γ) = 11·[γ > 0]·... easy to count.
COST = RoundCost(draft_fixed=0.0, draft_per_token=1.0, verify_fixed=10.0, verify_per_token=1.0)


def trace(match: list[int], confidence: float | list[float] = 0.9, lookahead: int = 8) -> dict:
    row = confidence if isinstance(confidence, list) else [confidence] * lookahead
    return {"match": match, "confidence": [row] * len(match)}


def test_static_rounds_counted_by_hand():
    # Drafts always match 2 ahead: static:2 makes 3 tokens a round at 2 + 12 s.
    t = trace([2] * 9)
    assert replay_script.replay([t], lambda: StaticGamma(2), COST) == pytest.approx(9 / (3 * 14))
    # static:0: one token per 10 s round.
    assert replay_script.replay([t], lambda: StaticGamma(0), COST) == pytest.approx(0.1)
    # static:4 accepts 2 of 4 (3 tokens for 4 + 14 s); the last round (i = 6) is
    # clamped to the 2 drafts left before the request's end.
    assert replay_script.replay([t], lambda: StaticGamma(4), COST) == pytest.approx(9 / (18 + 18 + 14))


def test_drafts_made_ahead_are_free_after_a_full_round_whose_guess_was_right():
    # match 3 everywhere: static:2 accepts both drafts and the draft's guess of
    # the target's next token (the 3rd) is right, so from the second round on
    # the drafts are ready (2 + DRAFT_AHEAD_EXTRA of them; 0 s, COST has no fixed
    # draft cost): 3 rounds of 3 tokens, 14 + 12 + 12 s.
    t = trace([3] * 9)
    assert replay_script.replay([t], lambda: StaticGamma(2), COST, draft_ahead=True) == pytest.approx(9 / 38)
    # match 2: all accepted but the guess is wrong: nothing is ready, as without.
    t = trace([2] * 9)
    assert replay_script.replay([t], lambda: StaticGamma(2), COST, draft_ahead=True) == \
        pytest.approx(replay_script.replay([t], lambda: StaticGamma(2), COST))


def test_the_request_end_clamps_gamma():
    # A single position: no room for a draft; one plain round.
    assert replay_script.replay([trace([5])], lambda: StaticGamma(4), COST) == pytest.approx(0.1)


def test_a_low_confidence_draft_ends_the_round():
    # The second draft's confidence is below τ: the draft stops after it (2 drafts),
    # both accepted: 3 tokens per 2 + 12 s round, as static:2.
    t = trace([6] * 9, confidence=[0.9, 0.01, 0.9, 0.9, 0.9, 0.9, 0.9, 0.9])
    stopped = replay_script.replay([t], lambda: StaticGamma(6), COST, stop_below=0.05)
    assert stopped == pytest.approx(replay_script.replay([t], lambda: StaticGamma(2), COST))


def test_two_state_schedule_follows_the_last_round():
    policy = replay_script.TwoStateGamma(after_full=5, after_other=1)
    assert policy.choose() == 1
    # Round 1 (γ 1) is fully accepted -> γ 5; it accepts 3 of 5 -> back to 1.
    t = trace([4, 0, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0], lookahead=8)
    seen = []

    class Spy(replay_script.TwoStateGamma):
        def choose(self):
            seen.append(super().choose())
            return seen[-1]

    replay_script.replay([t], lambda: Spy(5, 1), COST)
    assert seen[:3] == [1, 5, 1]


def test_heuristic_and_adaptive_replay_without_error():
    t = trace([3, 0, 8, 1, 2, 0, 5, 4] * 6)
    for make in (lambda: HeuristicGamma(gamma_max=8), replay_script.AdaptiveGamma):
        assert replay_script.replay([t, t], make, COST) > 0
