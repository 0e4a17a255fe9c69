"""A model directory's tokenizer, and the fingerprint of its vocabulary."""

from __future__ import annotations

import hashlib
import json
import pathlib

from specdec.core.vocabulary import size_fingerprint

# The files a transformers tokenizer loads from a model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")


def tokenizer_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The tokenizer files ``path`` holds (none: it ships no tokenizer)."""
    if not has_tokenizer(path):
        return []
    return [path / name for name in TOKENIZER_FILES if (path / name).is_file()]


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
    speak the same vocabulary: a hash of tokenizer.json's vocabulary, merges and
    added tokens when present (the same whatever rows a model pads its
    embeddings to), else of the vocabulary size alone."""
    tok = path / "tokenizer.json"
    if not tok.is_file():
        return size_fingerprint(vocab_size)
    spec = json.loads(tok.read_text(encoding="utf-8"))
    model = spec.get("model", {})
    h = hashlib.sha256(b"tokenizer.json")
    h.update(json.dumps(model.get("vocab"), sort_keys=True).encode())
    h.update(json.dumps(model.get("merges")).encode())
    h.update(json.dumps(sorted((t.get("id"), t.get("content")) for t in spec.get("added_tokens", []))).encode())
    return h.hexdigest()[:16]
