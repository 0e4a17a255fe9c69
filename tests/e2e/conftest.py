"""What the end-to-end modules share."""

from __future__ import annotations

import pytest

from tiny_models import add_byte_tokenizer, make_noisy_copy, make_tiny_llama

CONTEXT = 1024


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A byte-level-tokenizer target (vocab 260, context 1024) and a draft that is
    a noisy copy of it (agrees often, not always)."""
    root = tmp_path_factory.mktemp("e2e-models")
    target = make_tiny_llama(root / "target", vocab_size=260, layers=2, max_positions=CONTEXT,
                             seed=0, logit_scale=4.0)
    add_byte_tokenizer(target)
    draft = make_noisy_copy(target, root / "draft", noise=0.05, seed=1)
    add_byte_tokenizer(draft)
    return target, draft


@pytest.fixture(scope="module")
def reference(models):
    """In-process decoders on the same directories: target-only, and the pair."""
    from specdec import SpeculativeDecoder

    target, draft = models
    return SpeculativeDecoder(target=target), SpeculativeDecoder(target=target, draft=draft)
