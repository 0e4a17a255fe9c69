"""Sampling is lossless: the decoder's first tokens follow the target's exact
distribution, computed by enumeration, for several processing settings, with
dense and with truncated (sparse) proposals and with γ changing every round.

To draw 20,000 samples per setting in seconds, the models are wrapped in a runner
that memoises logits per prefix (there are only V + V² prefixes here); the
decoder, the round loop, drafting, verification and sampling all run for real.
"""

import dataclasses
import os
import random

import pytest
import torch
from scipy import stats

import specdec.models.local
from specdec import SamplingParams, SpeculativeDecoder
from specdec.core.sampling import process_logits
from specdec.models.runner import ModelRunner, Sequence, replies

PROMPT = [3, 1, 4]
# 16,000 draws per setting here and in CI (at 256 cells, ~60 a cell); the GPU check (docs/gpu-check.md), where
# each draw costs several kernel launches, draws fewer.
SAMPLES = int(os.environ.get("SPECDEC_LOSSLESS_SAMPLES", 16_000))
assert SAMPLES >= 2000, f"SPECDEC_LOSSLESS_SAMPLES={SAMPLES}: too few draws for the chi-square check to mean much"
V = 16


class MemoRunner:
    """Quacks like ModelRunner; logits come from a dict keyed by prefix."""

    def __init__(self, runner: ModelRunner):
        self.inner = runner
        self.vocab_size, self.max_context, self.device = runner.vocab_size, runner.max_context, runner.device
        self.eos_token_ids, self.fingerprint, self.path = set(), runner.fingerprint, runner.path
        self.tokenizer = None
        self.memo: dict[tuple, torch.Tensor] = {}

    def new_sequence(self):
        return Sequence(tokens=[], cache=self.new_cache())

    def new_cache(self):
        return None

    def rollback(self, seq, position):
        del seq.tokens[position:]

    def uncache(self, seq, keep):
        pass  # no cache: logits come from the memo

    def run_passes(self, passes):
        return replies(passes, [self.logits(p.seq, p.last, p.run) for p in passes])

    def logits(self, seq, last=1, run=0):
        rows = []
        for end in range(len(seq.tokens) - last + 1, len(seq.tokens) + 1):
            key = tuple(seq.tokens[:end])
            if key not in self.memo:
                fresh = self.inner.new_sequence()
                fresh.tokens.extend(key)
                self.memo[key] = self.inner.logits(fresh)[0]
            rows.append(self.memo[key])
        return torch.stack(rows)


@dataclasses.dataclass
class RandomGamma:
    """γ drawn afresh every round: losslessness may not depend on it."""

    rng: random.Random

    def choose(self):
        return self.rng.randint(1, 3)

    def observe(self, *args):
        pass


@pytest.fixture(scope="module", params=["lean-target", "own-modules-target"])
def memo_pair(request, tmp_path_factory, device):
    """The target through the lean Llama layers (as every path runs it by
    default) or through its own modules; the draft through the lean ones."""
    from tiny_models import make_noisy_copy, make_tiny_llama

    root = tmp_path_factory.mktemp("lossless")
    target = make_tiny_llama(root / "t", vocab_size=V, layers=1, seed=3, logit_scale=3)
    draft = make_noisy_copy(target, root / "d", noise=0.6, seed=4)
    lean_target = request.param == "lean-target"
    return MemoRunner(ModelRunner(target, device, lean=lean_target)), MemoRunner(ModelRunner(draft, device, lean=True))


def exact_distribution(target: MemoRunner, params: SamplingParams) -> torch.Tensor:
    """P(x1, x2) = p(x1 | prompt) · p(x2 | prompt, x1), by enumeration."""
    seq = target.new_sequence()
    seq.tokens.extend(PROMPT)
    p1 = process_logits(target.logits(seq)[0], params).cpu()
    v = target.vocab_size
    joint = torch.zeros(v, v)
    for x1 in range(v):
        if p1[x1] > 0:
            seq = target.new_sequence()
            seq.tokens.extend(PROMPT + [x1])
            joint[x1] = p1[x1] * process_logits(target.logits(seq)[0], params).cpu()
    return joint


def empirical(decoder, params, draft_top_k, gamma_rng=None):
    """Counts of (x1, x2) over SAMPLES seeds, and the drafts' acceptance rate."""
    v = decoder.target.vocab_size
    counts = torch.zeros(v, v)
    proposed = accepted = 0
    for seed in range(SAMPLES):
        gamma = RandomGamma(gamma_rng) if gamma_rng else 2
        out = decoder.generate(
            PROMPT, max_new_tokens=2, gamma=gamma, draft_top_k=draft_top_k,
            sampling=dataclasses.replace(params, seed=seed),
        )
        counts[out.token_ids[0], out.token_ids[1]] += 1
        proposed += sum(out.gammas)
        accepted += sum(out.accepted)
    return counts, accepted / proposed


def chi_square_pvalue(counts, joint):
    """Chi-square over cells with expected count >= 5 (the rest pooled)."""
    expected = joint.flatten() * SAMPLES
    observed = counts.flatten()
    big = expected >= 5
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    if exp[-1] == 0:
        exp, obs = exp[:-1], obs[:-1]
    return stats.chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "k5": SamplingParams(temperature=1.0, top_k=5),
}


# Every setting through the lean layers (as every path runs the target by default);
# through the model's own modules the hardest one (temperature and nucleus).
CASES = [("lean-target", setting) for setting in SETTINGS] + [("own-modules-target", "t0.7-p0.9")]


@pytest.mark.parametrize("draft_top_k", [0, 4], ids=["dense-q", "sparse-q"])
@pytest.mark.parametrize("memo_pair, setting", CASES, indirect=["memo_pair"])
def test_first_two_tokens_follow_target_distribution(memo_pair, setting, draft_top_k):
    target, draft = memo_pair
    params = SETTINGS[setting]
    decoder = SpeculativeDecoder(target, draft)
    joint = exact_distribution(target, params)
    rng = random.Random(setting) if draft_top_k else None  # vary γ per round in the sparse runs
    counts, acceptance = empirical(decoder, params, draft_top_k, rng)
    assert 0.2 < acceptance < 0.95  # both branches (accept, correct) are exercised
    # A token with target probability 0 never appears.
    assert counts[joint == 0].sum() == 0
    pvalue = chi_square_pvalue(counts, joint)
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}"


@pytest.fixture(scope="module", params=["qwen3", "draft-padded", "target-padded"])
def other_pair(request, tmp_path_factory, device):
    """A non-Llama pair (Qwen3: q/k norms, through its own modules), and pairs
    of one tokenizer (V words) whose vocabularies are padded to other sizes: a
    draft of V + 8 rows proposing only the target's V, and a target of V + 4
    rows (ids the draft lacks and gets as a placeholder; rows a target may
    sample, so the check covers them)."""
    from transformers import AutoModelForCausalLM

    from tiny_models import add_word_tokenizer, make_noisy_copy, save_tiny_model

    root = tmp_path_factory.mktemp(f"lossless-{request.param}")
    rows = {"qwen3": (V, V), "draft-padded": (V, V + 8), "target-padded": (V + 4, V)}[request.param]
    arch = "qwen3" if request.param == "qwen3" else "qwen2"
    big = save_tiny_model(root / "big", arch, vocab_size=max(rows), layers=1, seed=3, logit_scale=3)
    noisy = make_noisy_copy(big, root / "noisy", noise=0.6, seed=4)

    def with_rows(path, n, name):  # the same weights, the embedding matrices cut or padded to n rows
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.resize_token_embeddings(n, mean_resizing=False)
        model.save_pretrained(root / name)
        return add_word_tokenizer(root / name, V)

    target, draft = with_rows(big, rows[0], "t"), with_rows(noisy, rows[1], "d")
    return MemoRunner(ModelRunner(target, device)), MemoRunner(ModelRunner(draft, device))


def test_other_pairs_follow_target_distribution(other_pair):
    target, draft = other_pair
    params = SETTINGS["t0.7-p0.9"]
    decoder = SpeculativeDecoder(target, draft)
    assert decoder.shared_vocab == min(target.vocab_size, draft.vocab_size)
    joint = exact_distribution(target, params)
    counts, acceptance = empirical(decoder, params, 4, random.Random(7))
    assert 0.1 < acceptance < 0.95
    assert counts[joint == 0].sum() == 0
    pvalue = chi_square_pvalue(counts, joint)
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}"


def test_the_check_has_power(memo_pair, monkeypatch):
    """Negative control: a verifier that accepts every draft emits the draft's
    distribution, and the same check must reject it."""
    from specdec.core.interfaces import Verdict

    def accept_all(drafts, q, p, *, seed, first_position):
        from specdec.core.sampling import STREAM_TARGET, sample, uniform

        return Verdict(len(drafts), sample(p[-1], uniform(seed, first_position + len(drafts), STREAM_TARGET)))

    monkeypatch.setattr(specdec.models.local, "verify_stochastic", accept_all)
    target, draft = memo_pair
    params = SETTINGS["t1"]
    counts, _ = empirical(SpeculativeDecoder(target, draft), params, 0)
    assert chi_square_pvalue(counts, exact_distribution(target, params)) < 1e-6
