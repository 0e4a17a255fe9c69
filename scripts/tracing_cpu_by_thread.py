"""CPU per generated token of every thread of the three services, tracing off
against tracing on (OTLP/gRPC to a receiver in this process): which thread pays
for tracing.

Two stacks (draft, target, coordinator) start side by side from the bundled
models, one untraced and one exporting every span, pinned as ``--cpus`` says
(default ``last``: everything on one CPU, where all of tracing's CPU is on the
rounds' path; ``per-service`` as in ``specdec bench-tracing``). The same greedy request
goes to each in turn (ABBA); the threads' user + system time comes from
``/proc/<pid>/task``. Python does not name its threads for the OS, so the
services run with a ``sitecustomize`` that does (``rounds``, ``draft-model``,
``OtelBatchSpanRe...``; ``python`` is each process's main thread, its event loop).
CPU time is less moved by other load than wall-clock time.

    python scripts/tracing_cpu_by_thread.py --requests 16
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import tempfile
import time

NAME_THREADS = '''\
import ctypes, threading
_prctl = ctypes.CDLL(None).prctl
_run = threading.Thread.run
def run(self):
    _prctl(15, self.name[:15].encode(), 0, 0, 0)  # PR_SET_NAME
    return _run(self)
threading.Thread.run = run
'''


def thread_cpu(pid: int) -> dict[tuple[str, str], float]:
    """(thread id, name without its trailing number) -> CPU seconds so far."""
    from specdec.tools.bench_tracing import cpu_seconds

    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = re.sub(r"[_\-]?\d+$", "", f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
        cpu = cpu_seconds(f"/proc/{pid}/task/{tid}/stat")
        if cpu is not None:
            out[(tid, name)] = cpu
    return out


def main() -> None:
    from specdec.cli.serve import add_model_arguments, model_dirs
    from specdec.serving.client import Client
    from specdec.tools import bench_tracing
    from specdec.tools.otlp_receiver import OtlpReceiver

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--prompt", default="def fibonacci(n):")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=16, help="requests per mode (default 16)")
    parser.add_argument("--gamma-policy", default="static:4")
    parser.add_argument("--cpus", default="last", help="as specdec bench-tracing's (default: last)")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    target, draft = model_dirs(args)
    roles = bench_tracing.service_cpus(args.cpus)  # before pinning: it reads the CPUs this process may use
    bench_tracing.pin(args.cpus)
    site = pathlib.Path(tempfile.mkdtemp(prefix="specdec-thread-names-"))
    (site / "sitecustomize.py").write_text(NAME_THREADS)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    receiver = OtlpReceiver(keep=False).start()
    traced = dict(OTEL_TRACES_EXPORTER="otlp", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                  OTEL_EXPORTER_OTLP_PROTOCOL="grpc")
    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="specdec-thread-cpu-"))
    stacks = {mode: bench_tracing._start(mode, env, args, target, draft, workdir, roles)  # noqa: SLF001
              for mode, env in (("off", {}), ("on", traced))}
    try:
        for stack in stacks.values():
            stack.wait_serving()
        clients = {mode: Client(stack.address("coordinator")) for mode, stack in stacks.items()}
        request = dict(max_new_tokens=args.max_new_tokens, gamma_policy=args.gamma_policy, temperature=0.0,
                       prompt=args.prompt)
        for mode in ("off", "on", "on", "off"):  # warm-up
            clients[mode].complete(**request)
        pids = {mode: {role: p.pid for role, p in stack.procs.items()} for mode, stack in stacks.items()}
        before = {mode: {role: thread_cpu(pid) for role, pid in pids[mode].items()} for mode in pids}
        tokens = dict.fromkeys(stacks, 0)
        for i in range(args.requests):
            for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
                tokens[mode] += clients[mode].complete(**request).stats.generated_tokens
        time.sleep(6)  # the traced stack's last batches (every 5 s) are exported and billed
        after = {mode: {role: thread_cpu(pid) for role, pid in pids[mode].items()} for mode in pids}
    finally:
        for stack in stacks.values():
            stack.stop()
        receiver.stop()
    print(f"CPU ms per generated token by thread, {args.requests} requests of {args.max_new_tokens} tokens "
          f"per mode ({args.gamma_policy}, greedy); CPUs: {args.cpus}")
    for role in ("coordinator", "draft", "target"):
        by_name: dict[str, dict[str, float]] = {}
        for mode in ("off", "on"):
            for key, cpu in after[mode][role].items():
                spent = cpu - before[mode][role].get(key, 0.0)
                by_name.setdefault(key[1], dict.fromkeys(("off", "on"), 0.0))[mode] += spent
        print(role)
        for name, spent in sorted(by_name.items(), key=lambda kv: -max(kv[1].values())):
            off, on = (1e3 * spent[m] / tokens[m] for m in ("off", "on"))
            if max(off, on) >= 0.005:
                print(f"  {name:18s} off {off:6.3f}  on {on:6.3f}  ({on - off:+.3f})")


if __name__ == "__main__":
    main()
