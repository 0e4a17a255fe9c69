"""``specdec bench-overhead``: the decoder's own cost per round.

Everything a round does besides the two models' forward passes — logits
processing, drafting samples, verification, cache bookkeeping, the round loop —
measured by running the real decoder over models that cost nothing: they return
precomputed logits. With small models this overhead decides whether speculation
pays at all.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec.core.interfaces import SamplingParams
from specdec.models.decoder import SpeculativeDecoder
from specdec.models.runner import Pass, Sequence, replies


class FreeModel:
    """Quacks like ModelRunner; its 'forward pass' is a slice of a random table."""

    def __init__(self, vocab_size: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        # Peaked rows, like a trained LM's next-token distributions.
        self.table = torch.randn(256, vocab_size, generator=g) * 6
        self.vocab_size, self.max_context = vocab_size, 1 << 30
        self.eos_token_ids: set[int] = set()
        self.fingerprint, self.path, self.tokenizer = f"free-{vocab_size}", None, None

    def new_sequence(self) -> Sequence:
        return Sequence(tokens=[], cache=None)

    def new_cache(self) -> None:
        return None

    def rollback(self, seq: Sequence, position: int) -> None:
        del seq.tokens[position:]

    def uncache(self, seq: Sequence, keep: int) -> None:
        pass  # no cache: logits are a table lookup

    def run_passes(self, passes: list[Pass]) -> list[torch.Tensor]:
        return replies(passes, [self.logits(p.seq, p.last) for p in passes])

    def logits(self, seq: Sequence, last: int = 1, run: int = 0) -> torch.Tensor:
        # Row n of the table predicts the token after a prefix of length n.
        rows = [(n % 256) for n in range(len(seq.tokens) - last + 1, len(seq.tokens) + 1)]
        return self.table[rows]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vocab", type=int, default=4096, help="vocabulary size (default 4096)")
    p.add_argument("--gamma", type=int, default=4, help="drafted tokens per round (default 4)")
    p.add_argument("--tokens", type=int, default=2000, help="tokens generated per setting (default 2000)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")


def measure(vocab: int, gamma: int, tokens: int, params: SamplingParams, draft_top_k: int = 0) -> tuple[float, int]:
    """Mean seconds per round of the decoder over free models, and rounds run."""
    # Draft and target see the same table: every draft is accepted under greedy,
    # so rounds are full length; sampling sees realistic partial acceptance.
    dec = SpeculativeDecoder(FreeModel(vocab, 0), FreeModel(vocab, 0))
    dec.generate([1], max_new_tokens=50, sampling=params, gamma=gamma, draft_top_k=draft_top_k)  # warm up
    start = time.perf_counter()
    out = dec.generate([1], max_new_tokens=tokens, sampling=params, gamma=gamma, draft_top_k=draft_top_k)
    return (time.perf_counter() - start) / out.rounds, out.rounds


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    settings = [
        ("greedy", SamplingParams(temperature=0.0), 0),
        ("sampling t=0.8 top_p=0.95, dense q", SamplingParams(temperature=0.8, top_p=0.95, seed=0), 0),
        ("sampling t=0.8 top_p=0.95, top-32 q", SamplingParams(temperature=0.8, top_p=0.95, seed=0), 32),
        ("sampling t=1.0 top_k=50, dense q", SamplingParams(temperature=1.0, top_k=50, seed=0), 0),
    ]
    print(f"decoder overhead per round outside forward passes: vocab {args.vocab}, gamma {args.gamma}, "
          f"{args.threads} torch thread(s)")
    for name, params, top_k in settings:
        per_round, rounds = measure(args.vocab, args.gamma, args.tokens, params, top_k)
        print(f"  {name:<38} {per_round * 1e3:7.3f} ms/round  ({rounds} rounds)")
    return 0
