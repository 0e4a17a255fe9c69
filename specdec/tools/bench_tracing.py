"""``specdec bench-tracing``: tokens/s with tracing exporting vs tracing off, in one run.

Identical stacks (draft, target, coordinator: three processes each) start side
by side from the same models: ``--stacks`` with nothing configured ("off") and,
for each sampling ratio of ``--sample`` (default: every request, and the
recommended production setting ``parentbased_traceidratio`` 0.05), as many
exporting over OTLP/gRPC (to a receiver in this process) and/or to a JSON-lines
trace file, with the SDK's default batching ("on", "on@0.05"). The same
greedy request then goes to each stack in turn, in blocks of ``--block``
requests, the order reversed every other round (off-1, on-1, on@0.05-1, off-2,
..., then back), so that drift (thermal, other load) hits every mode alike and
the traced stacks' batch exports (every 512 spans or 5 s) land inside their own
blocks; the medians of client-observed tokens/s are compared.
Two stacks per mode, because two *identical* stacks on a shared machine differ
by a few %: the bench prints how far the stacks of one mode differ (the noise
floor of the comparison) next to the ratio. Because wall-clock rates swing with
everyone else's load, it also reports tokens per CPU-second of each mode's
processes (from /proc), which other load moves less.

Processes are pinned (``--cpus``), because on a shared machine unpinned stacks
land on different cores and two *identical* stacks then differ by up to 2x;
pinned, they agree within a few %. Two layouts:

* ``per-service`` (the default where there are two CPUs): as in a deployment,
  each service has its own core -- in each stack the draft on the first CPU,
  the target on the last -- and the coordinator, the receiver and this client
  share the target's (the coordinator waits while the target computes). Only
  one stack serves at a time, so both see the same layout.
* one core (``last``; the default on a single CPU): everything -- both stacks,
  the receiver, this client -- on the same CPU. The most unfavourable to
  tracing: no tracing work is off a round's path there, and every exporter
  thread and the OTLP receiver (which a real deployment runs elsewhere) take
  time from the very core the models compute on.
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
RECOMMENDED_RATIO = 0.05  # docs/observability.md: parent-based ratio sampling in production


def _ratios(text: str) -> list[float]:
    try:
        ratios = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers in (0, 1]") from None
    if not ratios or not all(0.0 < r <= 1.0 for r in ratios):
        raise argparse.ArgumentTypeError(f"{text!r}: every ratio must be in (0, 1]")
    return ratios


def mode_of(ratio: float) -> str:
    """The name of the traced mode recording ``ratio`` of the requests."""
    return "on" if ratio >= 1.0 else f"on@{ratio:g}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specdec.cli.serve import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--prompt", default="def fibonacci(n):", help="prompt text (default: a code prompt)")
    p.add_argument("--prompt-ids", default=None, help="comma-separated prompt ids instead (models without tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per request (default 128)")
    p.add_argument("--requests", type=int, default=24, help="requests per mode, after warm-up (default 24)")
    p.add_argument("--block", type=int, default=2, help="consecutive requests per stack (default 2)")
    p.add_argument("--stacks", type=int, default=2, metavar="N",
                   help="stacks per mode (default 2: the two of a mode show the bench's own noise)")
    p.add_argument("--gamma-policy", default="static:4", help="gamma policy of every request (default static:4)")
    p.add_argument("--exporter", choices=["both", "otlp", "file", "none"], default="otlp",
                   help="what the traced stack exports to: OTLP/gRPC, the trace file, or both (default otlp); "
                        "'none' configures nothing: an A/A run that shows the bench's own noise")
    p.add_argument("--sample", type=_ratios, default=[1.0, RECOMMENDED_RATIO], metavar="RATIOS",
                   help="comma-separated fractions of requests the traced stacks record, one traced mode each "
                        "(OTEL_TRACES_SAMPLER=parentbased_traceidratio below 1; default "
                        f"1,{RECOMMENDED_RATIO:g}: every request, and the recommended production ratio)")
    p.add_argument("--workdir", default=None, metavar="DIR", help="logs and the trace file (default: a temp dir)")
    p.add_argument("--cpus", default=None, metavar="LIST",
                   help="CPUs every process is pinned to: 'per-service' (draft on the first CPU; target, "
                        "coordinator, receiver and client on the last; the default with 2 or more CPUs), 'last' "
                        "(everything on the highest-numbered CPU; the default with one), comma-separated ids "
                        "or 'all' (no pinning)")


def cpus_spec(spec: str | None) -> str:
    """``--cpus`` as given, or its default: each service on its own core, as
    deployed, where there are two cores."""
    if spec:
        return spec
    return "per-service" if len(os.sched_getaffinity(0)) >= 2 else "last"


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
    from specdec.serving.server import free_port

    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    with _environ(env):
        return Stack(target=target, draft=draft, ports=ports, tokenizer=args.tokenizer,
                     devices={"draft": args.device_draft, "target": args.device_target},
                     log=workdir / f"{name}.log", cpus=cpus)


def stack_names(per_mode: int, modes: tuple[str, ...] = ("off", "on")) -> list[str]:
    """off-1, on-1, off-2, on-2, ..."""
    return [f"{mode}-{i}" for i in range(1, per_mode + 1) for mode in modes]


def traced_env(ratio: float, exporter: str, endpoint: str, trace_file: pathlib.Path) -> dict[str, str]:
    """The environment of a stack tracing ``ratio`` of the requests."""
    env = {}
    if ratio < 1.0:
        env.update(OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG=str(ratio))
    if exporter in ("both", "otlp"):
        env.update(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                   OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    if exporter in ("both", "file"):
        env["SPECDEC_TRACE_FILE"] = str(trace_file)
    return env


def serving_order(names: list[str], requests: int, block: int) -> list[tuple[int, str]]:
    """Which stack serves each request, as (round, stack): in each round every
    stack serves ``block`` requests in turn, the order reversed every other round
    (ABBA), until each has served ``requests``."""
    order, n, rounds = [], 0, 0
    while n < requests:
        size = min(block, requests - n)
        for name in (names if rounds % 2 == 0 else names[::-1]):
            order += [(rounds, name)] * size
        n, rounds = n + size, rounds + 1
    return order


def cpu_seconds(stat_path: str) -> float | None:
    """User + system CPU time so far of the process or thread whose ``stat``
    file this is (Linux /proc; None elsewhere)."""
    try:
        with open(stat_path) as f:
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
    from specdec.serving.client import Client
    from specdec.tools.otlp_receiver import OtlpReceiver

    target, draft = model_dirs(args)
    args.cpus = cpus_spec(args.cpus)
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

    receiver = OtlpReceiver(keep=False).start()  # counts spans: a collector's work is not the services'
    if args.stacks < 1 or args.block < 1 or args.requests < 1:
        raise ValueError("--stacks, --block and --requests must be at least 1")
    env = {"off": {}} | {mode_of(r): traced_env(r, args.exporter, receiver.endpoint, trace_file) for r in args.sample}
    names = stack_names(args.stacks, tuple(env))
    per_stack = -(-args.requests // args.stacks)
    order = serving_order(names, per_stack, args.block)
    stacks = {}
    try:
        for name in names:
            stacks[name] = _start(name, env[_mode(name)], args, target, draft, workdir, roles)
        for stack in stacks.values():
            stack.wait_serving()
        clients = {name: Client(s.address("coordinator")) for name, s in stacks.items()}
        for name in names + names[::-1]:  # warm-up: first-call costs, caches
            _one(clients[name], request)
        pids = {name: {role: p.pid for role, p in s.procs.items()} for name, s in stacks.items()}
        cpu0 = {name: {role: cpu_seconds(f"/proc/{pid}/stat") for role, pid in pids[name].items()} for name in stacks}
        served: list[tuple[int, str, float]] = []  # (round of the order, stack, tokens/s)
        generated = dict.fromkeys(names, 0)
        tokens = 0
        for round_, name in order:
            rate, tokens = _one(clients[name], request)
            served.append((round_, name, rate))
            generated[name] += tokens
        time.sleep(6)  # the traced stacks' last batches (every 5 s) are exported and billed
        # CPU seconds each process spent on the measured requests (None: no /proc)
        role_cpu = {name: {role: None if c is None else cpu_seconds(f"/proc/{pids[name][role]}/stat") - c
                           for role, c in cpu0[name].items()} for name in stacks}
        for client in clients.values():
            client.close()
    finally:
        for stack in stacks.values():
            stack.stop()
        receiver.stop()
    report(args, served, generated, role_cpu, tokens, f"models {target} / {draft}; {_layout(roles, cpus)}")
    lines = trace_file.read_text().count("\n") if trace_file.is_file() else 0
    print(f"  exported: {receiver.span_count} spans over OTLP in {receiver.exports} batches, "
          f"{lines} spans to {trace_file}")
    return 0


def _mode(name: str) -> str:
    return name.rsplit("-", 1)[0]


def report(args, served: list[tuple[int, str, float]], generated: dict[str, int],
           role_cpu: dict[str, dict[str, float | None]], tokens: int, where: str) -> None:
    """Print the comparison: medians per mode and per stack, each traced mode's
    ratio to "off" (medians, and per round of the serving order with its
    spread), the noise floor, and CPU per token by process."""
    modes = list(dict.fromkeys(_mode(n) for _, n, _ in served))
    rates = {m: [r for _, n, r in served if _mode(n) == m] for m in modes}
    print(f"tracing overhead: {len(rates['off'])} requests per mode of {tokens} tokens each ({args.gamma_policy}, "
          f"greedy) over {args.stacks} stack(s) per mode, blocks of {args.block} in ABBA order; {where}")
    for mode in modes:
        stacks = ", ".join(f"{n} {statistics.median(r for _, s, r in served if s == n):.1f}"
                           for n in dict.fromkeys(n for _, n, _ in served) if _mode(n) == mode)
        label = "tracing off" if mode == "off" else f"{mode} ({args.exporter}) exporting"
        print(f"  {label:34s} {statistics.median(rates[mode]):8.1f} tok/s  (median; min {min(rates[mode]):.1f}, "
              f"max {max(rates[mode]):.1f}; per stack: {stacks})")
    for mode in modes[1:]:
        _print_ratio(mode, served, rates)
    for mode in modes:
        mine = [statistics.median(r for _, s, r in served if s == n) for n in role_cpu if _mode(n) == mode]
        if len(mine) > 1:
            print(f"  noise floor: the {mode} stacks' medians differ by {100 * (max(mine) / min(mine) - 1):.1f}% "
                  "(identical stacks, same requests)")
    _print_cpu(modes, generated, role_cpu)


def _print_ratio(mode: str, served: list[tuple[int, str, float]], rates: dict[str, list[float]]) -> None:
    per_round = [statistics.mean(x for r, n, x in served if r == k and _mode(n) == mode)
                 / statistics.mean(x for r, n, x in served if r == k and _mode(n) == "off")
                 for k in sorted({r for r, _, _ in served})]
    print(f"  ratio {mode}/off: {statistics.median(rates[mode]) / statistics.median(rates['off']):.3f} (medians)")
    if len(per_round) > 1:
        mean, half = statistics.mean(per_round), 2 * statistics.stdev(per_round) / len(per_round) ** 0.5
        print(f"    per round of the order: mean {mean:.3f} ± {half:.3f} (2 standard errors, {len(per_round)} "
              f"rounds): " + " ".join(f"{r:.3f}" for r in per_round))


def _print_cpu(modes: list[str], generated: dict[str, int], role_cpu: dict[str, dict[str, float | None]]) -> None:
    cpu = {m: [c for n, roles in role_cpu.items() if _mode(n) == m for c in roles.values()] for m in modes}
    if not all(cpu[m] and None not in cpu[m] for m in cpu):
        return
    made = {m: sum(g for n, g in generated.items() if _mode(n) == m) for m in modes}
    per_cpu = {m: made[m] / sum(cpu[m]) for m in cpu}
    roles = next(iter(role_cpu.values())).keys()
    ms = {m: {role: 1e3 * sum(role_cpu[n][role] for n in role_cpu if _mode(n) == m) / made[m] for role in roles}
          for m in modes}
    for mode in modes[1:]:
        print(f"  CPU of the services, {mode}: {per_cpu['off']:.1f} tokens per CPU-second off, {per_cpu[mode]:.1f} "
              f"on: ratio {per_cpu[mode] / per_cpu['off']:.3f} (exporters' threads included; not the receiver); "
              "CPU ms per token, off -> on: " + ", ".join(f"{r} {ms['off'][r]:.2f} -> {ms[mode][r]:.2f}"
                                                          for r in roles))


def _layout(roles: dict[str, set[int]] | None, cpus: set[int] | None) -> str:
    if roles:
        return "pinned per service: " + ", ".join(f"{r} CPU {min(c)}" for r, c in roles.items()) + \
            ", receiver and client with the target"
    return "everything on CPUs " + ",".join(map(str, sorted(cpus))) if cpus else "not pinned"
