"""Tiny Llama models built from configs, saved to local directories, for tests."""

from __future__ import annotations

import os
import pathlib

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# The torch device the model-running tests use: cpu here and in CI; a GPU check
# runs the same tests with SPECDEC_TEST_DEVICE=cuda:0 (docs/gpu-check.md).
TEST_DEVICE = os.environ.get("SPECDEC_TEST_DEVICE", "cpu")


def make_tiny_llama(
    out_dir: pathlib.Path,
    *,
    vocab_size: int = 32,
    hidden_size: int = 32,
    layers: int = 1,
    seed: int = 0,
    max_positions: int = 128,
    eos_token_id: int | None = None,
    logit_scale: float = 1.0,
) -> pathlib.Path:
    """Save a randomly initialised (seeded) Llama to ``out_dir``. ``logit_scale``
    sharpens (> 1) or flattens the output distribution via the LM head."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(out_dir)
    return pathlib.Path(out_dir)


def make_noisy_copy(src_dir: pathlib.Path, out_dir: pathlib.Path, *, noise: float, seed: int = 0) -> pathlib.Path:
    """A draft that mostly agrees with ``src_dir``'s model: its weights plus
    Gaussian noise of relative scale ``noise``."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(src_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise * p.std().clamp(min=1e-3))
    model.save_pretrained(out_dir)
    return pathlib.Path(out_dir)


def add_byte_tokenizer(model_dir: pathlib.Path) -> pathlib.Path:
    """Give a model directory a byte-level tokenizer: ids 0..255 are the bytes, no
    merges. Multi-byte UTF-8 characters then span several tokens, which is what
    incremental detokenisation must get right. The model's vocab_size must be
    >= 256; ids above 255 decode to nothing."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(pathlib.Path(model_dir) / "tokenizer.json"))
    (pathlib.Path(model_dir) / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}), encoding="utf-8"
    )
    return pathlib.Path(model_dir)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))

