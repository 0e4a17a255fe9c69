"""Sample the target service's and the coordinator's Python stacks with py-spy
while distributed greedy requests run, in `specdec bench`'s layout (draft on
core 0; target, coordinator and this client on core 1), to see what a round
spends outside the target's forward pass. py-spy is not a dependency:
`pip install py-spy`. It runs on core 0 with --nonblocking.

    python scripts/profile_services.py --policy static:0 --seconds 20 --out /tmp/profiles

Writes <out>/{target,coordinator}-<policy>.txt (py-spy's raw "collapsed" stacks,
one line per stack with its sample count) and prints the top frames. Note: a
thread that is runnable but preempted counts as active, so on a shared core the
waker's `_write_to_self` and the loop's `select` collect samples that are the
other thread's time.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import subprocess
import tempfile
import time


def top_frames(path: pathlib.Path, n: int = 30) -> list[tuple[int, str]]:
    """Inclusive sample counts per function (with its file's name), the largest first."""
    counts: collections.Counter[str] = collections.Counter()
    for line in path.read_text().splitlines():
        stack, _, samples = line.rpartition(" ")
        functions = set()
        for frame in stack.split(";")[1:]:  # [0] is the thread
            function, _, where = frame.partition(" (")  # "name (path/file.py:line)"
            functions.add(f"{function} ({os.path.basename(where.rsplit(':', 1)[0])})")
        for function in functions:
            counts[function] += int(samples)
    return [(v, k) for k, v in counts.most_common(n)]


def main() -> None:
    from transformers import AutoTokenizer

    from specdec.models import bundled
    from specdec.serving.client import Client
    from specdec.tools.bench import COORDINATOR_CORE, DRAFT_CORE, Processes, pin
    from specdec.tools.eval_pair import held_out_streams, make_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="static:0")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--out", default="profiles")
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from cpu_per_round import start_services  # this folder's sibling script

    target_dir = bundled.target_path()
    procs = Processes(pathlib.Path(tempfile.mkdtemp(prefix="specdec-profile-")))
    pids, port = start_services(procs)
    try:
        pin(COORDINATOR_CORE)
        client = Client(f"127.0.0.1:{port}", timeout=300)
        client.wait_ready(120)
        prompts = make_prompts(held_out_streams(AutoTokenizer.from_pretrained(target_dir)), 8, 128, 96, seed=0)
        for prompt in prompts[:2]:  # warm-up
            client.complete(prompt_ids=prompt, max_new_tokens=32, gamma_policy=args.policy)
        files = {name: out / f"{name}-{args.policy.replace(':', '')}.txt" for name in ("target", "coordinator")}
        spies = [subprocess.Popen(["taskset", "-c", str(DRAFT_CORE), "py-spy", "record", "--pid", str(pids[name]),
                                   "--duration", str(args.seconds), "--rate", "200", "--nonblocking", "--threads",
                                   "--format", "raw", "-o", str(path)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for name, path in files.items()]
        end, rounds, i = time.time() + args.seconds, 0, 0
        while time.time() < end:
            rounds += client.complete(prompt_ids=prompts[i % len(prompts)], max_new_tokens=96,
                                      gamma_policy=args.policy).stats.rounds
            i += 1
        for spy in spies:
            spy.wait()
        print(f"{args.policy}: {rounds} rounds in ~{args.seconds} s")
        for name, path in files.items():
            print(f"-- {name} ({path}), inclusive samples at 200 Hz:")
            for samples, frame in top_frames(path):
                print(f"{samples:7d}  {frame}")
    finally:
        procs.stop()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
