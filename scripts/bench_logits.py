"""Logits processing for the sessions of one forward pass, side by side: each
session's rows processed on their own (process_logits per session) against
all of them in one batched step (what ModelRunner.run_passes does: replies).

The logits are the bundled target's own, for ``--sessions`` sessions of
``--rows`` positions each (a verification of γ = rows - 1 drafts), sampled with
temperature 0.8 and top-p 0.95, on the model's device. Each figure is the
median over rounds in which the two take turns (one CPU thread).

    python scripts/bench_logits.py [--model DIR] [--device cpu] [--sessions 16] [--rows 5] [--rounds 21]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import time

import torch


def session_logits(runner, sessions: int, rows: int) -> list[torch.Tensor]:
    """Each session's logits [rows, V] at the end of a different stretch of this file."""
    from specdec.models.runner import Pass

    text = pathlib.Path(__file__).read_text()
    ids = runner.tokenizer.encode(text) if runner.tokenizer is not None else list(range(1000))
    seqs = []
    for s in range(sessions):
        seq = runner.new_sequence()
        seq.tokens.extend(ids[7 * s:7 * s + 40])
        seqs.append(seq)
    return runner.run_passes([Pass(seq, rows) for seq in seqs])


def seconds(fn, device: torch.device, repeat: int = 5) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync()
    return (time.perf_counter() - start) / repeat


def main() -> None:
    from specdec.core.interfaces import SamplingParams
    from specdec.core.sampling import process_logits
    from specdec.models import bundled
    from specdec.models.runner import ModelRunner, Pass, replies

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(bundled.target_path()))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner = ModelRunner(args.model, args.device)
    logits = session_logits(runner, args.sessions, args.rows)
    params = SamplingParams(temperature=0.8, top_p=0.95)
    passes = [Pass(None, args.rows, params=params) for _ in logits]  # replies reads last and params only
    ways = {
        "per session": lambda: [process_logits(x, params) for x in logits],
        "batched": lambda: replies(passes, logits),
    }
    for want, got in zip(ways["per session"](), ways["batched"](), strict=True):
        assert torch.equal(want, got)  # the same probabilities, bit for bit
    times = {name: [] for name in ways}
    for r in range(args.rounds):
        for name, fn in (list(ways.items()) if r % 2 == 0 else list(ways.items())[::-1]):
            times[name].append(seconds(fn, runner.device))
    per_session, batched = (statistics.median(times[name]) * 1e3 for name in ways)
    print(f"{args.model} on {runner.device}: {args.sessions} sessions x [{args.rows}, {runner.vocab_size}] logits, "
          f"t=0.8 top_p=0.95, median of {args.rounds} rounds, 1 thread")
    print(f"  per session {per_session:7.3f} ms  batched {batched:7.3f} ms  per session / batched "
          f"{per_session / batched:.2f}")


if __name__ == "__main__":
    main()
