"""The model thread's scheduler: calls join the next pass, passes are fair and
within their limits, background work yields to calls, failures stay with their
work, and timings add up."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from specdec.models.runner import Pass
from specdec.serving.scheduler import PassScheduler
from specdec.serving.timing import ServerTiming

VOCAB = 4


@dataclasses.dataclass
class Seq:
    name: str
    tokens: list[int] = dataclasses.field(default_factory=lambda: [1])
    cache_length: int = 0


class FakeRunner:
    """Records the passes it is given; logits say which row they belong to."""

    batched = True
    device = torch.device("cpu")

    def __init__(self, delay: float = 0.0, broken: str | None = None):
        self.delay, self.broken = delay, broken
        self.passes: list[list[str]] = []

    def pass_tokens(self, p: Pass) -> int:
        return max(p.last, p.run, 1)

    def run_passes(self, passes):
        names = [p.seq.name for p in passes]
        self.passes.append(names)
        time.sleep(self.delay)
        if self.broken in names:
            raise RuntimeError(f"row {self.broken} cannot run")
        for p in passes:
            p.ran = self.pass_tokens(p)
        return [torch.full((p.last, VOCAB), float(len(p.seq.name))) for p in passes]


def steps(seq: Seq, passes: int = 1, last: int = 1):
    """``passes`` passes over ``seq``, then its name."""
    for _ in range(passes):
        logits = yield Pass(seq, last)
        assert logits.shape == (last, VOCAB)
    return seq.name


@pytest.fixture
def make():
    made = []

    def make_scheduler(runner, **limits):
        limits.setdefault("max_sequences", 8)
        limits.setdefault("max_tokens", 64)
        scheduler = PassScheduler(runner, **limits)
        made.append(scheduler)
        return scheduler

    yield make_scheduler
    for s in made:
        s.close()


def submit_together(scheduler, runner, works, timings=None, before=lambda: None):
    """Submit ``works`` while the model thread is busy, so they meet in one pass
    (``before()`` runs just before they are submitted)."""
    hold = threading.Event()

    def blocker():
        yield Pass(Seq("block"))
        hold.wait(5)

    first = scheduler.submit(blocker(), ServerTiming())
    time.sleep(0.05)
    timings = timings or [ServerTiming() for _ in works]
    before()
    futures = [scheduler.submit(w, t) for w, t in zip(works, timings, strict=True)]
    hold.set()
    first.result(5)
    return futures


def test_waiting_calls_share_one_pass(make):
    runner = FakeRunner(delay=0.05)
    scheduler = make(runner)
    timings = [ServerTiming() for _ in "abc"]
    futures = submit_together(scheduler, runner, [steps(Seq(n)) for n in "abc"], timings)
    assert [f.result(5) for f in futures] == ["a", "b", "c"]
    assert ["a", "b", "c"] in runner.passes
    for t in timings:  # each call knows the pass it shared: 3 sessions, 3 new tokens, its time
        assert (t.passes, t.pass_sequences, t.pass_tokens) == (1, 3, 3) and t.pass_seconds >= 0.05


def test_a_pass_takes_every_waiting_session_before_any_gets_a_second(make):
    runner = FakeRunner(delay=0.02)
    scheduler = make(runner, max_sequences=2)
    futures = submit_together(scheduler, runner, [steps(Seq(n), passes=2) for n in "abc"])
    assert [f.result(5) for f in futures] == ["a", "b", "c"]
    after = runner.passes[runner.passes.index(["a", "b"]):]
    assert after[:3] == [["a", "b"], ["c", "a"], ["b", "c"]]  # c's first turn before a's and b's second


def test_the_token_limit_splits_passes_but_a_long_row_runs_alone(make):
    runner = FakeRunner(delay=0.02)
    scheduler = make(runner, max_tokens=10)
    futures = submit_together(scheduler, runner, [steps(Seq("a"), last=6), steps(Seq("bb"), last=6),
                                                  steps(Seq("ccc"), last=30)])
    assert [f.result(5) for f in futures] == ["a", "bb", "ccc"]
    assert ["a"] in runner.passes and ["bb"] in runner.passes and ["ccc"] in runner.passes


def test_a_failing_row_fails_its_own_call_only(make):
    runner = FakeRunner(delay=0.02, broken="bad")
    scheduler = make(runner)
    futures = submit_together(scheduler, runner, [steps(Seq("a")), steps(Seq("bad")), steps(Seq("c"))])
    assert futures[0].result(5) == "a" and futures[2].result(5) == "c"
    with pytest.raises(RuntimeError, match="row bad cannot run"):
        futures[1].result(5)


def test_a_step_that_raises_fails_its_own_call_only(make):
    def invalid():
        raise ValueError("position 9 is past the end")
        yield  # a generator

    scheduler = make(FakeRunner())
    bad, good = scheduler.submit(invalid(), ServerTiming()), scheduler.submit(steps(Seq("a")), ServerTiming())
    with pytest.raises(ValueError, match="past the end"):
        bad.result(5)
    assert good.result(5) == "a"


def test_background_work_runs_only_when_no_call_waits_and_a_call_closes_it(make):
    runner = FakeRunner(delay=0.01)
    scheduler = make(runner)
    closed = threading.Event()

    def ahead():
        try:
            while not scheduler.calls_waiting():
                yield Pass(Seq("ahead"))
        finally:
            closed.set()

    scheduler.submit_background(ahead(), ServerTiming())
    time.sleep(0.1)
    assert ["ahead"] in runner.passes  # the device was idle: it drafted ahead
    assert scheduler.submit(steps(Seq("call")), ServerTiming()).result(5) == "call"
    assert closed.wait(5)
    assert all(names in (["ahead"], ["call"]) for names in runner.passes)  # never in the call's pass
    assert runner.passes[-1] == ["call"]


def test_background_work_arriving_with_a_call_is_dropped_unstarted(make):
    """A bet on a session's state that a call arriving at once may change: it
    never starts (its steps are closed before their first line runs)."""
    runner = FakeRunner()
    scheduler = make(runner)
    started = []

    def ahead():
        started.append(True)
        yield Pass(Seq("ahead"))

    background = []
    (call,) = submit_together(scheduler, runner, [steps(Seq("call"))],
                              before=lambda: background.append(scheduler.submit_background(ahead(), ServerTiming())))
    assert call.result(5) == "call" and background[0].result(5) is None
    assert not started and ["ahead"] not in runner.passes


def test_timing_counts_the_passes_a_call_was_in_and_its_wait(make):
    runner = FakeRunner(delay=0.05)
    scheduler = make(runner, max_sequences=1)
    timings = [ServerTiming(), ServerTiming()]
    futures = [scheduler.submit(steps(Seq(n), passes=2), t) for n, t in zip("ab", timings, strict=True)]
    for f in futures:
        f.result(5)
    for t in timings:
        assert t.compute_s >= 0.1 and t.computed_tokens == 2
    assert timings[1].queue_s >= 0.05  # b waited for a's passes, one at a time


def test_a_call_with_no_pass_has_its_compute_when_it_is_done(make):
    """Work that needs no pass (every draft made ahead) still took compute time,
    and its timing is complete by the time its future says so."""
    def no_pass():
        time.sleep(0.01)
        return "reused"
        yield  # a generator with no pass

    seen = []
    timing = ServerTiming()
    future = make(FakeRunner()).submit(no_pass(), timing)
    future.add_done_callback(lambda _: seen.append(timing.compute_s))
    assert future.result(5) == "reused"
    assert seen[0] >= 0.01


def test_the_wait_for_a_first_pass_is_reported_once_per_call(make):
    waits = []
    runner = FakeRunner(delay=0.02)
    scheduler = make(runner, max_sequences=1, on_started=waits.append)
    futures = [scheduler.submit(steps(Seq(n), passes=2), ServerTiming()) for n in "ab"]
    for f in futures:
        f.result(5)
    assert len(waits) == 2 and max(waits) >= 0.02  # one call waited for the other's pass


def test_after_close_work_fails_instead_of_hanging(make):
    scheduler = make(FakeRunner())
    scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        scheduler.submit(steps(Seq("a")), ServerTiming()).result(5)
