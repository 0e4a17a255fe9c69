"""Logits processing and sampling, shared by draft and target.

Losslessness rests on two facts this module guarantees:

* the draft's q and the target's p go through the *same* processing
  (temperature -> top-k -> top-p -> softmax, all in float32), and
* the draft samples from exactly the q it reports (including any truncation to a
  compact support, see :func:`truncate_top_k`).

Randomness is counter-based: the uniform used at sequence position ``i`` for a
given purpose ("stream") is a hash of ``(seed, i, stream)``. A session therefore
needs no generator state: a retried round, a service restarted after eviction, or
the in-process and distributed decoders all draw the same numbers for the same
positions. Different positions and streams get independent uniforms, which is all
the rejection-sampling proof needs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from specdec.core.interfaces import SamplingParams

# Random streams: one per purpose, so that no uniform is ever used twice.
STREAM_DRAFT = 1  # the draft's sample at a position
STREAM_ACCEPT = 2  # the target's accept/reject draw for a draft at a position
STREAM_TARGET = 3  # the target's correction or bonus sample at a position

_MASK64 = (1 << 64) - 1
_F32_TINY = torch.finfo(torch.float32).tiny


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits ``[..., V]`` -> probabilities ``[..., V]`` (float32) after temperature,
    top-k and top-p. Rows are processed independently. Not for greedy decoding."""
    x = logits.float()
    # Subtracting the max first keeps a tiny temperature from overflowing to inf
    # (softmax is unchanged by the shift). A temperature below float32's smallest
    # normal number would round to 0 and make 0/0: it is as greedy as that number.
    temperature = max(params.temperature, _F32_TINY)
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p_filter(probs, params.top_p)
    return probs


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the nucleus, renormalised: the most likely tokens, taken in order of
    probability until their mass reaches ``top_p``. The most likely token is
    always kept.

    The nucleus is cut at a probability: every token at least as likely as the
    last one taken is kept, so tokens of equal probability are kept or dropped
    together and the result never depends on how a sort orders ties."""
    desc = _sorted_descending(probs)
    before = torch.cumsum(desc, dim=-1) - desc  # the mass of the tokens ranked above each
    # >= 1 (before[0] is 0) unless top_p underflows float32 to 0: keep the top token then too.
    taken = (before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)
    threshold = desc.gather(-1, taken - 1)
    kept = torch.where(probs >= threshold, probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def _sorted_descending(probs: torch.Tensor) -> torch.Tensor:
    """The values of each row, largest first. On the CPU through numpy, whose
    vectorised sort takes ~10 µs for a 4096-token row where torch.sort and a
    full torch.topk take ~200; the nucleus of a weak model at t = 0.8 can hold
    a thousand tokens, so a partial sort does not help."""
    if probs.device.type == "cpu":
        return _sorted_descending_numpy(probs)
    return torch.sort(probs, dim=-1, descending=True).values


def _sorted_descending_numpy(probs: torch.Tensor) -> torch.Tensor:
    ascending = np.sort(probs.detach().numpy(), axis=-1)
    return torch.from_numpy(np.ascontiguousarray(ascending[..., ::-1]))


@dataclasses.dataclass(frozen=True)
class SparseDist:
    """A distribution over a truncated support: ``probs[j]`` for token ``ids[j]``,
    zero elsewhere."""

    ids: torch.Tensor  # int64 [k]
    probs: torch.Tensor  # float32 [k]


Distribution = torch.Tensor | SparseDist  # dense float32 [V], or sparse



def truncate_top_k(probs: torch.Tensor, k: int) -> SparseDist:
    """The draft's compact proposal distribution: the ``k`` most likely tokens of
    one row of ``probs`` that have a non-zero probability, renormalised, most
    likely first. The draft *samples from this*, so using it as q in the
    acceptance test stays exact, and only those (id, prob) pairs need to cross
    the network: after top-p that is often far fewer than ``k``. (Dropping the
    zeros changes no draw: inverse-CDF sampling never lands on a zero.)"""
    top = torch.topk(probs, min(k, probs.shape[-1]))
    support = int(torch.count_nonzero(top.values))  # sorted: the zeros come last
    values = top.values[:support]
    return SparseDist(ids=top.indices[:support], probs=values / values.sum())


def uniform(seed: int, position: int, stream: int) -> float:
    """A uniform draw in [0, 1) that is a pure function of (seed, position, stream)."""
    h = _splitmix64(seed & _MASK64)
    h = _splitmix64(h ^ (position & _MASK64))
    h = _splitmix64(h ^ stream)
    return (h >> 11) * (1.0 / (1 << 53))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample from one row of (possibly unnormalised) probabilities.

    With u in [0, 1) the chosen index i is the first with cdf[i] > u * total, so an
    index of probability 0 can never be chosen (its cdf equals its predecessor's).
    The cumulative sum is float64 so a 128k vocabulary loses no mass to rounding.
    """
    if probs.device.type == "cpu":  # numpy: a few µs instead of tens for torch's small ops
        cdf = np.cumsum(probs.numpy(), dtype=np.float64)
        index = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    else:
        cdf = torch.cumsum(probs.double(), dim=-1)
        threshold = torch.tensor([u], dtype=torch.float64, device=cdf.device) * cdf[-1]
        index = int(torch.searchsorted(cdf, threshold, right=True))
    if index >= probs.shape[-1]:  # u * total rounded up to total: take the last non-zero
        index = int(torch.nonzero(probs > 0)[-1])
    return index
