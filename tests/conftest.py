import os
import pathlib
import sys

import pytest
import torch

# The coordinators this suite starts, in this process and as processes of their own,
# serve no HTTP API unless a test gives them a port: they would all take 8000.
os.environ.setdefault("SPECDEC_COORDINATOR_HTTP_PORT", "0")
sys.path.insert(0, str(pathlib.Path(__file__).parent))

from transformers.utils import logging as hf_logging  # noqa: E402

from tiny_models import TEST_DEVICE, make_noisy_copy, make_tiny_llama  # noqa: E402

hf_logging.disable_progress_bar()

# Tiny models are slower with threads than without, and CI has 2 cores shared with
# the service processes the e2e tests start.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def device() -> str:
    """Where the model-running tests put their models: SPECDEC_TEST_DEVICE, default cpu."""
    from specdec.models.runner import parse_device

    return str(parse_device(TEST_DEVICE))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target, close draft, far draft) directories: vocab 32, sharp distributions."""
    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_llama(root / "target", layers=2, seed=1, logit_scale=20)
    close = make_noisy_copy(target, root / "close", noise=0.02, seed=2)
    far = make_tiny_llama(root / "far", layers=1, seed=7, logit_scale=20)
    return target, close, far


@pytest.fixture
def provider():
    """A global tracer provider for one test, exporting to memory (``provider.memory``);
    removed afterwards. OpenTelemetry allows one global provider per process, so
    tests swap it the way OpenTelemetry's own test utilities do."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.util._once import Once

    def reset() -> None:
        trace._TRACER_PROVIDER_SET_ONCE = Once()
        trace._TRACER_PROVIDER = None

    reset()
    p = TracerProvider(resource=Resource.create({"service.name": "specdec-test"}))
    p.memory = InMemorySpanExporter()
    p.add_span_processor(SimpleSpanProcessor(p.memory))
    trace.set_tracer_provider(p)
    yield p
    p.shutdown()
    reset()
