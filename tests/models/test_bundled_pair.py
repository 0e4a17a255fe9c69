"""The bundled model pair (specdec/models): present, sane, and lossless in use.

Kept fast (a few seconds): the models are tiny and the generations short.
"""

from __future__ import annotations

import fnmatch
import json

import pytest

from specdec.models import bundled


def test_the_pair_ships_with_the_package():
    # Every command defaults to these weights: missing weights are a failure, not a skip.
    assert bundled.is_available(), f"no model weights under {bundled.models_dir()}"


SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "class Foo:\n\tdef bar(self):\n\t\tpass\n\n\n\nx = 1\n",  # tabs and blank lines
    "s = 'héllo wörld — ünïcödé ✓ 日本語 🐍'\n",  # non-ASCII, incl. astral plane
    "   leading spaces\r\nwindows line end\r\n\n\t \n",  # CRLF, trailing whitespace
    "",
    "#!/usr/bin/env python3\n\"\"\"Docstring.\"\"\"\nimport os, sys  # comment\n",
]

# pyproject.toml: [tool.setuptools.package-data] specdec = ["models/*/*", "models/*.md"]
PACKAGE_DATA = ["target/*", "draft/*", "*.md"]  # pyproject: package data of specdec.models


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundled.target_path(), local_files_only=True)


@pytest.mark.parametrize("text", SNIPPETS)
def test_tokenizer_round_trips_source(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_tokenizer_round_trips_a_stdlib_file(tokenizer):
    import inspect
    import json as some_module

    text = inspect.getsource(some_module)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_tokenizer_has_eos(tokenizer):
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.eos_token_id is not None


def test_both_models_share_one_tokenizer():
    t, d = bundled.target_path(), bundled.draft_path()
    assert (t / "tokenizer.json").read_bytes() == (d / "tokenizer.json").read_bytes()


def test_configs_are_a_sane_pair():
    t = json.loads((bundled.target_path() / "config.json").read_text())
    d = json.loads((bundled.draft_path() / "config.json").read_text())
    for cfg in (t, d):
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert cfg["tie_word_embeddings"] is True
    assert t["vocab_size"] == d["vocab_size"] == 4096
    assert t["eos_token_id"] == d["eos_token_id"]
    assert d["num_hidden_layers"] <= 2 < t["num_hidden_layers"]
    assert d["hidden_size"] <= t["hidden_size"]


def test_weights_are_bf16_and_small():
    from safetensors import safe_open

    total = 0
    for path in (bundled.target_path(), bundled.draft_path()):
        f = path / "model.safetensors"
        total += f.stat().st_size
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                assert str(st.get_slice(name).get_dtype()) in ("BF16", "bfloat16"), name
    assert total <= 40 * 1024 * 1024


def test_every_model_file_is_package_data():
    """All shipped files match pyproject's package-data globs, so `pip install .` has them."""
    root = bundled.models_dir()
    files = [p.relative_to(root).as_posix() for p in root.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, pat) and f.count("/") == pat.count("/")
                                           for pat in PACKAGE_DATA)]
    assert not missing, missing
    assert (root / "MODEL_CARD.md").is_file()


@pytest.fixture(scope="module")
def decoder(device):
    from specdec import SpeculativeDecoder

    return SpeculativeDecoder(target=bundled.target_path(), draft=bundled.draft_path(), device=device)


PROMPTS = [
    "import os\n\n\ndef main(argv):\n    ",
    "class Stack:\n    \"\"\"A LIFO stack.\"\"\"\n\n    def __init__(self):\n        self.",
    "for i, line in enumerate(lines):\n\tif not line.strip():\n\t\t",
]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_target_only(decoder, prompt):
    from specdec import SamplingParams

    ids = decoder.tokenizer.encode(prompt, add_special_tokens=False)
    greedy = SamplingParams(temperature=0.0, seed=0)
    reference = decoder.generate(ids, max_new_tokens=24, sampling=greedy, gamma=0)
    assert len(reference.token_ids) > 0
    for gamma in (1, 4, 7):
        out = decoder.generate(ids, max_new_tokens=24, sampling=greedy, gamma=gamma)
        assert out.token_ids == reference.token_ids, f"gamma={gamma}"
        assert sum(out.accepted) <= sum(out.gammas)


def test_the_lean_target_decodes_greedily_as_hugging_face_does(decoder):
    """On the benchmark's own held-out prompts: speculative decoding with the
    lean target gives exactly Hugging Face's ``generate`` of the target."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdec import SamplingParams
    from specdec.tools.eval_pair import held_out_streams, make_prompts

    assert decoder.target.lean
    hf = AutoModelForCausalLM.from_pretrained(decoder.target.path, dtype=torch.float32).to(decoder.target.device).eval()
    greedy = SamplingParams(temperature=0.0, seed=0)
    for prompt in make_prompts(held_out_streams(decoder.tokenizer), 8, 128, 64, seed=0):
        ids = torch.tensor([prompt], device=hf.device)
        expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        for gamma in (0, 4):
            out = decoder.generate(prompt, max_new_tokens=64, sampling=greedy, gamma=gamma)
            assert out.token_ids == expected[:len(out.token_ids)], f"gamma={gamma}"
            assert out.finish_reason == "eos" or len(out.token_ids) == 64
