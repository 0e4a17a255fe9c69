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
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
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


def add_chat_template(model_dir: pathlib.Path, template: str) -> pathlib.Path:
    """Give a model directory's tokenizer a chat template (Jinja, in its
    tokenizer_config.json, where transformers reads it)."""
    import json

    path = pathlib.Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    path.write_text(json.dumps(config), encoding="utf-8")
    return pathlib.Path(model_dir)


def add_word_tokenizer(model_dir: pathlib.Path, size: int) -> pathlib.Path:
    """Give a model directory a tokenizer of ``size`` words, ``w0`` .. ``w{size-1}``
    (whitespace-separated): models whose vocabularies are padded past it share
    it, and its fingerprint."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(pathlib.Path(model_dir) / "tokenizer.json"))
    (pathlib.Path(model_dir) / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0"}), encoding="utf-8")
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



# Tiny configurations of the families users bring, each exercising what its
# modules do differently: attention biases (llama-bias, qwen2), q/k norms
# (qwen3, olmo2), sliding windows a session crosses (mistral, phi3), Gemma's
# soft-capping, embedding scale and alternating sliding/full layers (gemma2,
# gemma3_text), and multipliers (granite). Windows are 8 positions, so a few
# dozen tokens cross them. olmo2 and granite are named by no code in specdec:
# any decoder whose attention goes through the interface runs the same way.
ARCHITECTURES = {
    "llama": ("llama", {}),
    "llama-bias": ("llama", dict(attention_bias=True)),
    "qwen2": ("qwen2", dict(use_sliding_window=False)),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", dict(sliding_window=8)),
    "gemma2": ("gemma2", dict(sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              query_pre_attn_scalar=16)),
    "gemma3": ("gemma3_text", dict(sliding_window=8,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "phi3": ("phi3", dict(sliding_window=8)),
    "olmo2": ("olmo2", {}),
    "granite": ("granite", dict(embedding_multiplier=2.0, attention_multiplier=0.2, logits_scaling=2.0)),
}


def tiny_config(arch: str, *, vocab_size: int = 96, layers: int = 3, max_positions: int = 512, **overrides):
    """A transformers config of ``arch`` (a key of ARCHITECTURES), tiny."""
    from transformers import AutoConfig

    model_type, extra = ARCHITECTURES[arch]
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    settings.update(extra)
    settings.update(overrides)
    return AutoConfig.for_model(model_type, **settings)


def make_tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised (seeded) causal LM of ``arch``, in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **overrides)).to(dtype).eval()


def save_tiny_model(out_dir: pathlib.Path, arch: str, *, seed: int = 0, logit_scale: float = 1.0,
                    **overrides) -> pathlib.Path:
    """``make_tiny_model`` saved to ``out_dir``; ``logit_scale`` sharpens its output
    distribution (scales the LM head)."""
    model = make_tiny_model(arch, seed=seed, **overrides)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    model.save_pretrained(out_dir)
    return pathlib.Path(out_dir)
