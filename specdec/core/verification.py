"""Deciding which drafted tokens the target accepts (Leviathan et al., 2023).

Given γ drafts y_1..y_γ sampled from q_1..q_γ and the target's p_1..p_{γ+1}
(p_i is the target distribution for the position of y_i; p_{γ+1} is the position
after the last draft):

* greedy: accept while y_i == argmax p_i; the next token is argmax p at the first
  mismatch (or argmax p_{γ+1} when all are accepted).
* sampling: accept y_i with probability min(1, p_i(y)/q_i(y)). At the first
  rejection sample the correction from the residual r(x) = max(0, p_i(x) - q_i(x))/Z.
  If all γ are accepted, sample a bonus token from p_{γ+1}. Every emitted token is
  then distributed exactly as the target alone would produce it:
  P(x) = q(x)·min(1, p(x)/q(x)) + (1 - Σ_y min(q(y), p(y)))·r(x) = p(x).

Uniforms come from :func:`specdec.core.sampling.uniform` keyed by absolute position.
"""

from __future__ import annotations

import torch

from specdec.core.interfaces import Verdict
from specdec.core.sampling import STREAM_ACCEPT, STREAM_TARGET, Distribution, SparseDist, sample, uniform

# Below this residual mass p and q agree to float precision: the correction is then
# (up to rounding) p itself, and dividing by Z would amplify noise.
RESIDUAL_EPS = 1e-6


def verify_greedy(drafts: list[int], target_logits: torch.Tensor) -> Verdict:
    """``target_logits``: [γ+1, V]. Accept the longest prefix matching the argmax."""
    best = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(drafts) and drafts[n] == best[n]:
        n += 1
    return Verdict(accepted=n, next_token=best[n])


def verify_stochastic(
    drafts: list[int],
    q: torch.Tensor,
    p: torch.Tensor,
    *,
    seed: int,
    first_position: int,
) -> Verdict:
    """``q``: [γ, V] the draft's processed distributions (zeros outside a truncated
    support); ``p``: [γ+1, V] the target's. ``first_position`` is the absolute
    sequence index at which ``drafts[0]`` would land."""
    gamma = len(drafts)
    if gamma:
        rows = torch.arange(gamma, device=p.device)
        ids = torch.tensor(drafts, device=p.device)
        p_y = p[rows, ids].tolist()
        q_y = q[rows, ids].tolist()
    for i in range(gamma):
        u = uniform(seed, first_position + i, STREAM_ACCEPT)
        # Accept with probability min(1, p/q): u·q < p. Strict, so p(y) = 0 never passes.
        if u * q_y[i] < p_y[i]:
            continue
        return Verdict(accepted=i, next_token=_correction(p[i], q[i], seed, first_position + i))
    bonus = sample(p[gamma], uniform(seed, first_position + gamma, STREAM_TARGET))
    return Verdict(accepted=gamma, next_token=bonus)


def _correction(p: torch.Tensor, q: torch.Tensor, seed: int, position: int) -> int:
    """Sample from the residual max(0, p - q)/Z; from p when Z ≈ 0 (p ≈ q)."""
    residual = torch.clamp(p - q, min=0.0)
    u = uniform(seed, position, STREAM_TARGET)
    if float(residual.sum()) <= RESIDUAL_EPS:
        return sample(p, u)
    return sample(residual, u)  # sample() normalises by the total itself


def dense_rows(qs: list[Distribution], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Stack draft distributions into a dense [γ, V] float32 tensor. A dense q
    shorter than V covers the first ids (a draft restricted to the ids both
    models hold): the rest have probability 0."""
    if qs and all(not isinstance(q, SparseDist) and q.shape[0] == vocab_size for q in qs):
        return torch.stack(qs).to(device, torch.float32)  # already dense: one op
    out = torch.zeros(len(qs), vocab_size, dtype=torch.float32, device=device)
    for i, q in enumerate(qs):
        if isinstance(q, SparseDist):
            out[i].index_copy_(0, q.ids.to(device), q.probs.to(device, torch.float32))
        else:
            out[i, :q.shape[0]].copy_(q)
    return out
