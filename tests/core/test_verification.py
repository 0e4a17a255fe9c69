"""Verifier unit tests on hand-built p and q, in the style of vLLM's
rejection-sampler tests: exact greedy cases, edge cases of the stochastic rule,
seeded determinism, and a statistical check of one step against p."""

import torch
from scipy import stats

from specdec.core.verification import verify_greedy, verify_stochastic

V = 5


def one_hot_logits(ids):
    logits = torch.full((len(ids), V), -10.0)
    logits[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return logits


def test_greedy_perfect_match_takes_bonus():
    v = verify_greedy([1, 2, 3], one_hot_logits([1, 2, 3, 4]))
    assert (v.accepted, v.next_token) == (3, 4)


def test_greedy_early_mismatch_corrects():
    v = verify_greedy([1, 0, 3], one_hot_logits([1, 2, 3, 4]))
    assert (v.accepted, v.next_token) == (1, 2)


def test_greedy_first_mismatch():
    v = verify_greedy([0, 2, 3], one_hot_logits([1, 2, 3, 4]))
    assert (v.accepted, v.next_token) == (0, 1)


def test_greedy_no_drafts_is_plain_decoding():
    v = verify_greedy([], one_hot_logits([3]))
    assert (v.accepted, v.next_token) == (0, 3)


def dist(*values):
    t = torch.tensor(values, dtype=torch.float32)
    return t / t.sum()


def test_stochastic_p_equals_q_accepts_everything():
    p = torch.stack([dist(1, 2, 3, 4, 5)] * 4)
    q = p[:3].clone()
    for seed in range(50):
        v = verify_stochastic([4, 0, 2], q, p, seed=seed, first_position=10)
        assert v.accepted == 3


def test_stochastic_never_accepts_target_zero():
    p = torch.stack([dist(0, 1, 1, 1, 1), dist(1, 1, 1, 1, 1)])
    q = dist(1, 0, 0, 0, 0).unsqueeze(0)  # the draft can only propose token 0
    for seed in range(200):
        v = verify_stochastic([0], q, p, seed=seed, first_position=0)
        assert v.accepted == 0
        assert v.next_token != 0  # the residual max(0, p - q) excludes token 0


def test_stochastic_early_mismatch_samples_from_residual():
    # p puts all mass on token 3, q on token 1: always rejected, correction = 3.
    p = torch.stack([dist(0, 0, 0, 1, 0)] * 3)
    q = torch.stack([dist(0, 1, 0, 0, 0)] * 2)
    v = verify_stochastic([1, 1], q, p, seed=0, first_position=5)
    assert (v.accepted, v.next_token) == (0, 3)


def test_stochastic_all_accepted_then_bonus_from_last_p():
    p = torch.stack([dist(0, 1, 0, 0, 0), dist(0, 0, 1, 0, 0), dist(0, 0, 0, 0, 1)])
    q = p[:2].clone()
    v = verify_stochastic([1, 2], q, p, seed=3, first_position=0)
    assert (v.accepted, v.next_token) == (2, 4)


def test_zero_residual_falls_back_to_p():
    # Rejection with p ≈ q can only come from rounding; the residual is then ~0 and
    # the correction must come from p, not from a division by Z ≈ 0.
    p = dist(1, 1, 1, 1, 1).unsqueeze(0).repeat(2, 1)
    q = (p[:1] * (1 + 1e-8)).clone()
    q[0, 2] = p[0, 2] * 2  # the drafted token looks twice as likely to the draft
    for seed in range(100):
        v = verify_stochastic([2], q, p, seed=seed, first_position=0)
        assert 0 <= v.next_token < V


def test_seeded_determinism():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, V, generator=g), -1)
    q = torch.softmax(torch.randn(4, V, generator=g), -1)
    drafts = [0, 1, 2, 3]
    a = [verify_stochastic(drafts, q, p, seed=s, first_position=7) for s in range(30)]
    b = [verify_stochastic(drafts, q, p, seed=s, first_position=7) for s in range(30)]
    assert a == b
    assert len(set(a)) > 1  # and the seed matters


def test_one_step_output_is_distributed_as_p():
    """Draft y ~ q, then verify: the emitted token must follow p exactly."""
    from specdec.core.sampling import STREAM_DRAFT, sample, uniform

    p = torch.stack([dist(0.05, 0.4, 0.3, 0.0, 0.25), dist(1, 1, 1, 1, 1)])
    q = dist(0.3, 0.1, 0.1, 0.4, 0.1).unsqueeze(0)  # q puts mass where p has none
    n = 20000
    counts = torch.zeros(V)
    for seed in range(n):
        y = sample(q[0], uniform(seed, 0, STREAM_DRAFT))
        v = verify_stochastic([y], q, p, seed=seed, first_position=0)
        counts[y if v.accepted else v.next_token] += 1
    assert counts[3] == 0
    support = p[0] > 0
    _, pvalue = stats.chisquare(counts[support].numpy(), (p[0][support] * n).numpy())
    assert pvalue > 1e-3, (counts, pvalue)
