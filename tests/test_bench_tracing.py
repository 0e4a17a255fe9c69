"""The tracing bench's serving order and report (the bench itself is run by hand)."""

from __future__ import annotations

import argparse
import collections

from specdec.tools.bench_tracing import report, serving_order, stack_names


def test_every_stack_serves_as_often_in_abba_rounds():
    names = stack_names(2)
    assert names == ["off-1", "on-1", "off-2", "on-2"]
    order = serving_order(names, requests=5, block=2)
    assert collections.Counter(n for _, n in order) == dict.fromkeys(names, 5)
    first = [n for r, n in order if r == 0]
    second = [n for r, n in order if r == 1]
    assert first == ["off-1"] * 2 + ["on-1"] * 2 + ["off-2"] * 2 + ["on-2"] * 2
    assert second == first[::-1]  # reversed: linear drift hits both modes alike
    assert [n for r, n in order if r == 2] == names  # the remainder, one each


def test_report_compares_modes_per_round_and_shows_the_noise_floor(capsys):
    served = [(r, n, rate) for r in range(3) for n, rate in
              (("off-1", 100.0), ("on-1", 95.0), ("off-2", 102.0), ("on-2", 97.0))]
    role_cpu = {n: {"draft": 1.0, "target": 2.0, "coordinator": 0.5 if n.startswith("off") else 0.6}
                for n in stack_names(2)}
    args = argparse.Namespace(sample=1.0, exporter="otlp", gamma_policy="static:4", stacks=2, block=1)
    report(args, served, dict.fromkeys(stack_names(2), 384), role_cpu, 128, "test")
    out = capsys.readouterr().out
    assert "ratio on/off: 0.950 (medians)" in out
    assert "mean 0.950 ± 0.000" in out
    assert "the off stacks' medians differ by 2.0%" in out
    assert "coordinator 1.30 -> 1.56" in out


def test_the_default_layout_gives_each_service_its_own_core_where_there_are_two(monkeypatch):
    from specdec.tools import bench_tracing

    monkeypatch.setattr(bench_tracing.os, "sched_getaffinity", lambda pid: {0, 1})
    assert bench_tracing.cpus_spec(None) == "per-service"
    assert bench_tracing.cpus_spec("last") == "last"
    monkeypatch.setattr(bench_tracing.os, "sched_getaffinity", lambda pid: {3})
    assert bench_tracing.cpus_spec(None) == "last"
