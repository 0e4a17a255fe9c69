"""Where a distributed round's time goes on the target's core: the CPU each
process spends per round, in `specdec bench`'s layout (draft service on core 0;
target service, coordinator and this client on core 1; one torch thread each).

When the sum of the CPU of core 1's processes per round equals the wall time
of a round, that core is the bottleneck and every millisecond of gRPC, round
logic or streaming there is a millisecond of the round: the in-process decoder
pays only the target's compute on its core, plus the drafting.

    python scripts/cpu_per_round.py --policies static:0,static:4,adaptive [--requests 12]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import tempfile
import time


def process_cpu(pid: int) -> float:
    from specdec.tools.bench_tracing import cpu_seconds

    return cpu_seconds(f"/proc/{pid}/stat") or 0.0


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def start_services(procs) -> tuple[dict[str, int], int]:
    """The bundled pair's draft service, target service and a coordinator in the
    bench's layout; their pids by name, and the coordinator's port."""
    from specdec.models import bundled
    from specdec.tools.bench import COORDINATOR_CORE, DRAFT_CORE, TARGET_CORE, free_port

    target_dir, draft_dir = bundled.target_path(), bundled.draft_path()
    draft_port, target_port, port = free_port(), free_port(), free_port()
    procs.start("draft", ["draft-service", "--model", str(draft_dir), "--port", str(draft_port)], core=DRAFT_CORE)
    procs.start("target", ["target-service", "--model", str(target_dir), "--port", str(target_port)],
                core=TARGET_CORE)
    procs.start("coordinator", ["coordinator", "--draft", f"127.0.0.1:{draft_port}", "--target",
                                f"127.0.0.1:{target_port}", "--port", str(port), "--tokenizer", str(target_dir),
                                "--http-port", "0"],
                core=COORDINATOR_CORE)
    return dict(zip(("draft", "target", "coordinator"), (p.pid for p in procs.children), strict=True)), port


def main() -> None:
    from transformers import AutoTokenizer

    from specdec.models import bundled
    from specdec.serving.client import Client
    from specdec.tools.bench import COORDINATOR_CORE, TARGET_CORE, Processes, pin
    from specdec.tools.eval_pair import held_out_streams, make_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="static:0,static:4,adaptive")
    parser.add_argument("--requests", type=int, default=12, help="greedy requests of 96 tokens per policy")
    args = parser.parse_args()

    target_dir = bundled.target_path()
    procs = Processes(pathlib.Path(tempfile.mkdtemp(prefix="specdec-cpu-per-round-")))
    pids, port = start_services(procs)
    try:
        pin(COORDINATOR_CORE)  # before the client: grpc's threads take the affinity of the thread starting them
        client = Client(f"127.0.0.1:{port}", timeout=300)
        client.wait_ready(120)
        prompts = make_prompts(held_out_streams(AutoTokenizer.from_pretrained(target_dir)), 8, 128, 96, seed=0)
        for policy in args.policies.split(","):
            for prompt in prompts[:2]:  # warm-up
                client.complete(prompt_ids=prompt, max_new_tokens=32, gamma_policy=policy)
            before = {name: process_cpu(pid) for name, pid in pids.items()}
            client_before, start = own_cpu(), time.perf_counter()
            rounds = tokens = 0
            target_compute = 0.0
            for i in range(args.requests):
                stats = client.complete(prompt_ids=prompts[i % len(prompts)], max_new_tokens=96,
                                        gamma_policy=policy).stats
                rounds += stats.rounds
                tokens += stats.generated_tokens
                target_compute += stats.target_compute_s
            wall = time.perf_counter() - start
            cpu = {name: process_cpu(pid) - before[name] for name, pid in pids.items()}
            cpu["client"] = own_cpu() - client_before
            per_round = {name: 1e3 * seconds / rounds for name, seconds in cpu.items()}
            on_target_core = per_round["target"] + per_round["coordinator"] + per_round["client"]
            print(f"{policy}: {tokens / wall:.1f} tok/s, {rounds} rounds, {1e3 * wall / rounds:.2f} ms per round; "
                  f"target compute {1e3 * target_compute / rounds:.2f} ms per round")
            print("  CPU ms per round: " + ", ".join(f"{name} {ms:.2f}" for name, ms in per_round.items())
                  + f"; core {TARGET_CORE} in all {on_target_core:.2f}")
    finally:
        procs.stop()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
