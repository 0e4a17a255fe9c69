"""specdec: distributed speculative decoding.

Layers, each importing only those below it: ``specdec.core`` (sampling and
verification math, the round loop, γ policies, the interfaces),
``specdec.models`` (model runner, KV-cache adapter, local proposer and
verifier, the in-process decoder), ``specdec.telemetry`` (traces and metrics),
``specdec.serving`` (what the gRPC services share, and the client), then the
services (``specdec.draft_service``, ``specdec.target_service``,
``specdec.coordinator``) and the
command line. ``specdec.tools`` (benchmarks, training, network emulation) is
not the runtime. See docs/architecture.md.

The names below are imported on first use (PEP 562), not with the package: the
decoder pulls in torch and transformers, seconds of start-up that ``specdec
--help``, ``specdec netem`` or a client need not pay."""

import importlib

__version__ = "0.1.0"

_LAZY = {
    "Client": "specdec.serving.client",  # the coordinator client; see specdec/serving/client.py
    "GenerationOutput": "specdec.models.decoder",
    "SamplingParams": "specdec.core.interfaces",
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
