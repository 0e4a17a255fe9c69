"""The concurrency matrix of ``specdec bench``: many sessions at once.

For N concurrent streaming sessions (``specdec loadtest``'s client), through
the services in the bench's layout, with batching on (the default) and off
(``--max-batch 1`` on both model services), target-only (static:0), static:4
and adaptive; and a **ceiling** measured in the same run: the most tokens/s
target-only decoding of N sessions could reach on this target, 1000 × N ÷ the
milliseconds of one batched target pass over N sessions × 1 new token (each
with a 128-token context), timed in this process on the target's core.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import time

import torch

from specdec.tools.bench import COORDINATOR_CORE, DRAFT_CORE, TARGET_CORE, Processes, pin
from specdec.tools.loadtest import run_load

POLICIES = ("static:0", "static:4", "adaptive")


@dataclasses.dataclass
class ConcurrencyRow:
    sessions: int
    batching: bool
    policy: str
    tokens_per_second: float
    ttft_p50_ms: float
    itl_p50_ms: float
    requests: int
    errors: int


def start_stacks(procs: Processes, target_dir: pathlib.Path, draft_dir: pathlib.Path,
                 devices: dict[str, str]) -> dict[bool, str]:
    """A batching stack and a one-at-a-time stack (--max-batch 1 on both model
    services); returns {batching: coordinator address}."""
    from specdec.serving.server import free_port

    addresses = {}
    for batching in (True, False):
        extra = [] if batching else ["--max-batch", "1"]
        name = "batched" if batching else "max-batch-1"
        ports = {role: free_port() for role in ("draft", "target", "coordinator")}
        procs.start(f"concurrency-draft-{name}", ["draft-service", "--model", str(draft_dir), "--device",
                                                  devices["draft"], "--port", str(ports["draft"]), *extra],
                    core=DRAFT_CORE)
        procs.start(f"concurrency-target-{name}", ["target-service", "--model", str(target_dir), "--device",
                                                   devices["target"], "--port", str(ports["target"]), *extra],
                    core=TARGET_CORE)
        procs.start(f"concurrency-coordinator-{name}", [
            "coordinator", "--draft", f"127.0.0.1:{ports['draft']}", "--target", f"127.0.0.1:{ports['target']}",
            "--port", str(ports["coordinator"]), "--tokenizer", str(target_dir), "--max-workers", "256"],
            core=COORDINATOR_CORE)
        addresses[batching] = f"127.0.0.1:{ports['coordinator']}"
    return addresses


def ceiling(target_dir: pathlib.Path, device: str, sessions: int, context: int = 128, repeats: int = 15) -> float:
    """1000 × N ÷ ms of one batched target pass over N sessions × 1 new token."""
    from specdec.models.runner import ModelRunner, Pass

    runner = ModelRunner(target_dir, device, lean=True)
    seqs = []
    for i in range(sessions):
        seq = runner.new_sequence()
        seq.tokens.extend((i * 7 + j) % runner.vocab_size for j in range(context))
        runner.logits(seq)
        seqs.append(seq)
    times = []
    for r in range(repeats + 2):
        for seq in seqs:  # one new token each, as a decoding step
            seq.tokens.append(r % runner.vocab_size)
        start = time.perf_counter()
        runner.run_passes([Pass(seq) for seq in seqs])
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        times.append(time.perf_counter() - start)
    return 1000 * sessions / (statistics.median(times[2:]) * 1000)


def run_matrix(coordinators: dict[bool, str], prompts: list[list[int]], sessions_list: list[int],
               new_tokens: int, requests_per_session: int = 2) -> list[ConcurrencyRow]:
    """Every (N, batching, policy), greedy, in an order alternating the two stacks."""
    pin(COORDINATOR_CORE)
    rows = []
    for n in sessions_list:
        for policy in POLICIES:
            for batching in (True, False) if n % 2 else (False, True):
                request = {"max_new_tokens": new_tokens, "gamma_policy": policy}
                warm = run_load(coordinators[batching], prompts, sessions=n, requests=n, duration_s=None,
                                request={**request, "max_new_tokens": 8})
                del warm  # a policy's first calls, and adaptive's regime, are not measured
                report = run_load(coordinators[batching], prompts, sessions=n, requests=n * requests_per_session,
                                  duration_s=None, request=request)
                rows.append(ConcurrencyRow(n, batching, policy, report.tokens_per_second, report.ttft_p50_s * 1e3,
                                           report.itl_p50_s * 1e3, report.requests, sum(report.errors.values())))
                print(f"[concurrency] N={n} {policy} {'batched' if batching else 'max-batch 1'}: "
                      f"{report.tokens_per_second:.0f} tok/s", flush=True)
    return rows


def run_concurrency(procs: Processes, target_dir: pathlib.Path, draft_dir: pathlib.Path, devices: dict[str, str],
                    prompts: list[list[int]], sessions_list: list[int], new_tokens: int) -> dict:
    """The whole matrix: stacks started, ceilings timed, every row run; JSON-ready."""
    from specdec.serving.client import Client

    coordinators = start_stacks(procs, target_dir, draft_dir, devices)
    for address in coordinators.values():
        with Client(address) as client:
            client.wait_ready(180)
    pin(TARGET_CORE)  # the services are idle: time the target's passes on its core
    ceilings = {n: ceiling(target_dir, devices["target"], n) for n in sessions_list}
    rows = run_matrix(coordinators, prompts, sessions_list, new_tokens)
    return {"sessions": sessions_list, "new_tokens": new_tokens, "ceilings": ceilings,
            "rows": [dataclasses.asdict(r) for r in rows]}


def format_markdown(rows: list[ConcurrencyRow], ceilings: dict[int, float]) -> str:
    """Aggregate tok/s per N: each policy batched and at --max-batch 1, and the ratios the docs quote."""
    by = {(r.sessions, r.batching, r.policy): r for r in rows}
    lines = ["| sessions | ceiling | " + " | ".join(f"{p} batched | {p} max-batch 1" for p in POLICIES)
             + " | batched ÷ max-batch 1 (static:0) | adaptive ÷ static:0 (batched) | static:0 batched ÷ ceiling "
             "| TTFT p50 ms (adaptive, batched) | ITL p50 ms (adaptive, batched) |",
             "|---" * (2 + 2 * len(POLICIES) + 5) + "|"]
    for n in sorted({r.sessions for r in rows}):
        cells = [str(n), f"{ceilings[n]:.0f}"]
        cells += [f"{by[n, b, p].tokens_per_second:.0f}" for p in POLICIES for b in (True, False)]
        base_b, base_1 = by[n, True, "static:0"].tokens_per_second, by[n, False, "static:0"].tokens_per_second
        adaptive = by[n, True, "adaptive"]
        cells += [f"{base_b / base_1:.2f}", f"{adaptive.tokens_per_second / base_b:.2f}",
                  f"{base_b / ceilings[n]:.2f}", f"{adaptive.ttft_p50_ms:.0f}", f"{adaptive.itl_p50_ms:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[ConcurrencyRow], ceilings: dict[int, float], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ns = sorted(ceilings)
    ax.plot(ns, [ceilings[n] for n in ns], "k--", label="ceiling (target passes, 1 token per session)")
    for policy in POLICIES:
        for batching, style in ((True, "-o"), (False, ":x")):
            values = [next(r.tokens_per_second for r in rows if (r.sessions, r.batching, r.policy)
                           == (n, batching, policy)) for n in ns]
            ax.plot(ns, values, style, label=f"{policy}{'' if batching else ', --max-batch 1'}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
