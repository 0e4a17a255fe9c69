"""A target and draft of another family's shape, with random weights and the
bundled tokenizer, for benchmarks of the batched forward on other
architectures (``specdec bench --random-pair qwen2``). The target is the
bundled target's size (8 layers, 320 wide, head dim 64, vocabulary 4096), the
draft one layer of the same shape. Random weights make random text, and an
acceptance rate of chance: what such a pair measures is the forward, not
speculation."""

from __future__ import annotations

import pathlib
import shutil

import torch

# Per family, what its shape adds to the common one.
FAMILIES = {
    "qwen2": ("qwen2", dict(num_key_value_heads=1, use_sliding_window=False)),
    "qwen3": ("qwen3", dict(num_key_value_heads=1)),
    "mistral": ("mistral", dict(num_key_value_heads=1, sliding_window=64)),
    "gemma2": ("gemma2", dict(num_key_value_heads=1, sliding_window=64, query_pre_attn_scalar=64)),
    "llama": ("llama", dict(num_key_value_heads=5)),
}


def make_random_pair(family: str, out_dir: pathlib.Path, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    """``out_dir``/target and ``out_dir``/draft, built once (kept if present)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specdec.models import bundled
    from specdec.models.tokenizer import tokenizer_files

    if family not in FAMILIES:
        raise ValueError(f"--random-pair {family!r}: one of {', '.join(FAMILIES)}")
    model_type, extra = FAMILIES[family]
    dirs = []
    for role, layers in (("target", 8), ("draft", 1)):
        where = out_dir / role
        dirs.append(where)
        if (where / "config.json").is_file():
            continue
        config = AutoConfig.for_model(model_type, vocab_size=4096, hidden_size=320, intermediate_size=864,
                                      num_hidden_layers=layers, num_attention_heads=5, head_dim=64,
                                      max_position_embeddings=1024, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                      tie_word_embeddings=True, **extra)
        torch.manual_seed(seed + layers)
        AutoModelForCausalLM.from_config(config).save_pretrained(where)
        for path in tokenizer_files(bundled.target_path()):
            shutil.copy(path, where / path.name)
    return dirs[0], dirs[1]
