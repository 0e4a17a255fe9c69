"""Verifier unit tests on hand-built p and q, in the style of vLLM's
rejection-sampler tests: exact greedy cases, edge cases of the stochastic rule,
seeded determinism, and statistical checks against p, each with a negative
control that the same check rejects.

Terms: p is the target's distribution at a position, q the draft's; a draft y
(sampled from q) is accepted with probability min(1, p(y)/q(y)); at the first
rejection the correction is sampled from the residual r = max(0, p - q)/Z, where
Z = Σ max(0, p - q), or from p itself when Z is (about) 0."""

import pytest
import torch
from scipy import stats

from specdec.core import verification
from specdec.core.sampling import STREAM_DRAFT, STREAM_TARGET, sample, uniform
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


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square of token ``counts`` against ``probs``, over the tokens ``probs``
    allows (callers check the others' counts are 0)."""
    support = probs > 0
    expected = probs[support].double() / probs[support].double().sum() * counts.sum().item()
    return stats.chisquare(counts[support].double().numpy(), expected.numpy()).pvalue


# A rejection with no residual mass. Rejecting y needs q(y) > p(y); if q >= p at
# every other token too, max(0, p - q) is 0 everywhere (Z = 0). With normalised
# distributions that happens only through rounding (p ≈ q), and Z can also come
# out tiny but not 0 (below RESIDUAL_EPS). Either way the correction must follow
# p itself: not the empty (or noise-only) residual, and not q.
P_RES = dist(0.1, 0.2, 0.3, 0.15, 0.25)  # not uniform: p is told apart from q and from uniform
DRAFTED = 2
ROUNDS = 6000  # one-draft rounds per case; about half are rejections


def no_residual_q(residual: float) -> torch.Tensor:
    """q for one draft of DRAFTED under P_RES: p with the drafted token twice as
    likely (so it is rejected with probability 1/2) and ``residual`` of p's mass
    at token 0 left uncovered (Z = ``residual``)."""
    q = P_RES.clone()
    q[DRAFTED] *= 2
    q[0] -= residual
    return q.unsqueeze(0)


def rejection_corrections(q: torch.Tensor) -> torch.Tensor:
    """Counts, per token, of the correction emitted in the rejected rounds among
    ROUNDS one-draft rounds (seed s at position s % 13)."""
    p = torch.stack([P_RES, dist(1, 1, 1, 1, 1)])
    counts = torch.zeros(V)
    for seed in range(ROUNDS):
        v = verify_stochastic([DRAFTED], q, p, seed=seed, first_position=seed % 13)
        if v.accepted == 0:
            counts[v.next_token] += 1
    return counts


@pytest.mark.parametrize("residual", [0.0, 5e-7], ids=["Z=0", "Z=5e-7"])
def test_a_rejection_without_residual_mass_samples_the_correction_from_p(residual):
    q = no_residual_q(residual)
    assert float(torch.clamp(P_RES - q[0], min=0).sum()) == pytest.approx(residual, abs=1e-8)
    assert residual <= verification.RESIDUAL_EPS
    counts = rejection_corrections(q)
    assert 0.45 * ROUNDS < counts.sum() < 0.55 * ROUNDS  # accepted with p(y)/q(y) = 1/2
    pvalue = chi_square_pvalue(counts, P_RES)
    assert pvalue > 1e-3, (counts, pvalue)


def test_the_no_residual_check_has_power(monkeypatch):
    """Negative controls: the same check rejects a correction sampled from the
    tiny residual as it is (RESIDUAL_EPS = 0: always token 0 here), and one
    sampled from the draft's q instead of p."""
    q = no_residual_q(5e-7)
    with monkeypatch.context() as m:
        m.setattr(verification, "RESIDUAL_EPS", 0.0)
        counts = rejection_corrections(q)
    assert counts[0] == counts.sum() > 0
    assert chi_square_pvalue(counts, P_RES) < 1e-6

    def correction_from_q(p, q, seed, position):
        return sample(q, uniform(seed, position, STREAM_TARGET))

    monkeypatch.setattr(verification, "_correction", correction_from_q)
    assert chi_square_pvalue(rejection_corrections(no_residual_q(0.0)), P_RES) < 1e-6


def test_seeded_determinism():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, V, generator=g), -1)
    q = torch.softmax(torch.randn(4, V, generator=g), -1)
    drafts = [0, 1, 2, 3]
    a = [verify_stochastic(drafts, q, p, seed=s, first_position=7) for s in range(30)]
    b = [verify_stochastic(drafts, q, p, seed=s, first_position=7) for s in range(30)]
    assert a == b
    assert len(set(a)) > 1  # and the seed matters


# One step end to end: y ~ q, then verify. The emitted token (y if accepted, else
# the correction) must follow p exactly, though q puts mass where p has none.
P_STEP = torch.stack([dist(0.05, 0.4, 0.3, 0.0, 0.25), dist(1, 1, 1, 1, 1)])
Q_STEP = dist(0.3, 0.1, 0.1, 0.4, 0.1).unsqueeze(0)
STEPS = 20000


def one_step_counts() -> torch.Tensor:
    counts = torch.zeros(V)
    for seed in range(STEPS):
        y = sample(Q_STEP[0], uniform(seed, 0, STREAM_DRAFT))
        v = verify_stochastic([y], Q_STEP, P_STEP, seed=seed, first_position=0)
        counts[y if v.accepted else v.next_token] += 1
    return counts


def test_one_step_output_is_distributed_as_p():
    counts = one_step_counts()
    assert counts[3] == 0
    pvalue = chi_square_pvalue(counts, P_STEP[0])
    assert pvalue > 1e-3, (counts, pvalue)


def test_the_one_step_check_has_power(monkeypatch):
    """Negative control: a correction resampled from p instead of the residual
    (a classic mistake: it over-weights what the draft already covers) emits
    min(p, q) + (1 - Σ min(p, q))·p, and the same check rejects it."""

    def correction_from_p(p, q, seed, position):
        return sample(p, uniform(seed, position, STREAM_TARGET))

    monkeypatch.setattr(verification, "_correction", correction_from_p)
    counts = one_step_counts()
    assert counts[3] == 0  # p still excludes token 3: only the chi-square can tell
    assert chi_square_pvalue(counts, P_STEP[0]) < 1e-6
