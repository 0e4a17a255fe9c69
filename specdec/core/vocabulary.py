"""Checks that token ids and vocabularies agree: draft and target must map ids
to the same tokens, and every id a caller sends must be inside the vocabulary.

Models of one family often share a tokenizer but pad their embedding matrices
to different sizes (Qwen2.5-0.5B has 151,936 rows, Qwen2.5-7B 152,064): the
ids both hold, ``[0, min(sizes))``, mean the same tokens. The draft then
proposes only among those rows (its q restricted to them, exactly), and the
target, whatever rows it has, judges as always."""

from __future__ import annotations

import hashlib

from specdec.core.text import excerpt


def check_token_ids(tokens, vocab_size: int, what: str = "tokens") -> None:
    """ValueError naming the first id outside [0, vocab_size), e.g.
    ``prompt_ids[1] = 260 is outside the vocabulary [0, 256)``."""
    for i, t in enumerate(tokens):
        if not (isinstance(t, int) and 0 <= t < vocab_size):
            raise ValueError(f"{what}[{i}] = {excerpt(t)} is outside the vocabulary [0, {vocab_size})")


def size_fingerprint(vocab_size: int) -> str:
    """The fingerprint of a vocabulary known only by its size (no tokenizer)."""
    return hashlib.sha256(f"vocab_size={vocab_size}".encode()).hexdigest()[:16]


def shared_vocabulary(draft: str, draft_size: int, draft_fingerprint: str,
                      target: str, target_size: int, target_fingerprint: str) -> int:
    """How many ids, from 0, draft and target map to the same tokens: the
    smaller vocabulary when both tokenizers are the same (their fingerprints
    agree), else ValueError saying why. Without tokenizers a vocabulary is
    known by its size alone, so sizes must agree. ``draft`` / ``target`` say
    which models, for the message."""
    if draft_fingerprint == target_fingerprint:
        return min(draft_size, target_size)
    by_size = draft_fingerprint == size_fingerprint(draft_size) or target_fingerprint == size_fingerprint(target_size)
    if by_size and draft_size != target_size:
        raise ValueError(f"vocabulary mismatch: {draft} has {draft_size} tokens, {target} has {target_size} "
                         "(without a tokenizer in both model directories, only equal sizes can be taken to agree)")
    raise ValueError(
        f"tokenizer mismatch: {draft} (fingerprint {draft_fingerprint}) and {target} "
        f"(fingerprint {target_fingerprint}) map token ids differently"
    )
