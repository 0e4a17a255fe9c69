"""The concurrency matrix of ``specdec bench``: many sessions at once.

For N concurrent streaming sessions (``specdec loadtest``'s client), through
the services in the bench's layout, with batching on (the default) and off
(``--max-batch 1`` on both model services), target-only (static:0), static:4
and adaptive; and three **ceilings** from target passes timed in the same run, in
this process on the target's core while the services idle:

* decode ceiling: 1000 × N ÷ the ms of one batched pass over N sessions × 1 new
  token (each with a 128-token context): target-only decoding with no prompts;
* ceiling with prompts: N × T tokens ÷ (the prompts' batched prefill + T such
  passes), T the tokens each request generates: what the load test asks for,
  since every request brings a new 128-token prompt;
* γ = 4 ceiling: 1000 × N × 5 ÷ the ms of one pass over N sessions × 5 new
  tokens, what speculation could reach with every draft accepted and drafting
  free. Where it is not above the decode ceiling, the target's passes cost per
  token, and speculation cannot pay at that load.
"""

from __future__ import annotations

import dataclasses
import os
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
    wall_s: float = 0.0
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)  # per process, and the load client
    target_pass_sessions: float = 0.0  # mean sessions in the target's forward passes


@dataclasses.dataclass
class Stack:
    """One coordinator, draft and target: where to call it and what to watch."""

    batching: bool
    address: str
    pids: dict[str, int]
    target_metrics: str  # the target's /metrics URL


def start_stacks(procs: Processes, target_dir: pathlib.Path, draft_dir: pathlib.Path,
                 devices: dict[str, str]) -> dict[bool, Stack]:
    """A batching stack and a one-at-a-time stack (--max-batch 1 on both model
    services), keyed by batching."""
    from specdec.serving.server import free_port

    stacks = {}
    for batching in (True, False):
        extra = [] if batching else ["--max-batch", "1"]
        name = "batched" if batching else "max-batch-1"
        ports = {role: free_port() for role in ("draft", "target", "coordinator", "metrics")}
        commands = {
            "draft": (["draft-service", "--model", str(draft_dir), "--device", devices["draft"],
                       "--port", str(ports["draft"]), *extra], DRAFT_CORE),
            "target": (["target-service", "--model", str(target_dir), "--device", devices["target"],
                        "--port", str(ports["target"]), "--metrics-port", str(ports["metrics"]), *extra],
                       TARGET_CORE),
            "coordinator": (["coordinator", "--draft", f"127.0.0.1:{ports['draft']}", "--target",
                             f"127.0.0.1:{ports['target']}", "--port", str(ports["coordinator"]),
                             "--max-streams", "256", "--http-port", "0"], COORDINATOR_CORE),
        }
        pids = {}
        for role, (args, core) in commands.items():
            procs.start(f"concurrency-{role}-{name}", args, core=core)
            pids[role] = procs.children[-1].pid
        stacks[batching] = Stack(batching, f"127.0.0.1:{ports['coordinator']}", pids,
                                 f"http://127.0.0.1:{ports['metrics']}/metrics")
    return stacks


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux /proc), all threads."""
    if pid == os.getpid():
        return time.process_time()
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pass_sessions(metrics_url: str) -> tuple[float, float]:
    """(sessions summed over passes, passes) from the target's batch-size histogram."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    found = {s.name: s.value for f in text_string_to_metric_families(text) if f.name == "specdec_batch_sequences"
             for s in f.samples if s.name.endswith(("_sum", "_count"))}
    return found.get("specdec_batch_sequences_sum", 0.0), found.get("specdec_batch_sequences_count", 0.0)


def time_passes(target_dir: pathlib.Path, device: str, sessions: int, context: int = 128,
                repeats: int = 15) -> dict[str, float]:
    """Milliseconds of the target's batched passes for N sessions: their prompts'
    prefill (``prompts_ms``, in passes of at most 2048 tokens, the services'
    default), one decoding step, N × 1 new token (``decode_ms``), and one γ = 4
    verification, N × 5 new tokens (``verify_ms``; medians)."""
    from specdec.models.runner import ModelRunner, Pass

    runner = ModelRunner(target_dir, device, lean=True)
    seqs = [runner.new_sequence() for _ in range(sessions)]
    for i, seq in enumerate(seqs):
        seq.tokens.extend((i * 7 + j) % runner.vocab_size for j in range(context))
    per_pass = max(1, 2048 // context)
    start = time.perf_counter()
    for first in range(0, sessions, per_pass):
        runner.run_passes([Pass(seq) for seq in seqs[first:first + per_pass]])
    _synchronize(runner.device)
    times = {"prompts_ms": (time.perf_counter() - start) * 1000}
    for name, new in (("decode_ms", 1), ("verify_ms", 5)):
        samples = []
        for r in range(repeats + 2):
            for seq in seqs:  # new tokens each, then rolled back: every pass sees a 128-token context
                runner.rollback(seq, context)
                seq.tokens.extend((r + k) % runner.vocab_size for k in range(new))
            start = time.perf_counter()
            runner.run_passes([Pass(seq, last=new) for seq in seqs])
            _synchronize(runner.device)
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples[2:]) * 1000
    return times


def ceilings(passes: dict[str, float], sessions: int, new_tokens: int) -> tuple[float, float, float]:
    """Tokens/s from :func:`time_passes`: the decode ceiling, the ceiling with
    prompts, and γ = 4's ceiling with every draft accepted (5 tokens per
    verification, the draft free; the prompts not counted)."""
    decode = 1000 * sessions / passes["decode_ms"]
    with_prompts = 1000 * sessions * new_tokens / (passes["prompts_ms"] + new_tokens * passes["decode_ms"])
    return decode, with_prompts, 1000 * sessions * 5 / passes["verify_ms"]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_matrix(stacks: dict[bool, Stack], prompts: list[list[int]], sessions_list: list[int],
               new_tokens: int, requests_per_session: int = 2) -> list[ConcurrencyRow]:
    """Every (N, batching, policy), greedy, in an order alternating the two stacks."""
    pin(COORDINATOR_CORE)
    rows = []
    for n in sessions_list:
        for policy in POLICIES:
            for batching in (True, False) if n % 2 else (False, True):
                rows.append(run_row(stacks[batching], prompts, n, policy, new_tokens, n * requests_per_session))
                print(f"[concurrency] N={n} {policy} {'batched' if batching else 'max-batch 1'}: "
                      f"{rows[-1].tokens_per_second:.0f} tok/s", flush=True)
    return rows


def run_row(stack: Stack, prompts: list[list[int]], sessions: int, policy: str, new_tokens: int,
            requests: int) -> ConcurrencyRow:
    """One row after a warm-up (a policy's first calls, and adaptive's regime, are
    not measured), with the CPU each process spent and the target's batch sizes."""
    request = {"max_new_tokens": new_tokens, "gamma_policy": policy}
    run_load(stack.address, prompts, sessions=sessions, requests=sessions, duration_s=None,
             request={**request, "max_new_tokens": 8})
    pids = {**stack.pids, "client": os.getpid()}
    cpu = {role: cpu_seconds(pid) for role, pid in pids.items()}
    batched = pass_sessions(stack.target_metrics)
    report, _ = run_load(stack.address, prompts, sessions=sessions, requests=requests, duration_s=None,
                         request=request)
    cpu = {role: cpu_seconds(pid) - cpu[role] for role, pid in pids.items()}
    total, passes = (after - before for after, before in zip(pass_sessions(stack.target_metrics), batched,
                                                              strict=True))
    return ConcurrencyRow(sessions, stack.batching, policy, report.tokens_per_second, report.ttft_p50_s * 1e3,
                          report.itl_p50_s * 1e3, report.requests, sum(report.errors.values()), report.wall_s,
                          cpu, total / passes if passes else 0.0)


def run_concurrency(procs: Processes, target_dir: pathlib.Path, draft_dir: pathlib.Path, devices: dict[str, str],
                    prompts: list[list[int]], sessions_list: list[int], new_tokens: int) -> dict:
    """The whole matrix: stacks started, ceilings timed, every row run; JSON-ready."""
    from specdec.serving.client import Client

    stacks = start_stacks(procs, target_dir, draft_dir, devices)
    for stack in stacks.values():
        with Client(stack.address) as client:
            client.wait_ready(180)
            models_loaded(client, 180)
    pin(TARGET_CORE)  # the services are idle: time the target's passes on its core
    passes = {n: time_passes(target_dir, devices["target"], n) for n in sessions_list}
    rows = run_matrix(stacks, prompts, sessions_list, new_tokens)
    return {"sessions": sessions_list, "new_tokens": new_tokens, "passes": passes,
            "rows": [dataclasses.asdict(r) for r in rows]}


def models_loaded(client, timeout_s: float) -> None:
    """Block until one token comes back through the coordinator: its draft and
    target have loaded their models (a coordinator serves before they have)."""
    from specdec.serving import errors

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.complete(prompt_ids=[1, 2, 3], max_new_tokens=1)
            return
        except errors.Unavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _rows_and_ceilings(concurrency: dict) -> tuple[dict, dict[int, tuple[float, float, float]]]:
    """From run_concurrency's record: {(N, batching, policy): row} and {N: ceilings}."""
    rows = [ConcurrencyRow(**r) for r in concurrency["rows"]]
    by = {(r.sessions, r.batching, r.policy): r for r in rows}
    limits = {int(n): ceilings(p, int(n), concurrency["new_tokens"]) for n, p in concurrency["passes"].items()}
    return by, limits


def format_markdown(concurrency: dict) -> str:
    """Two tables: aggregate tok/s per N (each policy batched and at --max-batch 1,
    and the ceilings), and the ratios the docs quote."""
    by, limits = _rows_and_ceilings(concurrency)
    ns = sorted(limits)
    tps = ["| sessions | decode ceiling | ceiling with prompts | γ = 4 ceiling, all accepted | "
           + " | ".join(f"{p} batched | {p} max-batch 1" for p in POLICIES) + " |",
           "|---" * (4 + 2 * len(POLICIES)) + "|"]
    ratios = ["| sessions | batched ÷ max-batch 1 (static:0) | adaptive ÷ static:0 | adaptive ÷ best of static:0, "
              "static:4 | static:0 ÷ decode ceiling | static:0 ÷ ceiling with prompts | TTFT p50 ms | ITL p50 ms "
              "| sessions per target pass | target's core busy (target's part) |",
              "|---" * 10 + "|"]
    for n in ns:
        decode, with_prompts, speculative = limits[n]
        tps.append(f"| {n} | {decode:.0f} | {with_prompts:.0f} | {speculative:.0f} | " + " | ".join(
            f"{by[n, b, p].tokens_per_second:.0f}" for p in POLICIES for b in (True, False)) + " |")
        base, adaptive = by[n, True, "static:0"].tokens_per_second, by[n, True, "adaptive"]
        best = max(base, by[n, True, "static:4"].tokens_per_second)
        cells = [base / by[n, False, "static:0"].tokens_per_second, adaptive.tokens_per_second / base,
                 adaptive.tokens_per_second / best, base / decode, base / with_prompts]
        ratios.append(f"| {n} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {adaptive.ttft_p50_ms:.0f} "
                      f"| {adaptive.itl_p50_ms:.1f} | {core_use(by[n, True, 'static:0'])} |")
    note = ("Ratios are batched unless named; TTFT and ITL are adaptive's; sessions per pass and the core's use "
            "are static:0's (the coordinator and the load client share the target's core).")
    return "\n".join([*tps, "", *ratios, "", note])


def core_use(row: ConcurrencyRow) -> str:
    """Mean sessions per target pass, and the share of wall time the target's core
    was busy (target + coordinator + client) with the target's own share."""
    if not row.wall_s or not row.cpu_s:
        return "– | –"
    shared = sum(row.cpu_s.get(role, 0.0) for role in ("target", "coordinator", "client"))
    return f"{row.target_pass_sessions:.1f} | {shared / row.wall_s:.0%} ({row.cpu_s['target'] / row.wall_s:.0%})"


def plot(concurrency: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by, limits = _rows_and_ceilings(concurrency)
    ns = sorted(limits)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [limits[n][0] for n in ns], "k--", label="decode ceiling (target passes, 1 token per session)")
    ax.plot(ns, [limits[n][1] for n in ns], "k:", label="ceiling with prompts")
    for policy in POLICIES:
        for batching, style in ((True, "-o"), (False, ":x")):
            values = [by[n, batching, policy].tokens_per_second for n in ns]
            ax.plot(ns, values, style, label=f"{policy}{'' if batching else ', --max-batch 1'}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("aggregate tokens/s")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
