"""Adaptive γ against static γ in synthetic worlds: a check of the controller's
decisions that runs in seconds and without noise from the machine.

Each draft is accepted independently with probability α; a round costs what
:class:`specdec.core.gamma.RoundCost` says, with no noise. As in the real round loop,
the last rounds of a request are clamped so as not to overshoot its length, and
after γ = 0 rounds the draft's next call first catches up on the tokens it
missed (modelled as one more draft token's worth of time). Every policy decodes
16 requests of 96 tokens per seed, with a warm start between requests as the
coordinator does. Static and adaptive policies see the same seeds. Rates are
relative to plain target decoding (static:0) on the same seed.

The default worlds use costs measured under sampling with the bundled pair: a
0.4 ms draft call plus 2.1 ms per draft token, and 8.5 ms plus 1.5 ms per token
to verify. To these, 0, 10 or 30 ms of round trip is added to each service.

    python scripts/simulate_adaptive_gamma.py [--optimism Z] [--probe-budget B] [--seeds N]
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
from collections.abc import Callable

from specdec.core.gamma import AdaptiveGamma, GammaPolicy, RoundCost, StaticGamma
from specdec.core.interfaces import RoundResult

STATIC = (0, 1, 2, 3, 4, 6, 8)
WORLDS = ((0, (0.4, 0.55, 0.63, 0.75)), (10, (0.4, 0.7)), (30, (0.4, 0.55, 0.7)))


def world_cost(rtt_s: float) -> RoundCost:
    return RoundCost(draft_fixed=0.0004 + rtt_s, draft_per_token=0.0021,
                     verify_fixed=0.0085 + rtt_s, verify_per_token=0.0015)


def tokens_per_s(make_policy: Callable[[], GammaPolicy], alpha: float, cost: RoundCost, seed: int,
                 requests: int = 16, tokens: int = 96) -> float:
    rng = random.Random(seed)
    policy = make_policy()
    made_total, seconds = 0, 0.0
    for r in range(requests):
        if r and isinstance(policy, AdaptiveGamma):
            policy = policy.for_new_request()
        made, first, missed = 0, True, 0
        while made < tokens:
            g = min(policy.choose(), tokens - made - 1)  # the round loop's clamp
            n = 0
            while n < g and rng.random() < alpha:
                n += 1
            draft_s = first_s = None
            if g:
                catch_up = cost.draft_per_token if missed else 0.0
                first_s = cost.draft_fixed + catch_up + cost.draft_per_token
                draft_s = first_s + cost.draft_per_token * (g - 1)
            verify_s = cost.verify_fixed + cost.verify_per_token * g
            policy.observe(RoundResult([0] * (n + 1), g, n, draft_s or 0.0, verify_s, None, first_s,
                                       draft_caught_up=missed if g else 0, target_caught_up=1 if first else 0))
            missed = 0 if g else missed + 1
            first = False
            made += n + 1
            seconds += (draft_s or 0.0) + verify_s
        made_total += made
    return made_total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimism", type=float, default=AdaptiveGamma.optimism)
    parser.add_argument("--probe-budget", type=float, default=AdaptiveGamma.probe_budget)
    parser.add_argument("--seeds", type=int, default=4)
    args = parser.parse_args()
    seeds = range(max(1, args.seeds))
    make_adaptive = functools.partial(AdaptiveGamma, gamma_max=16, optimism=args.optimism,
                                      probe_budget=args.probe_budget)

    print("| α | RTT ms | best static (× static:0) | adaptive (× static:0), per seed | adaptive / best static |")
    print("|---|---|---|---|---|")
    for rtt_ms, alphas in WORLDS:
        cost = world_cost(rtt_ms / 1000)
        for alpha in alphas:
            def relative(make: Callable[[], GammaPolicy], alpha=alpha, cost=cost) -> list[float]:
                plain = functools.partial(StaticGamma, 0)
                return [tokens_per_s(make, alpha, cost, s) / tokens_per_s(plain, alpha, cost, s) for s in seeds]

            static = {g: statistics.mean(relative(functools.partial(StaticGamma, g))) for g in STATIC}
            best_g = max(static, key=static.get)
            adaptive = relative(make_adaptive)
            low, high = min(adaptive) / static[best_g], max(adaptive) / static[best_g]
            spread = f"{low:.2f}" if f"{low:.2f}" == f"{high:.2f}" else f"{low:.2f}–{high:.2f}"
            print(f"| {alpha} | {rtt_ms} | {static[best_g]:.3f} (γ = {best_g}) | "
                  f"{', '.join(f'{a:.3f}' for a in adaptive)} | {spread} |")


if __name__ == "__main__":
    main()
