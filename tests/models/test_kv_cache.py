"""The cache adapter pins the behaviour of the transformers version in use."""

import pytest
import torch

from specdec.models import kv_cache
from specdec.models.runner import ModelRunner


@pytest.fixture(scope="module")
def runner(tiny_pair, device):
    return ModelRunner(tiny_pair[0], device)


def fresh_logits(runner, tokens, last):
    seq = runner.new_sequence()
    seq.tokens.extend(tokens)
    return runner.logits(seq, last)


def test_crop_keeps_prefix_length(runner):
    seq = runner.new_sequence()
    seq.tokens.extend([1, 2, 3, 4, 5, 6])
    runner.logits(seq)
    assert kv_cache.cache_length(seq.cache) == 6
    kv_cache.crop_cache(seq.cache, 4)
    assert kv_cache.cache_length(seq.cache) == 4
    kv_cache.crop_cache(seq.cache, 4)  # no-op
    assert kv_cache.cache_length(seq.cache) == 4
    with pytest.raises(ValueError, match="cannot crop"):
        kv_cache.crop_cache(seq.cache, 5)


def test_rollback_then_extend_matches_fresh_recompute(runner):
    seq = runner.new_sequence()
    seq.tokens.extend([3, 1, 4, 1, 5])
    runner.logits(seq)
    seq.tokens.extend([9, 2, 6])  # speculative tokens, then rejected
    runner.logits(seq, 3)
    runner.rollback(seq, 6)
    assert seq.tokens == [3, 1, 4, 1, 5, 9] and seq.cache_length == 6
    seq.tokens.extend([8, 7])
    got = runner.logits(seq, 3)
    want = fresh_logits(runner, [3, 1, 4, 1, 5, 9, 8, 7], 3)
    assert torch.allclose(got, want, atol=1e-5)


def test_asking_again_recomputes_from_the_cache(runner):
    seq = runner.new_sequence()
    seq.tokens.extend([2, 7, 1, 8])
    first = runner.logits(seq, 2)
    again = runner.logits(seq, 2)  # nothing pending: rewinds and recomputes
    assert torch.allclose(first, again, atol=1e-5)
    assert seq.cache_length == 4


def test_incremental_matches_one_pass(runner):
    seq = runner.new_sequence()
    rows = []
    for tok in [5, 6, 7, 8]:
        seq.tokens.append(tok)
        rows.append(runner.logits(seq)[0])
    assert torch.allclose(torch.stack(rows), fresh_logits(runner, [5, 6, 7, 8], 4), atol=1e-5)


def test_rollback_past_the_end_is_an_error(runner):
    seq = runner.new_sequence()
    seq.tokens.extend([1, 2])
    with pytest.raises(ValueError, match="only 2 tokens"):
        runner.rollback(seq, 3)
