"""Choosing γ, the number of tokens drafted per round.

A policy is asked for γ before each round and told the outcome after it. The
round loop clamps its answer to what is left to generate.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol


class GammaPolicy(Protocol):
    def choose(self) -> int: ...

    def observe(self, gamma: int, accepted: int, draft_s: float, verify_s: float) -> None: ...


@dataclasses.dataclass
class StaticGamma:
    """The same γ every round."""

    gamma: int

    def choose(self) -> int:
        return self.gamma

    def observe(self, gamma: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass


@dataclasses.dataclass
class HeuristicGamma:
    """Hugging Face assisted generation's schedule: +2 after a round whose drafts
    were all accepted, -1 otherwise (never below 1)."""

    gamma: int = 5
    gamma_max: int = 16

    def choose(self) -> int:
        return self.gamma

    def observe(self, gamma: int, accepted: int, draft_s: float, verify_s: float) -> None:
        if gamma == 0:
            return
        if accepted == gamma:
            self.gamma = min(self.gamma + 2, self.gamma_max)
        else:
            self.gamma = max(self.gamma - 1, 1)
