"""specdec: distributed speculative decoding.

The core package: sampling and verification math, model loading, the KV-cache
adapter, the round loop, γ policies, and the in-process decoder."""

from specdec.decoder import GenerationOutput, SpeculativeDecoder
from specdec.sampling import SamplingParams
from specdec.client import Client  # noqa: E402  (the coordinator client; see specdec/client.py)

__all__ = ["Client", "GenerationOutput", "SamplingParams", "SpeculativeDecoder"]
__version__ = "0.1.0"
