"""Checks that token ids and vocabularies agree: draft and target must map ids
to the same tokens, and every id a caller sends must be inside the vocabulary."""

from __future__ import annotations


def check_token_ids(tokens, vocab_size: int, what: str = "tokens") -> None:
    """ValueError naming the first id outside [0, vocab_size), e.g.
    ``prompt_ids[1] = 260 is outside the vocabulary [0, 256)``."""
    for i, t in enumerate(tokens):
        if not (isinstance(t, int) and 0 <= t < vocab_size):
            raise ValueError(f"{what}[{i}] = {t!r} is outside the vocabulary [0, {vocab_size})")


def check_same_vocabulary(draft: str, draft_size: int, draft_fingerprint: str,
                          target: str, target_size: int, target_fingerprint: str) -> None:
    """Draft and target must map ids to the same tokens: same vocabulary size and
    tokenizer fingerprint. ``draft`` / ``target`` say which models, for the message."""
    if draft_size != target_size:
        raise ValueError(f"vocabulary mismatch: {draft} has {draft_size} tokens, {target} has {target_size}")
    if draft_fingerprint != target_fingerprint:
        raise ValueError(
            f"tokenizer mismatch: {draft} (fingerprint {draft_fingerprint}) and {target} "
            f"(fingerprint {target_fingerprint}) map token ids differently"
        )
