"""One model on its device and the scheduler that batches its passes.

Why one model thread (:mod:`specdec.serving.scheduler`): forward passes are
long, blocking calls. Running them on the event loop would freeze health checks
and every other session; several threads would run passes on one device at once
for no gain. One thread per model serialises the device, batches the sessions'
passes, and leaves the loop free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from specdec.core.interfaces import DraftToken
from specdec.core.sampling import SparseDist
from specdec.models.local import Steps
from specdec.models.runner import KVSettings, ModelRunner, block_size_for
from specdec.serving.config import ServiceConfig
from specdec.serving.errors import Draining, Unavailable
from specdec.serving.scheduler import PassScheduler
from specdec.serving.timing import ServerTiming
from specdec.telemetry.metrics import ServiceMetrics

log = logging.getLogger(__name__)


class ModelWorker:
    """The service's model, its pass scheduler and its background work.

    ``metrics`` (optional) gets each pass, each call's wait for its first pass,
    and the timing of background work."""

    def __init__(self, config: ServiceConfig, metrics: ServiceMetrics | None = None):
        self.config = config
        self.metrics = metrics
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{config.role}-load")
        self.runner: ModelRunner | None = None
        self.scheduler: PassScheduler | None = None
        self.background: concurrent.futures.Future | None = None  # the last background work
        self.draining = False

    # ------------------------------------------------------------------ lifecycle

    async def load(self, kv_headroom: Callable[[int], int]) -> ModelRunner:
        """The model loaded on the executor (the event loop keeps answering
        health checks meanwhile), with a KV pool of ``--max-cached-tokens`` plus
        ``kv_headroom(block size)`` positions. Not yet in use: see :meth:`start`."""
        cfg = self.config
        block = block_size_for(cfg.device, cfg.kv_block_size)
        kv = KVSettings(tokens=cfg.max_cached_tokens + kv_headroom(block), block_size=block,
                        memory_fraction=cfg.kv_memory_fraction, keep_behind=2 * cfg.gamma_max + 8,
                        kernel=None if cfg.attention_kernel == "auto" else cfg.attention_kernel)
        return await asyncio.get_running_loop().run_in_executor(
            self.executor,
            functools.partial(ModelRunner, cfg.model_path(), cfg.device, cfg.dtype, lean=cfg.lean_forward,
                              cuda_graphs=cfg.cuda_graphs, kv=kv),
        )

    def start(self, runner: ModelRunner) -> None:
        """Serve with ``runner``: its pass scheduler starts."""
        cfg, metrics = self.config, self.metrics
        if cfg.max_batch > 1 and not runner.batched:
            log.info("%s service: one session per forward pass (%s's rotary embedding depends on the sequence "
                     "length)", cfg.role, runner.name)
        self.scheduler = PassScheduler(
            runner, max_sequences=cfg.max_batch, max_tokens=cfg.max_batch_tokens, name=cfg.role,
            on_pass=metrics.observe_pass if metrics is not None else None,
            on_started=metrics.observe_queue_wait if metrics is not None else None)
        self.runner = runner

    def drain(self) -> None:
        """Refuse calls (Draining) and background work from now on."""
        self.draining = True

    def close(self) -> None:
        self.draining = True  # background work stops at its next step
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.scheduler is not None:
            self.scheduler.close()

    @property
    def ready(self) -> bool:
        return self.runner is not None

    def require_ready(self) -> ModelRunner:
        if self.draining:
            raise Draining(f"the {self.config.role} service is shutting down")
        if self.runner is None:
            raise Unavailable(f"the {self.config.role} service is still loading its model")
        return self.runner

    # ------------------------------------------------------------------ running model work

    async def run_steps(self, steps: Steps, timing: ServerTiming,
                        on_draft: Callable[[DraftToken], None] | None = None) -> Any:
        """Run a call's ``steps`` in the model's batched passes; what they return.
        ``timing`` gets its queue, compute and copy time and tokens run."""
        return await asyncio.wrap_future(self.scheduler.submit(steps, timing, on_draft))

    def run_in_background(self, steps: Steps) -> None:
        """Run ``steps`` in passes no call waits for (drafting ahead); they are
        closed when a call arrives. Their compute, copies and tokens go into the
        metrics like a call's: the device's load includes them. Failures are
        logged: they must not affect any call."""
        if self.draining or self.scheduler is None:
            return
        timing = ServerTiming()

        def finished(future: concurrent.futures.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                e = future.exception()
                # a full KV pool only ends drafting ahead early: it is a bet, not a call
                log.log(logging.DEBUG if isinstance(e, MemoryError) else logging.ERROR,
                        "background work on the %s model failed: %s: %s", self.config.role, type(e).__name__, e)
            if self.metrics is not None:
                self.metrics.observe_timing(timing)

        self.background = self.scheduler.submit_background(steps, timing)
        self.background.add_done_callback(finished)

    # ------------------------------------------------------------------ copies (on the model thread)

    def to_device(self, q, timing: ServerTiming):
        """A distribution moved host -> model device, timed as copy (worker thread)."""
        return self._copy(q, self.runner.device, timing)

    def to_host(self, q, timing: ServerTiming):
        """A distribution moved model device -> host, timed as copy (worker thread)."""
        return self._copy(q, torch.device("cpu"), timing)

    def _synchronize(self) -> None:
        device = self.runner.device if self.runner is not None else None
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    def _copy(self, q, device: torch.device, timing: ServerTiming):
        if q is None or _device_of(q) == device:
            return q
        self._synchronize()  # do not bill pending compute to the copy
        start = time.perf_counter()
        if isinstance(q, SparseDist):
            out = SparseDist(ids=q.ids.to(device), probs=q.probs.to(device))
        else:
            out = q.to(device)
        self._synchronize()
        timing.copy_s += time.perf_counter() - start
        return out


def _device_of(q):
    if q is None:
        return None
    return q.probs.device if isinstance(q, SparseDist) else q.device
