"""Which ids a draft and a target share: the tokenizer decides, not the
number of embedding rows; dense q shorter than the target's vocabulary covers
its first ids."""

import pytest
import torch

from specdec.core.sampling import SparseDist
from specdec.core.verification import dense_rows
from specdec.core.vocabulary import shared_vocabulary, size_fingerprint


def test_one_tokenizer_padded_to_other_sizes_shares_the_smaller_vocabulary():
    assert shared_vocabulary("draft", 151936, "tok", "target", 152064, "tok") == 151936
    assert shared_vocabulary("draft", 576, "tok", "target", 512, "tok") == 512


def test_other_tokenizers_are_refused_naming_both():
    with pytest.raises(ValueError, match=r"tokenizer mismatch: draft \(fingerprint a\) and target \(fingerprint b\)"):
        shared_vocabulary("draft", 512, "a", "target", 512, "b")


def test_without_tokenizers_only_equal_sizes_agree():
    assert shared_vocabulary("d", 64, size_fingerprint(64), "t", 64, size_fingerprint(64)) == 64
    with pytest.raises(ValueError, match="vocabulary mismatch: d has 48 tokens, t has 64"):
        shared_vocabulary("d", 48, size_fingerprint(48), "t", 64, size_fingerprint(64))


def test_a_short_dense_q_covers_the_first_ids_and_sparse_ones_their_ids():
    short = torch.tensor([0.5, 0.25, 0.25])
    sparse = SparseDist(ids=torch.tensor([4, 1]), probs=torch.tensor([0.75, 0.25]))
    rows = dense_rows([short, sparse], 6, torch.device("cpu"))
    assert torch.equal(rows, torch.tensor([[0.5, 0.25, 0.25, 0, 0, 0], [0, 0.25, 0, 0, 0.75, 0]]))
