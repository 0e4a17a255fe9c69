"""Adaptive γ against static γ in synthetic worlds: a check of the controller's
decisions that runs in seconds and without noise from the machine.

Each draft is accepted independently with probability α; a round costs what
:class:`specdec.gamma.RoundCost` says (no noise). Every policy decodes the same
requests (16 × 96 tokens, a warm start between requests as the coordinator
does) and is reported as tokens/s relative to plain target decoding (static:0).
The default worlds use costs measured under sampling with the bundled pair
(draft 2.1 ms per token, verify 8.5 ms + 1.5 ms per token) plus 0, 10 or 30 ms
of round trip to each service.

    python scripts/simulate_adaptive_gamma.py [--optimism Z] [--probe-budget B] [--seeds N]
"""

from __future__ import annotations

import argparse
import random

from specdec.gamma import AdaptiveGamma, GammaPolicy, RoundCost, StaticGamma
from specdec.rounds import RoundResult

STATIC = (1, 2, 3, 4, 6, 8)


def world_cost(rtt_s: float) -> RoundCost:
    return RoundCost(draft_fixed=0.0004 + rtt_s, draft_per_token=0.0021,
                     verify_fixed=0.0085 + rtt_s, verify_per_token=0.0015)


def tokens_per_s(make_policy, alpha: float, cost: RoundCost, seed: int,
                 requests: int = 16, tokens: int = 96) -> float:
    rng = random.Random(seed)
    policy: GammaPolicy = make_policy()
    made_total, seconds = 0, 0.0
    for r in range(requests):
        if r and isinstance(policy, AdaptiveGamma):
            policy = policy.for_new_request()
        made, first = 0, True
        while made < tokens:
            g = policy.choose()
            n = 0
            while n < g and rng.random() < alpha:
                n += 1
            draft_s = cost.draft_fixed + cost.draft_per_token * g if g else 0.0
            verify_s = cost.verify_fixed + cost.verify_per_token * g
            first_s = cost.draft_fixed + cost.draft_per_token if g else None
            policy.observe(RoundResult([0] * (n + 1), g, n, draft_s, verify_s, None, first_s,
                                       target_caught_up=1 if first else 0))
            first = False
            made += n + 1
            seconds += draft_s + verify_s
        made_total += made
    return made_total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimism", type=float, default=AdaptiveGamma.optimism)
    parser.add_argument("--probe-budget", type=float, default=AdaptiveGamma.probe_budget)
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()

    def make_adaptive() -> AdaptiveGamma:
        return AdaptiveGamma(gamma_max=16, optimism=args.optimism, probe_budget=args.probe_budget)

    print("| α | RTT ms | best static (× static:0) | adaptive (× static:0), per seed | adaptive / best static |")
    print("|---|---|---|---|---|")
    for rtt_ms, alphas in ((0, (0.4, 0.55, 0.63, 0.75)), (10, (0.4, 0.7)), (30, (0.4, 0.55, 0.7))):
        cost = world_cost(rtt_ms / 1000)
        for alpha in alphas:
            base = tokens_per_s(lambda: StaticGamma(0), alpha, cost, 0)
            best_g, best = max(((g, tokens_per_s(lambda: StaticGamma(g), alpha, cost, 0) / base) for g in STATIC),
                               key=lambda x: x[1])
            best = max(best, 1.0)  # static:0 is a static γ too
            adaptive = [tokens_per_s(make_adaptive, alpha, cost, seed) / base for seed in range(args.seeds)]
            print(f"| {alpha} | {rtt_ms} | {best:.3f} (γ = {best_g if best > 1 else 0}) | "
                  f"{', '.join(f'{a:.3f}' for a in adaptive)} | {min(adaptive) / best:.2f}–{max(adaptive) / best:.2f} |")


if __name__ == "__main__":
    main()
