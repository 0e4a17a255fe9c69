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
from collections.abc import Sequence

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
    """Logits ``[..., V]`` -> probabilities ``[..., V]`` (float32): every row
    processed with ``params`` by :func:`process_logits_rows`. Not for greedy decoding."""
    rows = logits.reshape(-1, logits.shape[-1])  # [N, V]
    return process_logits_rows(rows, [params] * rows.shape[0]).reshape(logits.shape)


def process_logits_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Logits -> probabilities for a batch of rows, each with its own sampling
    parameters, in one step: the positions of many requests that one forward
    pass scored.

    Terms, for row i (N rows, V ids):

    * temperature t_i: the logits are divided by it (after subtracting the
      row's max, which softmax ignores); t < 1 sharpens, t > 1 flattens.
    * top-k k_i: only logits at least the row's k_i-th largest stay; the rest
      become -inf (probability 0). 0 or >= V: no cut.
    * top-p p_i: after the softmax, only the nucleus stays, renormalised (see
      :func:`_top_p_filter`). 1.0: no cut, the row is left exactly as the
      softmax made it.

    Each row comes out bit for bit as it would alone: every step is element-wise
    or reads its own row only, and none of them changes its arithmetic with the
    number of rows (see :func:`_top_p_filter` for the one sum).

    Args:
        logits: ``[N, V]``, any float dtype.
        params: N sampling parameters, ``params[i]`` for row i; none greedy.
    Returns:
        probs: ``[N, V]`` float32, each row summing to 1.
    """
    if len(params) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits but {len(params)} sampling parameters")
    x = logits.float()  # [N, V]
    # Subtracting the max first keeps a tiny temperature from overflowing to inf.
    # A temperature below float32's smallest normal number would round to 0 and
    # make 0/0: it is as greedy as that number.
    # One set of parameters for every row (one request's positions, the common
    # case) as scalars: the same arithmetic as an [N, 1] column, without making one.
    same = all(p == params[0] for p in params)
    temperature = max(params[0].temperature, _F32_TINY) if same else \
        _column([max(p.temperature, _F32_TINY) for p in params], x, torch.float32)  # [N, 1]
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature
    x = _top_k_mask(x, [p.top_k for p in params])
    probs = torch.softmax(x, dim=-1)  # [N, V]
    return _top_p_rows(probs, [p.top_p for p in params])


def _column(values: list, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as an ``[N, 1]`` column on ``like``'s device."""
    return torch.tensor(values, dtype=dtype, device=like.device)[:, None]


def _top_k_mask(x: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """``x`` [N, V] with -inf below each row's ``top_k[i]``-th largest value
    (rows whose k is 0 or >= V untouched). One torch.topk for the largest k
    asked: its i-th value is the same float whatever k it was asked for."""
    vocab = x.shape[-1]
    cut = [0 < k < vocab for k in top_k]
    if not any(cut):
        return x
    if all(cut) and all(k == top_k[0] for k in top_k):  # one k for every row: no columns to make
        return x.masked_fill(x < torch.topk(x, top_k[0], dim=-1).values[..., -1:], float("-inf"))
    k = [k if c else 1 for k, c in zip(top_k, cut, strict=True)]
    largest = torch.topk(x, max(k), dim=-1).values  # [N, max k], descending
    kth = largest.gather(-1, _column(k, x, torch.int64) - 1)  # [N, 1]: row i's k_i-th largest
    # An uncut row's threshold is -inf: no value is below it.
    kth = torch.where(_column(cut, x, torch.bool), kth, float("-inf"))
    return x.masked_fill(x < kth, float("-inf"))


def _top_p_rows(probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """The nucleus of the rows of ``probs`` [N, V] that ask for one
    (``top_p[i]`` < 1); the other rows as they are."""
    asked = [i for i, p in enumerate(top_p) if p < 1.0]
    if not asked:
        return probs
    if len(asked) == len(top_p):
        same = all(p == top_p[0] for p in top_p)
        return _top_p_filter(probs, top_p[0] if same else _column(top_p, probs, torch.float32))
    rows = torch.tensor(asked, device=probs.device)
    nucleus = _top_p_filter(probs[rows], _column([top_p[i] for i in asked], probs, torch.float32))
    return probs.index_put((rows,), nucleus)


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor | float) -> torch.Tensor:
    """Keep the nucleus of each row of ``probs`` [N, V], renormalised: the most
    likely tokens, taken in order of probability until their mass reaches the
    row's ``top_p`` [N, 1]. The most likely token is always kept.

    The nucleus is cut at a probability: every token at least as likely as the
    last one taken is kept, so tokens of equal probability are kept or dropped
    together and the result never depends on how a sort orders ties. Those
    tokens lead the sorted row, so the kept mass is read off the cumulative
    sum: a row-by-row scan, where sum() would split one long row across
    threads and round differently than for the same row among others."""
    desc = _sorted_descending(probs)  # [N, V]
    mass = torch.cumsum(desc, dim=-1)  # [N, V]: mass[j] = desc[0] + ... + desc[j]
    before = mass - desc  # the mass of the tokens ranked above each
    # >= 1 (before[0] is 0) unless top_p underflows float32 to 0: keep the top token then too.
    taken = (before < top_p).sum(dim=-1, keepdim=True).clamp_(min=1)  # [N, 1]
    threshold = desc.gather(-1, taken - 1)  # [N, 1]: the least likely token taken
    kept = (desc >= threshold).sum(dim=-1, keepdim=True)  # [N, 1]: taken, and its ties after it
    return torch.where(probs >= threshold, probs, 0.0) / mass.gather(-1, kept - 1)


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
