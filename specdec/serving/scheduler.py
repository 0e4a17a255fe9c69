"""Continuous batching: every session's model work in shared forward passes.

A call's work is a *steps* generator (:mod:`specdec.models.local`): it yields a
:class:`~specdec.models.runner.Pass` whenever it needs logits. One thread owns
the model. Each time around its loop it takes the work that arrived, lets it
run up to its first pass, then runs one forward pass over the passes that are
waiting -- those of different sessions, with different context lengths and
numbers of new tokens (a ragged batch) -- and hands each its logits (or, to
work that samples, its probabilities: the sampling rows of every session in the
pass are processed in one batched step, :func:`specdec.models.runner.replies`).
A call joins at the next pass; nothing waits for a batch to fill.

Scheduling:

* **Fair.** Waiting work is a queue; a pass takes it from the front, up to
  ``max_sequences`` rows and ``max_tokens`` new tokens (the first row always
  fits), and work with more passes to go rejoins at the back. So every waiting
  session is in a pass before any session has a second.
* **Calls before background work.** Background work (drafting ahead) runs only
  in passes no call is waiting for: the device would idle otherwise. A call
  arriving closes it between two passes (see :func:`specdec.models.local.draft_ahead_steps`).
* **Failures stay with their work.** A step that raises fails its own call; a
  batched pass that raises is run again row by row, so only the row that
  cannot run fails.

Timing, per call (:class:`~specdec.serving.timing.ServerTiming`): compute is the
forward passes it was in plus its own steps (copies excluded), queue is the rest
of its time here: waiting for the thread, and for passes it did not fit in.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from specdec.core.interfaces import DraftToken
from specdec.models.local import Steps
from specdec.models.runner import ModelRunner, Pass
from specdec.serving.timing import ServerTiming

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Work:
    """One call's (or one background job's) steps, and where it stands."""

    steps: Steps
    timing: ServerTiming
    on_draft: Callable[[DraftToken], None] | None = None  # called on the model thread
    background: bool = False
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    submitted: float = dataclasses.field(default_factory=time.perf_counter)
    waiting: Pass | None = None  # the pass its steps wait for


@dataclasses.dataclass
class PassStats:
    """One forward pass, for metrics."""

    sequences: int
    tokens: int
    seconds: float


class PassScheduler:
    """The model's thread and its queue of work (see the module docstring)."""

    def __init__(self, runner: ModelRunner, *, max_sequences: int, max_tokens: int, name: str = "model",
                 on_pass: Callable[[PassStats], None] | None = None,
                 on_started: Callable[[float], None] | None = None):
        self.runner = runner
        self.max_sequences = max_sequences if runner.batched else 1
        self.max_tokens = max_tokens
        self.on_pass = on_pass  # each pass, on the model thread
        self.on_started = on_started  # each call's wait for its first pass, in seconds
        self._wake = threading.Condition()
        self._arrived: list[Work] = []
        self._queue: collections.deque[Work] = collections.deque()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"{name}-passes", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ from any thread

    def submit(self, steps: Steps, timing: ServerTiming,
               on_draft: Callable[[DraftToken], None] | None = None) -> concurrent.futures.Future:
        """Run a call's ``steps``; the future holds what they return (or raise).
        ``on_draft`` gets each DraftToken they yield, on the model thread."""
        return self._add(Work(steps, timing, on_draft))

    def submit_background(self, steps: Steps, timing: ServerTiming) -> concurrent.futures.Future:
        """Run ``steps`` in passes no call waits for; closed when a call arrives."""
        return self._add(Work(steps, timing, background=True))

    def calls_waiting(self) -> bool:
        """Whether a call's work has arrived or waits for a pass (background work
        should stop at its next step)."""
        return any(not w.background for w in self._arrived) or any(not w.background for w in self._queue)

    def close(self) -> None:
        """Stop after the pass in progress; work not finished fails with RuntimeError."""
        with self._wake:
            self._closed = True
            self._wake.notify()

    def _add(self, work: Work) -> concurrent.futures.Future:
        with self._wake:
            if self._closed:
                work.future.set_exception(RuntimeError("the model's scheduler is closed"))
                work.steps.close()
            else:
                self._arrived.append(work)
                self._wake.notify()
        return work.future

    # ------------------------------------------------------------------ the model thread

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self._arrived or self._queue or self._closed):
                    self._wake.wait()
                if self._closed:
                    break
                arrived, self._arrived = self._arrived, []
            if any(not w.background for w in arrived):
                self._close_background()
                # Background work arriving with a call is a bet on a state the call may change: dropped unstarted.
                for work in [w for w in arrived if w.background]:
                    arrived.remove(work)
                    work.steps.close()
                    self._finish(work, None)
            for work in arrived:
                self._advance(work, None)
            batch = self._next_batch()
            if batch:
                self._run_pass(batch)
        for work in list(self._queue) + self._arrived:
            self._fail(work, RuntimeError("the model service is shutting down"))

    def _next_batch(self) -> list[Work]:
        """From the front of the queue: calls if any wait, else background work,
        within the batch limits."""
        calls_waiting = any(not w.background for w in self._queue)
        batch, tokens = [], 0
        for work in list(self._queue):
            if work.background and calls_waiting:
                continue
            n = self.runner.pass_tokens(work.waiting)
            if batch and (len(batch) >= self.max_sequences or tokens + n > self.max_tokens):
                break
            batch.append(work)
            tokens += n
        chosen = {id(work) for work in batch}  # one pass over the queue, not a removal per row
        self._queue = collections.deque(w for w in self._queue if id(w) not in chosen)
        return batch

    def _run_pass(self, batch: list[Work]) -> None:
        passes = [w.waiting for w in batch]
        for work in batch:
            if work.timing.passes == 0 and self.on_started is not None and not work.background:
                self.on_started(time.perf_counter() - work.submitted)
        start = time.perf_counter()
        try:
            logits = self.runner.run_passes(passes)
        except Exception as e:
            if len(batch) == 1:
                self._fail(batch[0], e)
                return
            log.warning("a batched pass of %d sequences failed: running them one by one", len(batch))
            for work in batch:
                self._run_pass([work])
            return
        self._synchronize()
        elapsed = time.perf_counter() - start
        tokens = sum(p.ran for p in passes)
        if self.on_pass is not None:
            self.on_pass(PassStats(len(batch), tokens, elapsed))
        for work, out, p in zip(batch, logits, passes, strict=True):
            work.timing.compute_s += elapsed
            work.timing.computed_tokens += p.ran
            work.timing.passes += 1
            work.timing.pass_sequences += len(batch)
            work.timing.pass_tokens += tokens
            work.timing.pass_seconds += elapsed
            self._advance(work, out)

    def _advance(self, work: Work, reply: torch.Tensor | None) -> None:
        """Run ``work``'s steps up to their next pass (queued) or their end.

        The steps' own time is added to compute before the call is finished:
        the caller reads its timing as soon as the future is done."""
        start, copies = time.perf_counter(), work.timing.copy_s
        outcome: tuple[str, Any] = ("queued", None)
        try:
            while True:
                item = work.steps.send(reply)
                if isinstance(item, Pass):
                    work.waiting = item
                    break
                reply = None
                if work.on_draft is not None:
                    work.on_draft(item)
        except StopIteration as done:
            outcome = ("done", done.value)
        except Exception as e:
            outcome = ("failed", e)
        self._synchronize()
        work.timing.compute_s += max(0.0, time.perf_counter() - start - (work.timing.copy_s - copies))
        kind, value = outcome
        if kind == "queued":
            self._queue.append(work)
        elif kind == "done":
            self._finish(work, value)
        else:
            self._fail(work, value)

    def _close_background(self) -> None:
        for work in [w for w in self._queue if w.background]:
            self._queue.remove(work)
            try:
                work.steps.close()
            except Exception as e:
                self._fail(work, e)
            else:
                self._finish(work, None)

    def _finish(self, work: Work, result: Any) -> None:
        t = work.timing
        t.queue_s = max(0.0, time.perf_counter() - work.submitted - t.compute_s - t.copy_s)
        if not work.future.done():
            work.future.set_result(result)

    def _fail(self, work: Work, error: BaseException) -> None:
        work.steps.close()
        if not work.future.done():
            work.future.set_exception(error)

    def _synchronize(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)
