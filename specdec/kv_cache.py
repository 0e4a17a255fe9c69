"""The one place that touches transformers' KV-cache API.

transformers is pinned exactly (see pyproject.toml) because this API moved inside
5.x: ``DynamicCache.crop`` went from "keep this many tokens" to "remove this many
tokens, given as a negative number", and the forward keyword went from
``past_key_values`` to ``cache``. Everything else in specdec calls the four
functions below, and tests/test_kv_cache.py pins their behaviour.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty cache for one sequence of ``model``."""
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    """Number of token positions held in ``cache``."""
    return cache.get_seq_length()


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep only the first ``length`` positions (roll back after a rejection)."""
    current = cache_length(cache)
    if length < 0 or length > current:
        raise ValueError(f"cannot crop a cache of {current} tokens to {length}")
    if length < current:
        cache.crop(length - current)  # 5.x: a negative count of tokens to remove


def forward(
    model: PreTrainedModel, input_ids: torch.Tensor, cache: DynamicCache, logits_to_keep: int
) -> torch.Tensor:
    """Run ``input_ids`` [1, n] after the cached positions, appending their keys and
    values to ``cache``; return logits [logits_to_keep, V] for the last positions."""
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits[0]
