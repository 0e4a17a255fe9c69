"""Per-token cost of the batched forward, side by side: a model's own modules
against the lean Llama layers (both over the same paged KV store and attention
function), at 1 and at 16 sessions decoding together, on one CPU thread.

Each figure is the median over rounds in which the forwards take turns on the
same sessions, so other load on a shared machine moves both alike; the ratio
is what decides whether the lean layers earn their keep (within 1.1x: they
would not).

    python scripts/bench_forward.py [--model DIR] [--sessions 1,16] [--context 160] [--steps 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def decode_ms_per_token(runner, sessions: int, context: int, steps: int) -> float:
    """Mean wall time per token of ``steps`` decode passes of ``sessions``
    sequences of ``context`` positions (pre-fill excluded)."""
    from specdec.models.runner import Pass

    seqs = []
    for s in range(sessions):
        seq = runner.new_sequence()
        seq.tokens.extend((7 * s + 11 * i) % runner.vocab_size for i in range(context))
        runner.run_passes([Pass(seq)])
        seqs.append(seq)
    start = time.perf_counter()
    for _ in range(steps):
        logits = runner.run_passes([Pass(seq) for seq in seqs])
        for seq, out in zip(seqs, logits, strict=True):
            seq.tokens.append(int(out[0].argmax()))
    return (time.perf_counter() - start) / (steps * sessions) * 1000


def main() -> None:
    from specdec.models import bundled
    from specdec.models.runner import ModelRunner

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(bundled.target_path()))
    parser.add_argument("--sessions", default="1,16")
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runners = {"own modules": ModelRunner(args.model), "lean layers": ModelRunner(args.model, lean=True)}
    assert runners["lean layers"].lean, "the lean layers cannot run this model"
    print(f"{args.model}: ms per token, median of {args.rounds} rounds, context {args.context}, 1 thread")
    for sessions in (int(s) for s in args.sessions.split(",")):
        times = {name: [] for name in runners}
        for r in range(args.rounds):
            order = list(runners.items())
            for name, runner in (order if r % 2 == 0 else order[::-1]):
                times[name].append(decode_ms_per_token(runner, sessions, args.context, args.steps))
        own, lean = (statistics.median(times[name]) for name in runners)
        print(f"  {sessions:3d} sessions: own modules {own:6.3f}  lean layers {lean:6.3f}  own / lean {own / lean:.2f}")


if __name__ == "__main__":
    main()
