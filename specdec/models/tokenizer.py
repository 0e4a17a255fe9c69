"""A model directory's tokenizer, and the fingerprint of its vocabulary."""

from __future__ import annotations

import hashlib
import json
import pathlib


def has_tokenizer(path: pathlib.Path) -> bool:
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json"))


def load_tokenizer(path: pathlib.Path):
    """The model directory's tokenizer, or None when it ships none."""
    if not has_tokenizer(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def vocabulary_fingerprint(path: pathlib.Path, vocab_size: int) -> str:
    """Identifies the token <-> id mapping, so draft and target can be checked to
    speak the same vocabulary: a hash of tokenizer.json's vocabulary when present,
    else of the vocabulary size alone."""
    h = hashlib.sha256(f"vocab_size={vocab_size}".encode())
    tok = path / "tokenizer.json"
    if tok.is_file():
        model = json.loads(tok.read_text(encoding="utf-8")).get("model", {})
        h.update(json.dumps(model.get("vocab"), sort_keys=True).encode())
        h.update(json.dumps(model.get("merges")).encode())
    return h.hexdigest()[:16]
