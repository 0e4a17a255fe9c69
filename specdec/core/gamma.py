"""Choosing γ, the number of tokens drafted per round.

A policy is asked for γ before each round and shown the round's outcome after
it (a :class:`specdec.core.rounds.RoundResult`); the round loop clamps its answer to
what is left to generate. Three policies:

* ``static:N`` — the same γ every round;
* ``heuristic`` — Hugging Face assisted generation's schedule (+2 after a round
  whose drafts were all accepted, −1 otherwise);
* ``adaptive`` — the γ maximising expected tokens per second under running
  estimates of acceptance and of what each round costs.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import TYPE_CHECKING, Protocol

from specdec.core.text import excerpt

if TYPE_CHECKING:
    from specdec.core.interfaces import RoundResult


class GammaPolicy(Protocol):
    def choose(self) -> int: ...

    def observe(self, result: RoundResult) -> None: ...


@dataclasses.dataclass
class StaticGamma:
    """The same γ every round."""

    gamma: int

    def choose(self) -> int:
        return self.gamma

    def observe(self, result: RoundResult) -> None:
        pass


@dataclasses.dataclass
class HeuristicGamma:
    """Hugging Face assisted generation's schedule: +2 after a round whose drafts
    were all accepted, -1 otherwise (never below 1; with gamma_max 0, always 0)."""

    gamma: int = 5
    gamma_max: int = 16

    def choose(self) -> int:
        return self.gamma

    def observe(self, result: RoundResult) -> None:
        if result.gamma == 0:
            return
        if result.accepted == result.gamma:
            self.gamma = min(self.gamma + 2, self.gamma_max)
        else:
            self.gamma = max(self.gamma - 1, 1)


# ----------------------------------------------------------------- the cost model


def expected_tokens(alphas: list[float], gamma: int) -> float:
    """Expected tokens emitted by a round drafting ``gamma`` tokens, where
    ``alphas[i]`` is the chance that draft i+1 is accepted given all before it
    were: 1 (the target's own token) + Σ_k Π_{i<=k} α_i. With a constant α this
    is the familiar (1 − α^(γ+1)) / (1 − α)."""
    total, survive = 1.0, 1.0
    for i in range(gamma):
        survive *= alphas[min(i, len(alphas) - 1)]
        total += survive
    return total


@dataclasses.dataclass(frozen=True)
class RoundCost:
    """Seconds a round takes as a function of γ:
    [γ > 0]·(draft_fixed + draft_per_token·γ) + verify_fixed + verify_per_token·γ.

    The fixed parts hold the round trips to each service (and per-call
    overheads); the per-token parts hold compute plus bytes / bandwidth.

    Rounds without drafts may ask the target for several tokens in one call
    (``Limits.plain_tokens``), paying the round trip once for them all: where
    such rounds were measured, ``plain_per_token`` is their seconds per token."""

    draft_fixed: float
    draft_per_token: float
    verify_fixed: float
    verify_per_token: float
    plain_per_token: float | None = None

    def seconds(self, gamma: int) -> float:
        draft = self.draft_fixed + self.draft_per_token * gamma if gamma else 0.0
        return draft + self.verify_fixed + self.verify_per_token * gamma

    def plain_seconds_per_token(self) -> float:
        """What a token costs without drafting (γ = 0)."""
        return self.plain_per_token if self.plain_per_token is not None else self.seconds(0)


def best_gamma(alphas: list[float], cost: RoundCost, gamma_max: int, min_gain: float = 0.0) -> int:
    """The γ in [0, gamma_max] maximising expected tokens per second; 0 unless
    drafting beats it by more than ``min_gain`` (a fraction)."""
    # The floor keeps a fit that has not seen enough rounds from dividing by zero.
    rates = [1 / max(cost.plain_seconds_per_token(), 1e-9)]
    rates += [expected_tokens(alphas, g) / max(cost.seconds(g), 1e-9) for g in range(1, gamma_max + 1)]
    best = max(range(gamma_max + 1), key=rates.__getitem__)
    return best if rates[best] > (1 + min_gain) * rates[0] else 0


# ----------------------------------------------------------------- estimators


@dataclasses.dataclass
class _DecayingLine:
    """Least-squares fit y ≈ a + b·x over observations weighted by decay^age."""

    decay: float
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        d = self.decay
        self.w, self.x, self.y = d * self.w + 1, d * self.x + x, d * self.y + y
        self.xx, self.xy = d * self.xx + x * x, d * self.xy + x * y

    def slope(self) -> float | None:
        """The fitted slope, or None while x has not varied enough to tell."""
        if self.w == 0:
            return None
        mean_x, mean_y = self.x / self.w, self.y / self.w
        var_x = self.xx / self.w - mean_x**2
        if var_x <= 0.05:
            return None
        return max(0.0, (self.xy / self.w - mean_x * mean_y) / var_x)

    def intercept(self, slope: float) -> float:
        """The line's value at x = 0, given its slope."""
        return max(0.0, (self.y - slope * self.x) / self.w) if self.w else 0.0

    def at(self, x: float) -> float | None:
        """The fitted value at ``x``: the mean of y while x has not varied enough
        to fit a slope; None with nothing seen."""
        if not self.w:
            return None
        slope = self.slope()
        return self.y / self.w if slope is None else self.intercept(slope) + slope * x

    def forget(self, keep: float) -> None:
        """Keep only ``keep`` of the weight of everything seen so far."""
        self.w, self.x, self.y, self.xx, self.xy = (v * keep for v in (self.w, self.x, self.y, self.xx, self.xy))


# From this many sessions per verifying pass on (a decayed mean), the verify
# slope is the passes' cost per token (see AdaptiveGamma).
SHARED_PASSES = 1.5


@dataclasses.dataclass
class AdaptiveGamma:
    """Chooses γ each round to maximise E(γ) / round_time(γ).

    Estimates, all from timings the round loop measures anyway:

    * α per draft position (decayed counts, shrunk towards the pooled α where a
      position has been tried rarely);
    * draft time (decayed means): per token from the gaps between streamed drafts, the rest
      (round trip, pre-fill of new tokens) as the fixed part;
    * verify time as a linear function of γ (decayed least squares; the fixed
      part holds the round trip to the target);
    * the load: how many sessions share the target's verifying pass, and the
      cost of a pass as a function of the tokens in it (decayed mean and least
      squares over the passes a batching target reports);
    * what a token costs without drafting, where a round without drafts brings
      ``plain_tokens`` tokens for one call: measured from such rounds, or until
      there are some, predicted as the verify line's intercept (the round trip
      and one pass) plus a one-token pass for each further token, over them all.

    Under load the goal is the tokens per second of the *system*, not of this
    session. In a pass shared by n sessions each draft this session adds costs
    every one of them the pass's per-token time b: with n alike sessions, total
    tokens/s n·E(γ) / (a + b·Σ(1 + γ)) is maximised where this session's
    E(γ) / (a' + n·b·γ) is, so the verify slope is n·b. While passes are shared,
    b comes from the passes (their time against their tokens), not from this
    session's round times against its γ: those also rise when the other
    sessions draft more, which they tend to do together (one learnt policy),
    and would count their drafts as this session's. Where the target's passes
    are cheap per token (a GPU far from saturation) γ stays; where they are not
    (a saturated target) γ falls, to 0 once a draft no longer pays for n times
    its verification -- vLLM turns speculation off at large batches for the
    same reason.

    Rounds that began with a pre-fill (a new prompt, or a side catching up after
    γ = 0 rounds) teach acceptance but not cost. Rounds without drafts that
    asked the target for several tokens teach what a token costs without
    drafting (one round trip for them all), not the verify line.

    Whether to draft at all (γ = 0 is plain target decoding) depends on state,
    because switching costs what the model leaves out (after γ = 0 rounds the
    draft must first catch up on the tokens it missed) and the estimates are
    noisy near the break-even point:

    * idle (the last round drafted nothing): drafting starts again only if it
      is predicted to gain more than ``min_gain`` (5 %);
    * drafting (including just after a probe, which has paid the catch-up): it
      goes on while it is predicted to pay at all, and also while α
      ``optimism`` standard errors above its estimate would make it pay (at
      the γ that α favours), so that a few unlucky rounds do not switch the
      draft off. Decay caps the evidence at ~33 rounds, so the margin never
      vanishes (~0.04 on α at half a standard error), and positions rarely
      tried get more of it. (Drafting at the γ the point estimates favour
      instead does worse near break-even: the simulation below shows it.)
    * too little seen: γ = 0 is not chosen while the first draft position has
      been tried fewer than ``min_trials`` times (decayed, carried evidence
      included); the policy drafts one token instead. Without it, a prompt
      whose first two drafts fail would switch a fresh policy off for the
      whole request, and the warm start would carry that into the next one.
    * a probe: after ``probe_every`` tokens without drafting, one draft (the cheapest
      question), so that a change in acceptance or cost is noticed; where a
      probe is expensive (a long round trip to the draft), not before its
      expected loss is at most ``probe_budget`` (1 %) of the time spent idle.

    ``scripts/simulate_adaptive_gamma.py`` checks these rules in synthetic
    worlds near break-even.

    The verify slope keeps its last determined value while γ stays put (a
    constant γ cannot tell fixed from per-token cost; taking the slope as 0
    would make every γ look equally cheap to verify).
    """

    gamma_max: int = 8
    initial_gamma: int = 4
    decay: float = 0.97
    prior_alpha: float = 0.6
    prior_weight: float = 2.0
    probe_every: int = 16
    min_gain: float = 0.05
    optimism: float = 0.5
    probe_budget: float = 0.01
    min_trials: float = 4.0
    plain_tokens: int = 1  # tokens a round without drafts asks the target for (rounds.Limits.plain_tokens)

    def __post_init__(self) -> None:
        if not 0.0 <= self.prior_alpha <= 1.0:
            raise ValueError(f"prior_alpha must be in [0, 1], got {self.prior_alpha}")
        if self.prior_weight <= 0 or self.optimism < 0 or self.probe_budget <= 0 or self.min_trials < 0:
            raise ValueError("prior_weight and probe_budget must be > 0, optimism and min_trials >= 0")
        self.initial_gamma = min(self.initial_gamma, self.gamma_max)
        self._tried = [0.0] * self.gamma_max
        self._accepted = [0.0] * self.gamma_max
        self._verify = _DecayingLine(self.decay)
        self._draft_fixed = _DecayingMean(self.decay)
        self._draft_per_token = _DecayingMean(self.decay)
        self._verify_slope = 0.0  # the last determined slope of verify time in γ
        self._load = _DecayingMean(self.decay)  # sessions sharing the verifying pass
        self._pass = _DecayingLine(self.decay)  # a verifying pass's seconds against its tokens
        self._plain = _DecayingMean(self.decay)  # seconds per token of rounds decoding several without drafts
        self._since_drafted = 0  # tokens since the last drafting round; carried into warm starts
        self._chosen = 0  # the γ last chosen (the round loop may clamp it at the end of a request)

    # -- estimates ------------------------------------------------------------

    def alphas(self) -> list[float]:
        pooled_tried, pooled_acc = sum(self._tried), sum(self._accepted)
        pooled = (pooled_acc + self.prior_weight * self.prior_alpha) / (pooled_tried + self.prior_weight)
        return [
            (a + self.prior_weight * pooled) / (t + self.prior_weight)
            for a, t in zip(self._accepted, self._tried, strict=True)
        ]

    def cost(self) -> RoundCost | None:
        if self._draft_fixed.value is None or self._verify.w == 0:
            return None
        slope = self._verify_slope
        load = self._load.value or 1.0
        pass_slope = self._pass.slope() if load >= SHARED_PASSES else None
        if pass_slope is not None:  # what one more token adds to a shared pass
            slope = pass_slope
        verify_fixed = self._verify.intercept(slope)
        return RoundCost(self._draft_fixed.value, self._draft_per_token.value, verify_fixed, slope * load,
                         self._plain_per_token(verify_fixed))

    def _plain_per_token(self, verify_fixed: float) -> float | None:
        """Seconds a token costs without drafting: as measured, or before any
        such round, predicted from a round's fixed cost (the round trip, one
        pass) and, for each further token a call brings, one pass of one token
        (from the passes the target reports); None if neither (one token a
        round: the verify line's intercept says it)."""
        if self._plain.value is not None:
            return self._plain.value
        one_pass = self._pass.at(1.0)
        if self.plain_tokens <= 1 or one_pass is None:
            return None
        return (verify_fixed + (self.plain_tokens - 1) * one_pass) / self.plain_tokens

    def for_new_request(self, carry: float = 0.25) -> AdaptiveGamma:
        """A copy to start the next request from: the round costs belong to the
        deployment and carry over whole; acceptance varies from prompt to prompt,
        so only ``carry`` of its evidence does (a new request's own rounds soon
        outweigh it, and the previous prompt's luck does not decide the start)."""
        new = copy.deepcopy(self)
        new._tried = [t * carry for t in self._tried]
        new._accepted = [a * carry for a in self._accepted]
        return new

    def acceptance(self) -> dict[str, list[float]]:
        """What this policy saw of acceptance, by draft position (plain lists):
        what a session carries to its next turn, on whichever coordinator."""
        return {"tried": list(self._tried), "accepted": list(self._accepted)}

    def continue_session(self, seen: dict, carry: float = 0.5) -> None:
        """Start from the acceptance a session's last turn saw (:meth:`acceptance`)
        instead of the last request's: the same conversation, so more of its
        evidence carries over than between strangers. Ignored if its γ range differs."""
        tried, accepted = list(seen.get("tried", ())), list(seen.get("accepted", ()))
        if len(tried) == len(accepted) == self.gamma_max:
            self._tried = [float(t) * carry for t in tried]
            self._accepted = [float(a) * carry for a in accepted]

    def describe(self) -> str:
        """The estimates in one line, for logs (why γ is what it is)."""
        cost = self.cost()
        costs = "no cost measured yet" if cost is None else (
            f"draft {cost.draft_fixed * 1e3:.2f} ms + {cost.draft_per_token * 1e3:.2f} ms/token, "
            f"verify {cost.verify_fixed * 1e3:.2f} ms + {cost.verify_per_token * 1e3:.2f} ms/token, "
            f"{cost.plain_seconds_per_token() * 1e3:.2f} ms a token without drafting")
        alphas = " ".join(f"{a:.2f}" for a in self.alphas()[:6])
        load = f"; {self._load.value:.1f} sessions per verifying pass" if (self._load.value or 1) > 1 else ""
        return (f"{costs}{load}; α by position {alphas}; best γ {self.best()}"
                f"{f', idle {self._since_drafted} tokens' if self.idle else ''}")

    # -- policy ---------------------------------------------------------------

    def optimistic_alphas(self) -> list[float]:
        """α per position ``optimism`` standard errors above the estimate: what
        acceptance could still be, given how little of it has been seen."""
        return [
            min(1.0, a + self.optimism * math.sqrt(max(0.0, a * (1 - a)) / (t + self.prior_weight)))
            for a, t in zip(self.alphas(), self._tried, strict=True)
        ]

    @property
    def idle(self) -> bool:
        """Whether the last round drafted nothing (by this policy's choice)."""
        return self._since_drafted > 0

    def best(self) -> int:
        """The γ the estimates favour, given whether the draft is idle (see the
        class docstring); no probing."""
        cost = self.cost()
        if cost is None:  # nothing measured yet
            return self.initial_gamma
        alphas = self.alphas()
        if self.idle:
            return best_gamma(alphas, cost, self.gamma_max, self.min_gain)
        gamma = best_gamma(alphas, cost, self.gamma_max)
        if gamma == 0:  # not ruled out yet: draft as if the optimistic α held
            gamma = best_gamma(self.optimistic_alphas(), cost, self.gamma_max)
        if gamma == 0 and self.gamma_max and self._tried[0] < self.min_trials:  # too little seen to rule it out
            gamma = 1
        return gamma

    def choose(self) -> int:
        """γ for the next round: :meth:`best`, or a one-draft probe when due."""
        gamma = self.best()
        if gamma == 0 and self.gamma_max and self._probe_due():
            gamma = 1
        self._chosen = gamma
        return gamma

    def _probe_due(self) -> bool:
        """After ``probe_every`` tokens without drafting, and once the probe's
        expected loss (the time its round takes beyond what its expected tokens
        take at γ = 0) is at most ``probe_budget`` of the time spent since."""
        if self._since_drafted < self.probe_every:
            return False
        cost = self.cost()
        if cost is None:
            return True
        plain = cost.plain_seconds_per_token()
        loss = cost.seconds(1) - expected_tokens(self.alphas(), 1) * plain
        return loss <= self.probe_budget * self._since_drafted * plain

    def _check_verify_slope(self, gamma: int, verify_s: float) -> None:
        """A probe verifies ``gamma`` drafts after idle rounds, which keep the
        intercept fresh: the rise over it bounds the slope. Where it falls well
        below the slope in use, that slope came from a spell that is over (the
        first passes of fresh services are slow, each new number of tokens
        once): keep a tenth of the fit's history and the probe's slope, so that
        it does not keep the draft idle. (Seen in ``specdec demo``: an 8-token
        warm-up left 2.5–5.5 ms per token, against ~0.6, and the measured
        request drafted in 6 of 124 rounds.)"""
        intercept = self._verify.intercept(self._verify_slope)
        bound = max(0.0, (verify_s - intercept) / gamma)
        if bound < self._verify_slope / 2:
            self._verify.forget(0.1)
            self._verify_slope = bound

    def observe(self, result: RoundResult) -> None:
        g, n = result.gamma, result.accepted
        d = self.decay
        probe = bool(g) and self.idle
        if g:
            self._since_drafted = 0
            # Old acceptance evidence fades as drafting goes on (acceptance
            # drifts with the text). Rounds that draft nothing bring no evidence
            # to replace it, so they leave it be.
            self._tried = [t * d for t in self._tried]
            self._accepted = [a * d for a in self._accepted]
        elif not self._chosen:  # not a round the end of the request clamped to γ = 0
            self._since_drafted += len(result.tokens)
        # Drafts 1..n were accepted; draft n+1 (if any) was tried and rejected.
        for i in range(min(g, n + 1, self.gamma_max)):
            self._tried[i] += 1
            if i < n:
                self._accepted[i] += 1
        passes = result.verify_passes
        self._load.add(max(1.0, passes.sequences) if passes is not None else 1.0)
        if passes is not None and passes.seconds > 0:
            self._pass.add(passes.tokens, passes.seconds)
        verify_s = result.verify_s
        if result.decoded and not result.target_caught_up:  # several tokens for one call, one pass each
            self._plain.add(verify_s / (1 + result.decoded))
            if passes is None:  # no pass time to tell the call's own cost by
                verify_s = None
            else:  # the call as if it had decoded nothing: what keeps the verify line's intercept fresh
                verify_s = max(0.0, verify_s - result.decoded * passes.seconds)
        if not result.target_caught_up and verify_s is not None:  # a pre-fill is not what a round costs
            if probe:
                self._check_verify_slope(g, verify_s)
            self._verify.add(g, verify_s)
            slope = self._verify.slope()
            if slope is not None:
                self._verify_slope = slope
        if g:
            per_token, fixed = self._draft_per_token, self._draft_fixed
            gap = None
            if g >= 2 and result.draft_first_s is not None:
                # Gaps between streamed drafts: per-token cost even after a catch-up.
                gap = (result.draft_s - result.draft_first_s) / (g - 1)
                per_token.add(gap)
            elif per_token.value is None:
                per_token.add(result.draft_s / g)
            this_token = per_token.value if gap is None else gap
            if not result.draft_caught_up:
                fixed.add(max(0.0, result.draft_s - this_token * g))
            elif fixed.value is not None:
                # A catch-up call (after idle rounds: a probe) did more than a
                # round's work, so it bounds what a round's drafts cost,
                # fixed + per-token·γ, from above. That undoes at once what a slow
                # spell (a cold start, a busy machine) taught, which no drafting
                # round corrects while the draft idles. (Not in other rounds: a
                # draft made ahead during the last verification arrives at once
                # and would look free.)
                if gap is not None:  # per-token measured now: the rest bounds the fixed part
                    fixed.cap(max(0.0, result.draft_s - gap * g))
                else:  # one draft cannot tell which part is off: both shrink alike
                    predicted = fixed.value + per_token.value * g
                    if predicted > result.draft_s:
                        fixed.scale(result.draft_s / predicted)
                        per_token.scale(result.draft_s / predicted)


@dataclasses.dataclass
class _DecayingMean:
    """The mean of observations weighted by decay^age. Early on it is the plain
    mean of the few seen, so one slow first call weighs no more than the others
    (an exponential average started from the first value would keep ~90 % of it
    after four more); later it moves like an exponential average, remembering
    ~1 / (1 − decay) observations."""

    decay: float
    w: float = 0.0
    total: float = 0.0

    def add(self, x: float) -> None:
        self.w = self.decay * self.w + 1
        self.total = self.decay * self.total + x

    def cap(self, x: float) -> None:
        """Lower the mean to ``x`` if it is above (its weight stays)."""
        if self.w and self.total > x * self.w:
            self.total = x * self.w

    def scale(self, factor: float) -> None:
        self.total *= factor

    @property
    def value(self) -> float | None:
        return self.total / self.w if self.w else None


# ----------------------------------------------------------------- parsing


def parse_gamma_spec(spec: str) -> tuple[str, int | None]:
    """``static:N`` | ``heuristic`` | ``adaptive`` -> (kind, N or None); ValueError
    naming the problem otherwise."""
    text = spec.strip().lower()
    if text.startswith("static:"):
        try:
            return "static", int(text[len("static:"):])
        except ValueError:
            raise ValueError(f"gamma_policy {excerpt(spec)}: static:N needs an integer N") from None
    if text in ("heuristic", "adaptive"):
        return text, None
    raise ValueError(f"gamma_policy {excerpt(spec)} is not understood: use 'static:N', 'heuristic' or 'adaptive'")


def parse_gamma_policy(spec: str, gamma_max: int, plain_tokens: int = 1) -> GammaPolicy:
    """``static:N`` | ``heuristic`` | ``adaptive`` -> a fresh policy; ValueError
    naming the problem otherwise. ``plain_tokens``: what a round without drafts
    brings (adaptive weighs not drafting by it)."""
    kind, gamma = parse_gamma_spec(spec)
    if kind == "static":
        if not 0 <= gamma <= gamma_max:
            raise ValueError(f"gamma_policy {excerpt(spec)}: gamma must be in [0, {gamma_max}], got {gamma}")
        return StaticGamma(gamma)
    if kind == "heuristic":
        # gamma_max 0 (speculation off): γ starts at 0, and a round drafting nothing changes nothing
        return HeuristicGamma(gamma=min(HeuristicGamma.gamma, gamma_max), gamma_max=gamma_max)
    return AdaptiveGamma(gamma_max=gamma_max, initial_gamma=min(4, gamma_max), plain_tokens=plain_tokens)
