"""The tracing bench's serving order and report (the bench itself is run by hand)."""

from __future__ import annotations

import argparse
import collections
import pathlib

from specdec.tools.bench_tracing import _mode, mode_of, report, serving_order, stack_names, traced_env


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


def test_report_compares_each_traced_mode_per_round_and_shows_the_noise_floor(capsys):
    modes = ("off", "on", "on@0.05")
    rates = {"off-1": 100.0, "on-1": 95.0, "on@0.05-1": 99.0, "off-2": 102.0, "on-2": 97.0, "on@0.05-2": 101.0}
    served = [(r, n, rates[n]) for r in range(3) for n in stack_names(2, modes)]
    role_cpu = {n: {"draft": 1.0, "target": 2.0, "coordinator": {"off": 0.5, "on": 0.6, "on@0.05": 0.52}[_mode(n)]}
                for n in stack_names(2, modes)}
    args = argparse.Namespace(exporter="otlp", gamma_policy="static:4", stacks=2, block=1)
    report(args, served, dict.fromkeys(stack_names(2, modes), 384), role_cpu, 128, "test")
    out = capsys.readouterr().out
    assert "ratio on/off: 0.950 (medians)" in out
    assert "ratio on@0.05/off: 0.990 (medians)" in out
    assert "mean 0.950 ± 0.000" in out
    assert "the off stacks' medians differ by 2.0%" in out
    assert "coordinator 1.30 -> 1.56" in out and "coordinator 1.30 -> 1.35" in out


def test_one_traced_mode_per_sampling_ratio():
    assert [mode_of(r) for r in (1.0, 0.05)] == ["on", "on@0.05"]
    env = traced_env(0.05, "otlp", "http://127.0.0.1:4317", pathlib.Path("spans.jsonl"))
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and env["OTEL_TRACES_SAMPLER_ARG"] == "0.05"
    assert "OTEL_TRACES_SAMPLER" not in traced_env(1.0, "otlp", "http://127.0.0.1:4317", pathlib.Path("s"))


def test_the_default_layout_gives_each_service_its_own_core_where_there_are_two(monkeypatch):
    from specdec.tools import bench_tracing

    monkeypatch.setattr(bench_tracing.os, "sched_getaffinity", lambda pid: {0, 1})
    assert bench_tracing.cpus_spec(None) == "per-service"
    assert bench_tracing.cpus_spec("last") == "last"
    monkeypatch.setattr(bench_tracing.os, "sched_getaffinity", lambda pid: {3})
    assert bench_tracing.cpus_spec(None) == "last"
