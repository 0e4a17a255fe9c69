"""The concurrency matrix's arithmetic: pass timings become the two ceilings,
and the tables quote the ratios of the rows they were given."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from specdec.tools.bench_concurrency import (
    POLICIES,
    ConcurrencyRow,
    ceilings,
    cpu_seconds,
    format_markdown,
    time_passes,
)


def test_ceilings_from_pass_timings():
    passes = {"prompts_ms": 200.0, "decode_ms": 40.0, "verify_ms": 100.0}
    decode, with_prompts, speculative = ceilings(passes, sessions=16, new_tokens=10)
    assert decode == pytest.approx(400.0)  # 16 tokens per 40 ms pass
    assert with_prompts == pytest.approx(16 * 10 / 0.6)  # 160 tokens in 200 + 10 × 40 ms
    assert speculative == pytest.approx(800.0)  # 16 × 5 tokens per 100 ms pass


def test_a_process_cpu_time_is_read():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                             "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while cpu_seconds(busy.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.25 <= cpu_seconds(busy.pid) < 5
    finally:
        busy.kill()
    assert cpu_seconds(os.getpid()) > 0


def test_the_passes_are_timed_on_a_real_model(tiny_pair):
    target_dir = tiny_pair[0]
    passes = time_passes(target_dir, "cpu", sessions=3, context=8, repeats=2)
    assert min(passes.values()) > 0 and set(passes) == {"prompts_ms", "decode_ms", "verify_ms"}


def test_the_tables_quote_the_rows():
    tps = {"static:0": (300, 100), "static:4": (330, 150), "adaptive": (320, 160)}
    rows = [ConcurrencyRow(16, batching, policy, tps[policy][0 if batching else 1], 100.0, 20.0, 32, 0,
                           wall_s=10.0, cpu_s={"target": 7.0, "coordinator": 2.0, "client": 0.5, "draft": 0.1},
                           target_pass_sessions=8.25)
            for policy in POLICIES for batching in (True, False)]
    record = {"new_tokens": 10, "passes": {"16": {"prompts_ms": 200.0, "decode_ms": 40.0, "verify_ms": 100.0}},
              "rows": [dataclasses.asdict(r) for r in rows]}
    tables = format_markdown(record)
    assert "| 16 | 400 | 267 | 800 | 300 | 100 | 330 | 150 | 320 | 160 |" in tables
    # batched ÷ max-batch 1, adaptive ÷ static:0, adaptive ÷ static:4 (the better), ÷ the two ceilings;
    # the target's core: target + coordinator + client, not the draft
    assert "| 16 | 3.00 | 1.07 | 0.97 | 0.75 | 1.12 | 100 | 20.0 | 8.2 | 95% (70%) |" in tables
