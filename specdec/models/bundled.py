"""Where the bundled, pre-trained model pair lives.

The pair (``specdec train-models`` made it; see ``models/MODEL_CARD.md``) ships as
package data beside this module, in ``specdec/models/{target,draft}/``, so it is found both from a
source checkout and after a plain ``pip install .``.  Paths are computed relative
to this file rather than through ``importlib.resources`` because Hugging Face
loaders need a real directory, and setuptools installs package data as files.
"""

from __future__ import annotations

from pathlib import Path


def models_dir() -> Path:
    """Directory holding ``target/``, ``draft/`` and ``MODEL_CARD.md``."""
    return Path(__file__).resolve().parent


def target_path() -> Path:
    """Hugging Face directory of the bundled target model (8-layer Llama)."""
    return models_dir() / "target"


def draft_path() -> Path:
    """Hugging Face directory of the bundled draft model (1-layer Llama, distilled)."""
    return models_dir() / "draft"


def is_available() -> bool:
    """True when both model directories hold weights (e.g. not a stripped checkout)."""
    return all((p / "model.safetensors").is_file() and (p / "config.json").is_file()
               for p in (target_path(), draft_path()))
