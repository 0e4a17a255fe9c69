"""Scale-out and failover under load, on loopback: a redis-server, two draft
services, two target services and two coordinators sharing the session
directory (``--redis``), each coordinator given both drafts and both targets.

Two runs of ``specdec loadtest``'s client (conversations of ``--turns`` turns,
each session starting at one coordinator and going on through the other if its
stream breaks), every turn then checked against target-only decoding:

* clean: nothing fails;
* faults: ``--fault-after`` seconds in, one target is killed (SIGKILL) and one
  draft stopped (SIGTERM, a rolling restart).

It prints both reports side by side: errors, outputs that differ (both must
be 0), throughput, and inter-token latency p50 / p99 / the longest gap.

    python scripts/failover_load.py --sessions 32 --turns 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.models import bundled
from specdec.serving.server import free_port
from specdec.tools.loadtest import check_turns, held_out_prompts, run_load
from specdec.tools.local_redis import RedisServer


def start(name: str, argv: list[str], logs: pathlib.Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", *argv, "--host", "127.0.0.1", "--port", str(port)],
                            env=env, stdout=open(logs / f"{name}.log", "w"), stderr=subprocess.STDOUT)
    return proc, f"127.0.0.1:{port}"


def wait_serving(address: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{address} did not start serving")


def one_run(coordinators: str, prompts, args, fault=None) -> dict:
    request = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0, "top_p": 1.0, "gamma_policy": ""}
    timer = threading.Timer(args.fault_after, fault) if fault else None
    if timer:
        timer.start()
    report, turns = run_load(coordinators, prompts, sessions=args.sessions, requests=args.sessions * args.turns,
                             duration_s=None, request=request, turns=args.turns)
    if timer:
        timer.join()
    gaps = [g for t in turns for g in t.record.token_gaps_s]
    return {"report": report, "differed": check_turns(coordinators, turns, request),
            "checked": sum(t.record.error is None for t in turns), "max_gap_s": max(gaps, default=0.0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--fault-after", type=float, default=5.0, metavar="SECONDS")
    args = p.parse_args()
    logs = pathlib.Path(tempfile.mkdtemp(prefix="specdec-failover-"))
    redis = RedisServer(logs / "redis").start()
    procs, addresses = {}, {}
    try:
        for name, role, model in (("D1", "draft", bundled.draft_path()), ("D2", "draft", bundled.draft_path()),
                                  ("T1", "target", bundled.target_path()), ("T2", "target", bundled.target_path())):
            procs[name], addresses[name] = start(name, [f"{role}-service", "--model", str(model)], logs)
        pools = ["--draft", f"{addresses['D1']},{addresses['D2']}", "--target", f"{addresses['T1']},{addresses['T2']}"]
        for name in ("C1", "C2"):
            procs[name], addresses[name] = start(
                name, ["coordinator", *pools, "--redis", redis.url, "--lease", "2", "--http-port", "0"], logs)
        for address in addresses.values():
            wait_serving(address)
        coordinators = f"{addresses['C1']},{addresses['C2']}"
        prompts = held_out_prompts(16)
        print(f"logs: {logs}", file=sys.stderr)
        runs = {"clean": one_run(coordinators, prompts, args)}

        def fault():
            print(f"{args.fault_after:g} s: SIGKILL to target T1, SIGTERM to draft D1", file=sys.stderr)
            procs["T1"].kill()
            procs["D1"].send_signal(signal.SIGTERM)

        runs["target SIGKILL + draft SIGTERM"] = one_run(coordinators, prompts, args, fault)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.stop()
    print(f"\n{args.sessions} sessions x {args.turns} turns x {args.max_new_tokens} tokens, greedy, "
          f"2 coordinators (--redis), 2 drafts, 2 targets\n")
    print("| run | requests | errors | outputs differing | tok/s | ITL p50 ms | ITL p99 ms | longest gap ms |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        rep = r["report"]
        errors = sum(rep.errors.values())
        print(f"| {name} | {rep.requests} | {errors} | {r['differed']} of {r['checked']} | "
              f"{rep.tokens_per_second:.0f} | {rep.itl_p50_s * 1e3:.1f} | {rep.itl_p99_s * 1e3:.1f} | "
              f"{r['max_gap_s'] * 1e3:.0f} |")
    bad = any(sum(r["report"].errors.values()) or r["differed"] for r in runs.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
