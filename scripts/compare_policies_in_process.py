"""γ policies side by side in process, on the bundled pair: each prompt is
decoded once per policy, in a random order per prompt, so that the machine's
load drifts over all of them alike. Adaptive policies warm-start from their own
previous request, as the coordinator does. ``--draft-forwards lean,hf`` runs
each policy with the draft's lean forward (the default) and with Hugging Face's.

    python scripts/compare_policies_in_process.py --mode sampling \\
        --policies static:0,static:1,static:2,adaptive [--repeats 3] [--core 1]
    python scripts/compare_policies_in_process.py --mode greedy \\
        --policies static:0,static:4,adaptive --draft-forwards lean,hf
"""

from __future__ import annotations

import argparse
import os
import random

import torch

from specdec.core.gamma import AdaptiveGamma, parse_gamma_policy
from specdec.core.interfaces import SamplingParams
from specdec.models import bundled
from specdec.models.decoder import SpeculativeDecoder
from specdec.models.runner import ModelRunner
from specdec.tools.eval_pair import held_out_streams, make_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", default="static:0,static:1,static:2,adaptive")
    parser.add_argument("--mode", choices=("greedy", "sampling"), default="sampling")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--core", type=int, default=1, help="the core to run on (one torch thread)")
    parser.add_argument("--draft-forwards", default="lean",
                        help="comma-separated: lean (specdec.models.lean_llama), hf (Hugging Face's forward)")
    args = parser.parse_args()
    forwards = args.draft_forwards.split(",")
    if not set(forwards) <= {"lean", "hf"}:
        parser.error(f"--draft-forwards: lean or hf, got {args.draft_forwards!r}")

    if args.core in os.sched_getaffinity(0):
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    lean = SpeculativeDecoder(bundled.target_path(), bundled.draft_path())
    decoders = {"lean": lean}
    if "hf" in forwards:
        decoders["hf"] = SpeculativeDecoder(lean.target, ModelRunner(bundled.draft_path()))
    prompts = make_prompts(held_out_streams(lean.tokenizer), args.prompts, 128, args.tokens, seed=0)
    # "static:0" is the target alone: the draft's forward does not matter there.
    names = [p if p == "static:0" or len(forwards) == 1 else f"{p} ({f} draft)"
             for p in args.policies.split(",") for f in (forwards[:1] if p == "static:0" else forwards)]
    policies = {name: parse_gamma_policy(name.split(" ")[0], 16) for name in names}
    totals = {name: dict(tokens=0, seconds=0.0, rounds=0, drafted=0) for name in names}
    order = random.Random(0)
    for repeat in range(args.repeats):
        for i, prompt in enumerate(prompts):
            sampling = (SamplingParams(temperature=0.8, top_p=0.95, seed=i + 100 * repeat)
                        if args.mode == "sampling" else SamplingParams())
            for name in order.sample(names, len(names)):
                if isinstance(policies[name], AdaptiveGamma):
                    policies[name] = policies[name].for_new_request()
                decoder = decoders["hf" if "(hf draft)" in name or forwards == ["hf"] else "lean"]
                out = decoder.generate(prompt, max_new_tokens=args.tokens, sampling=sampling, gamma=policies[name])
                t = totals[name]
                t["tokens"] += len(out.token_ids)
                t["seconds"] += out.elapsed_s
                t["rounds"] += out.rounds
                t["drafted"] += sum(out.gammas)

    base = totals[names[0]]["tokens"] / totals[names[0]]["seconds"]
    print(f"{args.mode}, {args.prompts} prompts × {args.tokens} tokens × {args.repeats} repeats\n")
    print(f"| policy | tok/s | × {names[0]} | tokens/round | mean γ |")
    print("|---|---|---|---|---|")
    for name in names:
        t = totals[name]
        rate = t["tokens"] / t["seconds"]
        per_round = f"{t['tokens'] / t['rounds']:.2f} | {t['drafted'] / t['rounds']:.2f}"
        print(f"| {name} | {rate:.1f} | {rate / base:.2f} | {per_round} |")


if __name__ == "__main__":
    main()
