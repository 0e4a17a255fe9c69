"""``specdec bench-tracing``: tokens/s with tracing exporting vs tracing off, in one run.

Two identical stacks (draft, target, coordinator: six processes) start side by
side from the same models: one with nothing configured, one exporting every span
both over OTLP/gRPC (to a receiver in this process) and to a JSON-lines trace
file, with the SDK's default batching. The same greedy request then goes to
each, in blocks of ``--block`` requests in ABBA order (off, on, on, off, ...), so
that drift (thermal, other load) hits both alike and the traced stack's batch
exports (every 512 spans or 5 s) land inside its own blocks; the medians of
client-observed tokens/s are compared. Because wall-clock rates on a shared
machine swing with everyone else's load, it also reports tokens per CPU-second
of each stack's three processes (from /proc), which other load barely moves.

Processes are pinned (``--cpus``), because on a shared machine unpinned stacks
land on different cores and two *identical* stacks then differ by up to 2x;
pinned, they agree within a few %. Two layouts:

* one core (``last``, the default): everything -- both stacks, the receiver,
  this client -- on the same CPU. The most unfavourable to tracing: every
  exporter thread and the OTLP receiver (which a real deployment runs elsewhere)
  take time from the very core the models compute on.
* ``per-service``: as in a deployment, each service has its own core -- in each
  stack the draft on the first CPU, the target on the last -- and the
  coordinator, the receiver and this client share the target's (the
  coordinator waits while the target computes). Only one stack serves at a
  time, so both see the same layout.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import statistics
import tempfile
import time

TRACING_ENV = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
               "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_SDK_DISABLED",
               "SPECDEC_TRACE_FILE", "OTEL_BSP_SCHEDULE_DELAY", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "OTEL_TRACES_SAMPLER",
               "OTEL_TRACES_SAMPLER_ARG")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.cli.serve import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--prompt", default="def fibonacci(n):", help="prompt text (default: a code prompt)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated prompt ids instead (models without tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--requests", type=int, default=16, help="requests per stack, after warm-up (default 16)")
    p.add_argument("--block", type=int, default=4, help="consecutive requests per stack (default 4)")
    p.add_argument("--gamma-policy", default="static:4", help="gamma policy of every request (default static:4)")
    p.add_argument("--exporter", choices=["both", "otlp", "file", "none"], default="otlp",
                   help="what the traced stack exports to: OTLP/gRPC, the trace file, or both (default otlp); "
                        "'none' configures nothing: an A/A run that shows the bench's own noise")
    p.add_argument("--sample", type=float, default=1.0, metavar="RATIO",
                   help="fraction of requests the traced stack records (OTEL_TRACES_SAMPLER=parentbased_traceidratio; "
                        "default 1.0: every request)")
    p.add_argument("--workdir", default=None, metavar="DIR", help="logs and the trace file (default: a temp dir)")
    p.add_argument("--cpus", default="last", metavar="LIST",
                   help="CPUs every process is pinned to: comma-separated ids, 'last' (the highest-numbered "
                        "CPU; default), 'per-service' (draft on the first CPU; target, coordinator, receiver "
                        "and client on the last) or 'all' (no pinning)")


def pin(spec: str) -> set[int] | None:
    """Pin this process (and so every child it starts) to the CPUs ``spec`` names
    (with ``per-service``, the target's; see :func:`service_cpus` for the rest)."""
    available = sorted(os.sched_getaffinity(0))
    if spec == "all":
        return None
    if spec == "per-service":
        spec = "last"
    try:
        cpus = {available[-1]} if spec == "last" else {int(x) for x in spec.split(",") if x.strip()}
    except ValueError:
        raise ValueError(f"--cpus {spec!r}: give comma-separated CPU ids, 'last' or 'all'") from None
    if not cpus or not cpus <= set(available):
        raise ValueError(f"--cpus {spec!r}: this process may use CPUs {available}")
    os.sched_setaffinity(0, cpus)
    return cpus


def service_cpus(spec: str) -> dict[str, set[int]] | None:
    """``per-service``: draft on the first CPU, target and coordinator on the last."""
    if spec != "per-service":
        return None
    available = sorted(os.sched_getaffinity(0))
    if len(available) < 2:
        raise ValueError("--cpus per-service needs at least 2 CPUs")
    return {"draft": {available[0]}, "target": {available[-1]}, "coordinator": {available[-1]}}


@contextlib.contextmanager
def _environ(set_: dict[str, str], unset: tuple[str, ...] = TRACING_ENV):
    """This process's environment, changed while a stack's processes start."""
    saved = dict(os.environ)
    for key in unset:
        os.environ.pop(key, None)
    os.environ.update(set_)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _start(name: str, env: dict[str, str], args, target, draft, workdir: pathlib.Path, cpus):
    from specdec.cli.serve import Stack
    from specdec.server import free_port

    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    with _environ(env):
        return Stack(target=target, draft=draft, ports=ports, tokenizer=args.tokenizer,
                     devices={"draft": args.device_draft, "target": args.device_target},
                     log=workdir / f"{name}.log", cpus=cpus)


def _abba(requests: int, block: int) -> list[str]:
    """Which stack serves each request: blocks of ``block`` in the order off, on,
    on, off, off, on, ... (``requests`` per stack)."""
    order, n = [], 0
    while n < requests:
        size = min(block, requests - n)
        pair = ("off", "on") if (n // block) % 2 == 0 else ("on", "off")
        for name in pair:
            order += [name] * size
        n += size
    return order


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process so far (Linux /proc; None elsewhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _one(client, request: dict) -> tuple[float, int]:
    """Client-observed tokens/s of one request, and the tokens generated."""
    start = time.perf_counter()
    out = client.complete(**request)
    elapsed = time.perf_counter() - start
    return out.stats.generated_tokens / elapsed, out.stats.generated_tokens


def run(args: argparse.Namespace) -> int:
    from specdec.cli.generate import parse_prompt_ids
    from specdec.cli.serve import model_dirs
    from specdec.client import Client
    from specdec.otlp_receiver import OtlpReceiver

    target, draft = model_dirs(args)
    roles = service_cpus(args.cpus)
    cpus = pin(args.cpus)
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="specdec-bench-tracing-"))
    workdir.mkdir(parents=True, exist_ok=True)
    trace_file = workdir / "spans.jsonl"
    trace_file.unlink(missing_ok=True)
    request = dict(max_new_tokens=args.max_new_tokens, gamma_policy=args.gamma_policy, temperature=0.0)
    if args.prompt_ids:
        request["prompt_ids"] = parse_prompt_ids(args.prompt_ids)
    else:
        request["prompt"] = args.prompt

    receiver = OtlpReceiver().start()
    traced_env = {}
    if not 0.0 <= args.sample <= 1.0:
        raise ValueError(f"--sample must be in [0, 1], got {args.sample}")
    if args.sample < 1.0:
        traced_env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=str(args.sample))
    if args.exporter in ("both", "otlp"):
        traced_env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                          OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    if args.exporter in ("both", "file"):
        traced_env["SPECDEC_TRACE_FILE"] = str(trace_file)
    stacks = {}
    try:
        stacks["off"] = _start("off", {}, args, target, draft, workdir, roles)
        stacks["on"] = _start("on", traced_env, args, target, draft, workdir, roles)
        for stack in stacks.values():
            stack.wait_serving()
        clients = {name: Client(s.address("coordinator")) for name, s in stacks.items()}
        for name in ("off", "on", "off", "on"):  # warm-up: first-call costs, caches
            _one(clients[name], request)
        rates: dict[str, list[float]] = {"off": [], "on": []}
        generated = {"off": 0, "on": 0}
        pids = {name: {role: p.pid for role, p in s.procs.items()} for name, s in stacks.items()}
        cpu0 = {name: {role: _cpu_seconds(pid) for role, pid in pids[name].items()} for name in stacks}
        tokens = 0
        for name in _abba(args.requests, args.block):
            rate, tokens = _one(clients[name], request)
            rates[name].append(rate)
            generated[name] += tokens
        time.sleep(6)  # the traced stack's last batch (every 5 s) is exported and billed
        # CPU seconds each process spent on the measured requests (None: no /proc)
        role_cpu = {name: {role: None if c is None else _cpu_seconds(pids[name][role]) - c
                           for role, c in cpu0[name].items()} for name in stacks}
        cpu = {name: None if None in r.values() else sum(r.values()) for name, r in role_cpu.items()}
        for client in clients.values():
            client.close()
    finally:
        for stack in stacks.values():
            stack.stop()
        receiver.stop()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    block_ratios = [statistics.mean(rates["on"][i:i + args.block]) / statistics.mean(rates["off"][i:i + args.block])
                    for i in range(0, len(rates["on"]), args.block)]
    lines = trace_file.read_text().count("\n") if trace_file.is_file() else 0
    print(f"tracing overhead: {args.requests} requests per stack of {tokens} tokens each ({args.gamma_policy}, "
          f"greedy), ABBA blocks of {args.block}; models {target} / {draft}; "
          f"{_layout(roles, cpus)}")
    print(f"  tracing off                        {off:8.1f} tok/s  (median; min {min(rates['off']):.1f}, "
          f"max {max(rates['off']):.1f})")
    sampled = "" if args.sample >= 1.0 else f", {args.sample:g} sampled"
    print(f"  tracing on ({args.exporter}{sampled}) exporting     {on:8.1f} tok/s  (median; min {min(rates['on']):.1f}, "
          f"max {max(rates['on']):.1f})")
    print(f"  ratio on/off: {on / off:.3f} (medians); per block pair: "
          + " ".join(f"{r:.3f}" for r in block_ratios))
    if cpu["off"] and cpu["on"]:
        per_cpu = {name: generated[name] / cpu[name] for name in cpu}
        print(f"  CPU of the three services: {per_cpu['off']:.1f} tokens per CPU-second off, {per_cpu['on']:.1f} on: "
              f"ratio {per_cpu['on'] / per_cpu['off']:.3f} (exporters' threads included; not the receiver)")
        print("  CPU ms per token, off -> on: " + ", ".join(
            f"{r} {1e3 * role_cpu['off'][r] / generated['off']:.2f} -> {1e3 * role_cpu['on'][r] / generated['on']:.2f}"
            for r in role_cpu["off"]))
    print(f"  exported: {len(receiver.spans)} spans over OTLP in {receiver.exports} batches, "
          f"{lines} spans to {trace_file}")
    return 0


def _layout(roles: dict[str, set[int]] | None, cpus: set[int] | None) -> str:
    if roles:
        return "pinned per service: " + ", ".join(f"{r} CPU {min(c)}" for r, c in roles.items()) + \
            ", receiver and client with the target"
    return "everything on CPUs " + ",".join(map(str, sorted(cpus))) if cpus else "not pinned"
