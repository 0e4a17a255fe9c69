"""Greedy speculative decoding equals target-only decoding, token for token."""

import pytest

from specdec import SamplingParams, SpeculativeDecoder
from specdec.core.gamma import HeuristicGamma

PROMPTS = [[1], [5, 9, 30], [1, 2, 3, 4], [7, 7, 7, 7, 7, 7], [31, 0, 16, 8, 2], [11, 22]]


@pytest.fixture(scope="module")
def decoders(tiny_pair, device):
    target, close, far = tiny_pair
    return {
        "close": SpeculativeDecoder(target, close, device=device),
        "far": SpeculativeDecoder(target, far, device=device),
    }


@pytest.fixture(scope="module")
def reference(decoders):
    dec = decoders["close"]
    return {tuple(p): dec.generate(p, max_new_tokens=40, gamma=0).token_ids for p in PROMPTS}


@pytest.mark.parametrize("which", ["close", "far"])
@pytest.mark.parametrize("gamma", range(1, 9))
def test_greedy_equals_target_only(decoders, reference, which, gamma):
    dec = decoders[which]
    for prompt in PROMPTS:
        out = dec.generate(prompt, max_new_tokens=40, gamma=gamma)
        assert out.token_ids == reference[tuple(prompt)], (prompt, out.accepted)
        assert len(out.token_ids) == 40
        assert out.rounds == out.target_forwards == len(out.accepted)


def test_drafts_agree_often_and_rarely(decoders):
    close = [decoders["close"].generate(p, max_new_tokens=40, gamma=4) for p in PROMPTS]
    far = [decoders["far"].generate(p, max_new_tokens=40, gamma=4) for p in PROMPTS]

    def rate(outs):
        return sum(sum(o.accepted) for o in outs) / sum(sum(o.gammas) for o in outs)

    assert rate(close) > 0.6
    assert rate(far) < 0.3


def test_target_only_paths_agree(tiny_pair, reference, device):
    alone = SpeculativeDecoder(tiny_pair[0], device=device)  # draft=None
    for prompt in PROMPTS:
        assert alone.generate(prompt, max_new_tokens=40, gamma=4).token_ids == reference[tuple(prompt)]


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 13])
def test_max_new_tokens_mid_round(decoders, reference, max_new):
    for prompt in PROMPTS[:3]:
        out = decoders["close"].generate(prompt, max_new_tokens=max_new, gamma=6)
        assert out.token_ids == reference[tuple(prompt)][:max_new]
        assert out.finish_reason == "length"


def test_eos_inside_accepted_drafts_ends_generation(tiny_pair, reference, device):
    target, close, _ = tiny_pair
    dec = SpeculativeDecoder(target, close, device=device)
    prompt = PROMPTS[2]
    ref = reference[tuple(prompt)]
    eos = ref[9]
    stop = ref.index(eos)
    dec.target.eos_token_ids = {eos}
    out = dec.generate(prompt, max_new_tokens=40, gamma=8)
    assert out.token_ids == ref[: stop + 1]
    assert out.finish_reason == "eos"
    # To mean anything the EOS must be one of the last round's accepted drafts
    # (not its own next token), with accepted drafts after it cut off: with this
    # close draft and γ=8 it is.
    committed_before = sum(out.accepted[:-1]) + out.rounds - 1  # accepted drafts + one target token a round
    assert stop - committed_before < out.accepted[-1] - 1


@pytest.mark.parametrize("plain_tokens", [2, 5])
@pytest.mark.parametrize("sampling", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=3)],
                         ids=["greedy", "sampling"])
def test_rounds_asking_the_target_for_several_tokens_give_the_one_token_rounds_tokens(
        decoders, plain_tokens, sampling):
    """Plain decoding several tokens a call draws each as a one-token round at
    its position would: the same tokens, greedy or sampled, in fewer rounds
    (the first round of a request still brings one token)."""
    dec = decoders["close"]
    for prompt in PROMPTS:
        one = dec.generate(prompt, max_new_tokens=23, sampling=sampling, gamma=0)
        several = dec.generate(prompt, max_new_tokens=23, sampling=sampling, gamma=0, plain_tokens=plain_tokens)
        assert several.token_ids == one.token_ids and len(one.token_ids) == 23
        assert several.rounds == 1 + -(-22 // plain_tokens)


class Alternating:
    """γ by turns from ``gammas``: rounds without drafts between drafting ones."""

    def __init__(self, gammas):
        self.gammas, self.i = gammas, 0

    def choose(self):
        self.i += 1
        return self.gammas[self.i % len(self.gammas)]

    def observe(self, result):
        pass


def test_several_token_plain_rounds_between_drafting_rounds_are_lossless(decoders, reference):
    """After plain rounds the draft is behind by several tokens and catches up."""
    for prompt in PROMPTS:
        out = decoders["close"].generate(prompt, max_new_tokens=40, gamma=Alternating([0, 3, 0, 0, 5]),
                                         plain_tokens=3)
        assert out.token_ids == reference[tuple(prompt)]
        assert 0 in out.gammas and max(out.gammas) > 0


def test_plain_decoding_stops_after_an_end_of_sequence_token(tiny_pair, reference, device):
    target, close, _ = tiny_pair
    dec = SpeculativeDecoder(target, close, device=device)
    ref = reference[tuple(PROMPTS[2])]
    eos = ref[9]
    dec.target.eos_token_ids = {eos}
    out = dec.generate(PROMPTS[2], max_new_tokens=40, gamma=0, plain_tokens=8)
    assert out.token_ids == ref[: ref.index(eos) + 1]
    assert out.finish_reason == "eos"


def test_heuristic_gamma_is_lossless(decoders, reference):
    for prompt in PROMPTS:
        out = decoders["far"].generate(prompt, max_new_tokens=40, gamma=HeuristicGamma(gamma=3))
        assert out.token_ids == reference[tuple(prompt)]
        assert len(set(out.gammas)) > 1


def test_seeded_sampling_is_reproducible(decoders):
    def run(seed):
        params = SamplingParams(temperature=0.8, top_p=0.95, seed=seed)
        return decoders["close"].generate([1, 2, 3], max_new_tokens=30, sampling=params, gamma=4)

    a, b, c = run(11), run(11), run(12)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"prompt_ids": []}, "prompt is empty"),
        ({"prompt_ids": [1] * 128}, "context"),
        ({"prompt_ids": [1, 99]}, "outside the vocabulary"),
        ({"prompt_ids": [1], "gamma": -1}, "gamma"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt_ids": [1], "draft_top_k": -2}, "draft_top_k"),
        ({"prompt_ids": [1], "plain_tokens": 0}, "plain_tokens"),
    ],
)
def test_bad_arguments_raise_value_error(decoders, kwargs, word):
    with pytest.raises(ValueError, match=word):
        decoders["close"].generate(**kwargs)


def test_bad_sampling_raises_value_error(decoders):
    with pytest.raises(ValueError, match="temperature"):
        decoders["close"].generate([1], sampling=SamplingParams(temperature=-1.0))


def test_vocab_mismatch_is_rejected(tmp_path, tiny_pair):
    from tiny_models import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", vocab_size=48)
    with pytest.raises(ValueError, match="vocabulary mismatch.*48.*32"):
        SpeculativeDecoder(tiny_pair[0], other)


def test_missing_model_directory_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not a model directory"):
        SpeculativeDecoder(tmp_path / "nowhere")
