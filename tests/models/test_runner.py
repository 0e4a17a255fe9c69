"""What a forward pass sends back to each of its passes: logits, or for a pass
that samples its probabilities -- those of every sampling pass of the forward
processed in one batched step, each bit for bit what its pass gets alone."""

import pytest
import torch

from specdec.core.interfaces import SamplingParams
from specdec.core.sampling import process_logits
from specdec.models.runner import ModelRunner, Pass

# What each session's pass asks: how many positions, how they are sampled,
# and how many ids the reply covers (0: all; a draft cut to its target's ids).
ASKS = [
    (3, SamplingParams(temperature=0.8, top_p=0.95), 0),
    (1, SamplingParams(temperature=1.3, top_k=5), 20),
    (2, SamplingParams(temperature=0.5, top_k=3, top_p=0.7), 0),
    (1, SamplingParams(), 0),  # greedy: logits
    (1, None, 20),  # no params: logits
    (2, SamplingParams(temperature=1.0), 20),
    (4, SamplingParams(temperature=2.0, top_p=0.5), 0),
]


@pytest.fixture(scope="module")
def runner(tiny_pair, device):
    return ModelRunner(tiny_pair[0], device)


def test_sampling_passes_of_one_forward_get_what_each_gets_alone(runner):
    gen = torch.Generator().manual_seed(2)
    seqs = [runner.new_sequence() for _ in ASKS]
    for n, seq in enumerate(seqs):
        seq.tokens.extend(torch.randint(0, runner.vocab_size, (5 + n,), generator=gen).tolist())
    passes = [Pass(seq, last, params=params, vocab=vocab)
              for seq, (last, params, vocab) in zip(seqs, ASKS, strict=True)]
    together = runner.run_passes(passes)
    # The same forward again (every token run again, grouped as before), unprocessed.
    logits = runner.run_passes([Pass(p.seq, p.last, run=len(p.seq.tokens)) for p in passes])
    for got, x, (last, params, vocab) in zip(together, logits, ASKS, strict=True):
        x = x[:, :vocab] if vocab else x
        want = x if params is None or params.greedy else process_logits(x, params)
        assert got.shape == (last, vocab or runner.vocab_size) and got.dtype == torch.float32
        assert torch.equal(got, want)
