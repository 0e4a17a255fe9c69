"""Run services for tests that talk to them with ordinary (blocking) gRPC
clients over loopback: draft/target services in this process, on a background
event loop (:class:`LoopThread`, :func:`start_service`), or any service as a
process of its own (:class:`ServiceProcess`)."""

from __future__ import annotations

import asyncio
import functools
import pathlib
import subprocess
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.proto import specdec_pb2 as pb
from specdec.proto import specdec_pb2_grpc as pb_grpc
from specdec.serving.config import CONFIG_CLASSES
from specdec.serving.model_host import RunningService, start_model_service

from tiny_models import TEST_DEVICE


def on_a_loop(test):
    """An async test as a plain one (pytest-asyncio is not a dependency): run on a new event loop."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        asyncio.run(test(*args, **kwargs))
    return run


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
        from specdec.draft_service.servicer import DRAFT as service_role
    else:
        from specdec.target_service.servicer import TARGET as service_role
    values = {"model": str(model), "host": "127.0.0.1", "port": 0, "device": TEST_DEVICE, **overrides}
    config = CONFIG_CLASSES[role](**values)
    service, _ = loop.call(start_model_service(config, service_role))
    return service


def channel(service: RunningService) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{service.port}")


class ServiceProcess:
    """A service in a process of its own (``argv``, ``env``), logging to a file,
    answering gRPC health at ``address``."""

    def __init__(self, name: str, argv: list[str], logdir: pathlib.Path, address: str, *,
                 env: dict[str, str] | None = None, cwd: pathlib.Path | None = None):
        self.name = name
        self.address = address
        self.log_path = logdir / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_serving(self, timeout: float = 90, service: str = "", address: str | None = None) -> ServiceProcess:
        """Until gRPC health says SERVING for ``service`` ("": the server as a whole),
        asked in plaintext on ``address`` (None: the service's own)."""
        fast_reconnect = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
        with grpc.insecure_channel(address or self.address, options=fast_reconnect) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.time() + timeout
            while True:
                assert self.proc.poll() is None, f"{self.name} died:\n{self.log()}"
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=1,
                                          wait_for_ready=True).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                assert time.time() < deadline, f"{self.name} not SERVING:\n{self.log()}"
                time.sleep(0.1)

    def model_info(self, role: str) -> pb.ModelInfo:
        """A draft or target service's GetModelInfo."""
        with grpc.insecure_channel(self.address) as ch:
            stub = (pb_grpc.DraftServiceStub if role == "draft" else pb_grpc.TargetServiceStub)(ch)
            return stub.GetModelInfo(pb.ModelInfoRequest(), timeout=5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class SyncEngine:
    """The coordinator's asynchronous engine, driven from a test's thread: every
    call runs on ``loop`` (where the engine was made, as its grpc.aio channels
    need). ``generate`` returns a blocking iterator over the turn's events;
    ``gone()`` makes a cancellation flag a test sets as the servicer would."""

    def __init__(self, loop: LoopThread, make):
        """``make``: a plain function building the engine, run on the loop."""
        async def build():
            return make()
        self.loop = loop
        self.engine = loop.call(build())
        self.directory = _OnLoop(loop, self.engine.directory)
        self.pools = {role: _OnLoop(loop, pool) for role, pool in self.engine.pools.items()}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, job, gone: Gone | None = None) -> SyncSteps:
        return SyncSteps(self.loop, self.engine.generate(job, gone.event if gone else None))

    def gone(self) -> Gone:
        return Gone(self.loop)

    def pair(self):
        return self.loop.call(self.engine.pair())

    def close_session(self, session_id: str) -> bool:
        return self.loop.call(self.engine.close_session(session_id))

    def close(self) -> None:
        self.loop.call(self.engine.close())


class Gone:
    """A turn's cancellation flag (an asyncio.Event on the loop), set from a test's thread."""

    def __init__(self, loop: LoopThread):
        async def make():
            return asyncio.Event()
        self.loop, self.event = loop, loop.call(make())

    def set(self) -> None:
        async def set_it():
            self.event.set()
        self.loop.call(set_it())


class SyncSteps:
    """An async generator on the loop, iterated (and closed) from a test's thread."""

    def __init__(self, loop: LoopThread, steps):
        self.loop, self.steps = loop, steps

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return self.loop.call(self.steps.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self.loop.call(self.steps.aclose())


class _OnLoop:
    """An object whose coroutine methods are run on the loop and waited for."""

    def __init__(self, loop: LoopThread, target):
        self._loop, self._target = loop, target

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if not asyncio.iscoroutinefunction(value):
            return value
        return lambda *args, **kw: self._loop.call(value(*args, **kw))

    def __len__(self) -> int:
        return len(self._target)
