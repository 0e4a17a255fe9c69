"""Run draft/target services in this process, on a background event loop, for
tests that talk to them with ordinary (blocking) gRPC clients over loopback."""

from __future__ import annotations

import asyncio
import threading

import grpc

from specdec.serving.config import CONFIG_CLASSES
from specdec.serving.model_host import RunningService, start_model_service

from tiny_models import TEST_DEVICE


class LoopThread:
    """An asyncio loop on a daemon thread; ``call`` runs a coroutine on it."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-loop", daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_service(loop: LoopThread, role: str, model, **overrides) -> RunningService:
    """Start a draft or target service on 127.0.0.1 (a free port) and wait until
    it serves."""
    if role == "draft":
        from draft_service.servicer import add_to_server
    else:
        from target_service.servicer import add_to_server
    values = {"model": str(model), "host": "127.0.0.1", "port": 0, "device": TEST_DEVICE, **overrides}
    config = CONFIG_CLASSES[role](**values)
    service, _ = loop.call(start_model_service(config, add_to_server))
    return service


def channel(service: RunningService) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{service.port}")
