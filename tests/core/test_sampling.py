import math

import pytest
import torch

from specdec.core.interfaces import SamplingParams
from specdec.core.sampling import process_logits, process_logits_rows, sample, truncate_top_k, uniform


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 3.0])
    probs = process_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))
    assert probs.dtype == torch.float32


def test_top_k_keeps_k_most_likely():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0, 2.5])
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs > 0).tolist() == [False, True, False, False, True]
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_top_p_keeps_smallest_nucleus():
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = process_logits(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 alone < 0.8, 0.5 + 0.3 reaches 0.8: two tokens kept.
    assert (probs > 0).tolist() == [True, True, False, False]
    assert torch.allclose(probs[:2], torch.tensor([0.5, 0.3]) / 0.8)


def test_top_p_always_keeps_the_most_likely_token():
    probs = process_logits(torch.tensor([5.0, 0.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.01))
    assert probs.tolist() == [1.0, 0.0, 0.0]


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The textbook nucleus: sort, keep while the mass before a token is < top_p."""
    top, order = torch.sort(probs, descending=True)
    keep = (torch.cumsum(top, -1) - top) < top_p
    kept = torch.zeros_like(probs).scatter_(-1, order, top * keep)
    return kept / kept.sum(-1, keepdim=True)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.95, 0.999])
def test_top_p_matches_a_full_sort(top_p):
    """Random rows (no ties) over a 4096 vocabulary, peaked and flat, as a batch."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 4096, generator=gen) * torch.tensor([[0.5], [1.0], [2.0], [4.0], [8.0], [16.0]])
    params = SamplingParams(temperature=0.8, top_p=top_p)
    got = process_logits(logits, params)
    want = _nucleus_by_full_sort(torch.softmax(logits / 0.8, -1), top_p)
    assert torch.equal(got > 0, want > 0)
    assert torch.allclose(got, want, atol=1e-7)


def test_numpy_sort_equals_the_device_sort():
    """The CPU's numpy path and the torch.sort used on other devices agree."""
    from specdec.core.sampling import _sorted_descending_numpy

    probs = torch.softmax(torch.randn(3, 4096, generator=torch.Generator().manual_seed(0)) * 4, -1)
    probs[0, :100] = 0.0  # zeros, as top-k leaves them
    want = torch.sort(probs, dim=-1, descending=True).values
    assert torch.equal(_sorted_descending_numpy(probs), want)
    assert torch.equal(_sorted_descending_numpy(probs[1]), want[1])


@pytest.mark.parametrize("shape", [(10,), (3, 10)])
def test_a_top_p_that_underflows_float32_keeps_the_most_likely_token(shape):
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    probs = process_logits(logits, SamplingParams(temperature=1.0, top_p=1e-50))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 10).float())


def test_top_p_keeps_or_drops_tied_tokens_together():
    # 0.4 is taken; the nucleus ends at the first 0.2 (0.4 + 0.2 >= 0.5), and the
    # other 0.2s are as likely: kept too, whatever order a sort gives ties.
    probs_in = torch.tensor([0.2, 0.4, 0.2, 0.1, 0.2, 0.0 + 1e-9])
    probs = process_logits(probs_in.log(), SamplingParams(temperature=1.0, top_p=0.5))
    assert (probs > 0).tolist() == [True, True, True, False, True, False]
    flat = process_logits(torch.zeros(8), SamplingParams(temperature=1.0, top_p=0.3))
    assert torch.allclose(flat, torch.full((8,), 1 / 8))


def test_top_k_then_top_p_combined():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    probs = process_logits(logits, SamplingParams(temperature=0.7, top_k=3, top_p=0.9))
    ref = torch.softmax(logits[:3] / 0.7, -1)
    keep = (torch.cumsum(ref, -1) - ref) < 0.9
    expected = torch.zeros(5)
    expected[:3] = torch.where(keep, ref, 0.0)
    assert torch.allclose(probs, expected / expected.sum())


def test_rows_processed_independently():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_k=4, top_p=0.8)
    batch = process_logits(logits, params)
    for i in range(3):
        assert torch.allclose(batch[i], process_logits(logits[i], params))


# (temperature, top_k, top_p) per row: cut by top-k, by top-p, by both, by neither
# (top_k 0 or >= V, top_p 1.0), and a temperature so small it is greedy.
MIXED = [(0.8, 0, 0.95), (1.0, 0, 1.0), (0.5, 20, 1.0), (1.3, 50, 0.9), (0.8, 0, 1.0), (0.7, 4096, 0.5),
         (1e-40, 0, 0.9), (2.0, 1, 1.0), (1.0, 5000, 1.0), (0.9, 300, 0.999)]


def test_rows_with_their_own_params_are_each_processed_bit_for_bit_as_alone():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(MIXED), 4096, generator=gen) * torch.linspace(0.5, 12, len(MIXED))[:, None]
    params = [SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in MIXED]
    batch = process_logits_rows(logits, params)
    for row, x, p in zip(batch, logits, params, strict=True):
        assert torch.equal(row, process_logits(x, p))
        if p.top_k in (0, 5000) and p.top_p == 1.0:  # nothing cut: the softmax itself, no nucleus rounding
            assert torch.equal(row, torch.softmax((x - x.max()) / p.temperature, -1))


def test_a_long_row_alone_is_processed_as_among_others():
    """torch splits a lone row's sum() across threads (from 32k ids on): the
    nucleus's renormalisation must not round differently for a row alone."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logits = torch.randn(3, 65536, generator=torch.Generator().manual_seed(6)) * 4
        params = SamplingParams(temperature=0.8, top_p=0.95)
        batch = process_logits(logits, params)
        for row, x in zip(batch, logits, strict=True):
            assert torch.equal(row, process_logits(x, params))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": -3}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, word):
    with pytest.raises(ValueError, match=word):
        SamplingParams(**kwargs)


def test_sample_never_picks_zero_probability():
    """At the edges of each token's cdf interval: u = 0 is the first non-zero
    token, u equal to a cdf value the next non-zero one, u just below 1 the last."""
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0])
    us = [0.0, 0.2499, 0.25, 0.9999, 1.0 - 2**-53]
    assert [sample(probs, u) for u in us] == [1, 1, 3, 3, 3]


def test_sample_is_inverse_cdf():
    probs = torch.tensor([0.2, 0.3, 0.5])
    assert sample(probs, 0.0) == 0
    assert sample(probs, 0.19) == 0
    assert sample(probs, 0.21) == 1
    assert sample(probs, 0.51) == 2


def test_uniform_is_deterministic_and_uniform():
    draws = [uniform(42, pos, 1) for pos in range(20000)]
    assert draws[:5] == [uniform(42, pos, 1) for pos in range(5)]
    assert all(0.0 <= u < 1.0 for u in draws)
    counts = torch.histc(torch.tensor(draws), bins=10, min=0, max=1)
    assert counts.min() > 1800 and counts.max() < 2200


def test_no_uniform_is_shared_between_seeds_positions_and_streams():
    """The rejection-sampling proof needs a fresh uniform per (seed, position,
    stream): no draw may reappear under another key (a mix such as seed + position
    or position + stream would repeat draws along a diagonal)."""
    keys = [(seed, pos, stream) for seed in range(20) for pos in range(200) for stream in (1, 2, 3)]
    draws = {uniform(*key) for key in keys}
    assert len(draws) == len(keys)


def test_truncate_top_k_is_renormalised_support():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    sparse = truncate_top_k(probs, 2)
    assert sparse.ids.tolist() == [1, 3]
    assert torch.allclose(sparse.probs, torch.tensor([0.4, 0.3]) / 0.7)


def test_truncate_top_k_sends_no_zero_probabilities():
    probs = torch.tensor([0.0, 0.6, 0.0, 0.4, 0.0])
    sparse = truncate_top_k(probs, 4)
    assert sparse.ids.tolist() == [1, 3]
    assert torch.allclose(sparse.probs, torch.tensor([0.6, 0.4]))
    # The draw is the one the dense row would give: inverse-CDF never lands on a zero.
    for u in [0.0, 0.3, 0.59, 0.61, 0.999]:
        assert int(sparse.ids[sample(sparse.probs, u)]) == sample(probs, u)


@pytest.mark.parametrize("temperature", [1e-38, 1e-46, 5e-324])  # the last two are 0 in float32
def test_tiny_temperature_is_greedy_not_nan(temperature):
    logits = torch.tensor([1.0, 3.0, 2.0])
    probs = process_logits(logits, SamplingParams(temperature=temperature, top_p=0.9))
    assert probs.tolist() == [0.0, 1.0, 0.0]
    assert sample(probs, 0.999) == 1
