"""The one place that touches transformers' KV-cache API.

transformers is pinned exactly (see pyproject.toml) because this API moved inside
5.x: ``DynamicCache.crop`` went from "keep this many tokens" to "remove this many
tokens, given as a negative number", and the forward keyword went from
``past_key_values`` to ``cache``. Everything else in specdec calls the four
functions below, and tests/models/test_kv_cache.py pins their behaviour.

A draft run through specdec.models.lean_llama holds a ``LeanCache`` instead (its own
tensors, no transformers API); the functions here take either kind.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.models.lean_llama import LeanCache, LeanLlama


def new_cache(model: PreTrainedModel | LeanLlama) -> DynamicCache | LeanCache:
    """An empty cache for one sequence of ``model``."""
    if isinstance(model, LeanLlama):
        return model.new_cache()
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache | LeanCache) -> int:
    """Number of token positions held in ``cache``."""
    if isinstance(cache, LeanCache):
        return cache.length
    return cache.get_seq_length()


def crop_cache(cache: DynamicCache | LeanCache, length: int) -> None:
    """Keep only the first ``length`` positions (roll back after a rejection)."""
    current = cache_length(cache)
    if length < 0 or length > current:
        raise ValueError(f"cannot crop a cache of {current} tokens to {length}")
    if isinstance(cache, LeanCache):
        cache.length = length
    elif length < current:
        cache.crop(length - current)  # 5.x: a negative count of tokens to remove


def forward(
    model: PreTrainedModel | LeanLlama, input_ids: torch.Tensor, cache: DynamicCache | LeanCache,
    logits_to_keep: int,
) -> torch.Tensor:
    """Run ``input_ids`` [1, n] after the cached positions, appending their keys and
    values to ``cache``; return logits [logits_to_keep, V] for the last positions."""
    if isinstance(model, LeanLlama):
        return model.forward(input_ids, cache, logits_to_keep)
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep)
    return out.logits[0]
