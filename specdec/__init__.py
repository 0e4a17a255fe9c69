"""specdec: distributed speculative decoding.

The core package: sampling and verification math, model loading, the KV-cache
adapter, the round loop, γ policies, and the in-process decoder.

The names below are imported on first use (PEP 562), not with the package: the
decoder pulls in torch and transformers, seconds of start-up that ``specdec
--help``, ``specdec netem`` or a client need not pay."""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Client": "specdec.serving.client",  # the coordinator client; see specdec/serving/client.py
    "GenerationOutput": "specdec.models.decoder",
    "SamplingParams": "specdec.core.sampling",
    "SpeculativeDecoder": "specdec.models.decoder",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
