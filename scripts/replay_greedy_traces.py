"""How much could any γ schedule gain over the best static γ on the bundled pair?
Replays the pair's real greedy acceptance through schedules, without noise.

Under greedy decoding a round's outcome is a pure function of where it starts:
from position i of the target's output, the draft's greedy tokens agree with the
target's for m_i tokens (the *match length*), so a round drafting γ there accepts
min(γ, m_i) and the next round starts at i + min(γ, m_i) + 1. This script records
m_i, and the draft's confidence (its top probability) for each of its next
``--lookahead`` tokens, at every position of the target's greedy continuations of
held-out prompts (the bench's prompts first), then replays over those traces:

* static γ = 0 … lookahead, Hugging Face's heuristic schedule and the adaptive
  policy (the real classes of :mod:`specdec.core.gamma`, warm-started between requests
  as the coordinator does);
* two schedules tuned *in hindsight* on these very traces, as upper bounds:
  the best pair (γ after a fully accepted round, γ after any other) — acceptance
  is bursty, which is what the heuristic's +2/−1 bets on — and the best early
  stop on draft confidence (a cap γ, drafting stops after the first draft whose
  top probability is below τ; a complement to choosing γ).

Rounds cost what :class:`specdec.core.gamma.RoundCost` says with per-token figures
measured on the pair (``specdec eval-pair``; verify slope from timing the
target's cached forward of 1 vs 9 tokens), plus for distributed rows a per-call
overhead and the added round trip to each service. Rates are given as multiples
of the best static γ at the same RTT.

    python scripts/replay_greedy_traces.py [--prompts 24] [--seed 0] [--traces FILE]

Recording takes ~4 s per prompt on one core; ``--traces`` keeps the recording
(read back if the file exists).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import sys
from collections.abc import Callable

from specdec.core.gamma import AdaptiveGamma, GammaPolicy, HeuristicGamma, RoundCost, StaticGamma
from specdec.core.interfaces import RoundResult
from specdec.draft_service.servicer import DRAFT_AHEAD_EXTRA

PROMPT_TOKENS = 128  # as in specdec bench


def record(n_prompts: int, new_tokens: int, lookahead: int, seed: int = 0) -> list[dict]:
    """Match lengths and draft confidences along the target's greedy output."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.models import bundled
    from specdec.tools.eval_pair import held_out_streams, make_prompts

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(bundled.target_path())
    load = functools.partial(AutoModelForCausalLM.from_pretrained, dtype=torch.float32, local_files_only=True)
    target, draft = load(bundled.target_path()).eval(), load(bundled.draft_path()).eval()
    # min_new_tokens: an end-of-text token must not cut a continuation (or a
    # draft) short of the positions replayed.
    greedy = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id or 0)
    traces = []
    with torch.no_grad():
        for n, prompt in enumerate(make_prompts(held_out_streams(tokenizer), n_prompts, PROMPT_TOKENS,
                                                new_tokens + lookahead, seed)):
            length = new_tokens + lookahead
            out = target.generate(torch.tensor([prompt]), max_new_tokens=length, min_new_tokens=length,
                                  **greedy)[0].tolist()
            made = out[len(prompt):]
            match, confidence = [], []
            for i in range(new_tokens):
                run = draft.generate(torch.tensor([out[:len(prompt) + i]]), max_new_tokens=lookahead,
                                     min_new_tokens=lookahead, output_scores=True, return_dict_in_generate=True,
                                     **greedy)
                drafts = run.sequences[0, len(prompt) + i:].tolist()
                m = 0
                while m < len(drafts) and drafts[m] == made[i + m]:
                    m += 1
                match.append(m)
                confidence.append([round(float(s[0].float().softmax(-1).max()), 4) for s in run.scores])
            traces.append({"match": match, "confidence": confidence})
            print(f"prompt {n + 1}/{n_prompts}: mean match length {sum(match) / len(match):.2f}", file=sys.stderr)
    return traces


def replay(traces: list[dict], make_policy: Callable[[], GammaPolicy], cost: RoundCost,
           stop_below: float = 0.0, draft_ahead: bool = False) -> float:
    """Tokens per second of ``make_policy``'s schedule over every trace (requests in
    a row, warm-started as the coordinator does). ``stop_below``: drafting stops
    after the first draft whose confidence is below it. ``draft_ahead``: as the
    draft service does, while the target verifies γ drafts the draft makes
    1 + γ + DRAFT_AHEAD_EXTRA more as if all are accepted (the first a guess of
    the target's own next token); when they are, and the guess is right, the
    next round's first γ + DRAFT_AHEAD_EXTRA drafts are ready and cost only the
    call."""
    tokens, seconds = 0, 0.0
    policy = make_policy()
    for r, trace in enumerate(traces):
        if r and isinstance(policy, AdaptiveGamma):
            policy = policy.for_new_request()
        match, confidence = trace["match"], trace["confidence"]
        length, i, missed, ready = len(match), 0, 0, 0
        while i < length:
            gamma = min(policy.choose(), length - i - 1, len(confidence[i]))  # the round loop's clamp
            if stop_below:
                gamma = next((j + 1 for j in range(gamma) if confidence[i][j] < stop_below), gamma)
            accepted = min(gamma, match[i])
            draft_s = first_s = 0.0
            if gamma and ready:
                first_s = cost.draft_fixed
                draft_s = first_s + cost.draft_per_token * max(0, gamma - ready)
            elif gamma:  # after γ = 0 rounds the draft first catches up (~one draft's time)
                first_s = cost.draft_fixed + cost.draft_per_token * (2 if missed else 1)
                draft_s = first_s + cost.draft_per_token * (gamma - 1)
            ready = gamma + DRAFT_AHEAD_EXTRA if draft_ahead and gamma and match[i] >= gamma + 1 else 0
            verify_s = cost.verify_fixed + cost.verify_per_token * gamma
            policy.observe(RoundResult([0] * (accepted + 1), gamma, accepted, draft_s, verify_s, None,
                                       first_s or None, draft_caught_up=missed if gamma else 0,
                                       target_caught_up=int(i == 0)))
            missed = 0 if gamma else missed + 1
            i += accepted + 1
            tokens += accepted + 1
            seconds += draft_s + verify_s
    return tokens / seconds


class TwoStateGamma:
    """γ_full after a round whose drafts were all accepted, γ_other after any other."""

    def __init__(self, after_full: int, after_other: int):
        self.after_full, self.after_other, self.full = after_full, after_other, False

    def choose(self) -> int:
        return self.after_full if self.full else self.after_other

    def observe(self, result: RoundResult) -> None:
        if result.gamma:
            self.full = result.accepted == result.gamma


def costs(args) -> dict[str, RoundCost]:
    """Round costs per row: in process, and distributed at each added RTT."""
    ms = 1e-3
    rows = {"in-process": RoundCost(0.0, args.draft_ms * ms, args.target_ms * ms, args.verify_slope_ms * ms)}
    for rtt in args.rtt_ms:
        fixed = (args.call_overhead_ms + rtt) * ms
        rows[f"distributed @{rtt:g} ms"] = RoundCost(fixed, args.draft_ms * ms, args.target_ms * ms + fixed,
                                                     args.verify_slope_ms * ms)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=24, help="held-out prompts to record (default 24)")
    p.add_argument("--seed", type=int, default=0, help="where prompts are cut (default 0: the bench's prompts)")
    p.add_argument("--new-tokens", type=int, default=96, help="greedy tokens per prompt (default 96, as the bench)")
    p.add_argument("--lookahead", type=int, default=12, help="draft tokens recorded per position (default 12)")
    p.add_argument("--traces", default=None, metavar="FILE",
                   help="JSON of a recording: read if it exists, else written")
    p.add_argument("--target-ms", type=float, default=5.5, help="target pass of one token (eval-pair: 5.51)")
    p.add_argument("--draft-ms", type=float, default=1.04,
                   help="draft per token (1.04: Hugging Face's forward, eval-pair; 0.63: the lean forward)")
    p.add_argument("--verify-slope-ms", type=float, default=0.6, help="target pass per extra token (measured 0.63)")
    p.add_argument("--call-overhead-ms", type=float, default=1.0,
                   help="per call in distributed rows: gRPC in Python, both ends")
    p.add_argument("--rtt-ms", type=float, nargs="+", default=[0, 2, 10, 30], help="added RTTs (default 0 2 10 30)")
    p.add_argument("--draft-ahead", action="store_true",
                   help="distributed rows: the draft service drafts ahead (its default; see replay)")
    args = p.parse_args()

    path = pathlib.Path(args.traces) if args.traces else None
    if path is not None and path.exists():
        traces = json.loads(path.read_text())
    else:
        traces = record(args.prompts, args.new_tokens, args.lookahead, args.seed)
        if path is not None:
            path.write_text(json.dumps(traces))
    lookahead = min(len(c) for t in traces for c in t["confidence"])
    match = [m for t in traces for m in t["match"]]
    print(f"{len(traces)} prompts, {len(match)} positions; mean match length {sum(match) / len(match):.2f}; "
          f"P(match >= 1) {sum(m >= 1 for m in match) / len(match):.2f}\n")
    print("| row | best static γ (× γ = 0) | heuristic | adaptive | best two-state γ (hindsight) "
          "| best confidence stop (hindsight) |")
    print("|---|---|---|---|---|---|")
    for row, cost in costs(args).items():
        run = functools.partial(replay, draft_ahead=args.draft_ahead and row != "in-process")
        static = {g: run(traces, functools.partial(StaticGamma, g), cost) for g in range(lookahead + 1)}
        best_g = max(static, key=static.get)
        best = static[best_g]
        heuristic = run(traces, functools.partial(HeuristicGamma, gamma_max=lookahead), cost) / best
        adaptive = run(traces, functools.partial(AdaptiveGamma, gamma_max=lookahead), cost) / best
        two = {(f, o): run(traces, functools.partial(TwoStateGamma, f, o), cost)
               for f in range(1, lookahead + 1) for o in range(1, lookahead + 1)}
        two_best = max(two, key=two.get)
        stop = {(g, tau): run(traces, functools.partial(StaticGamma, g), cost, tau)
                for g in range(1, lookahead + 1) for tau in (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)}
        stop_best = max(stop, key=stop.get)
        print(f"| {row} | {best_g} ({best / static[0]:.2f}×) | {heuristic:.3f} | {adaptive:.3f} "
              f"| {two[two_best] / best:.3f} (γ {two_best[0]} after a full round, {two_best[1]} else) "
              f"| {stop[stop_best] / best:.3f} (cap {stop_best[0]}, τ {stop_best[1]}) |")


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
    main()
