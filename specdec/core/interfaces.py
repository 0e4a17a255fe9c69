"""What the round loop talks to, and what it hands back.

Terms, for one round:

* a **draft** is a token the proposer (the draft model) sampled from its
  distribution q; a round drafts γ of them;
* **accepted** drafts are the prefix the verifier (the target model) keeps;
* the **next token** is the target's own: the *correction* sampled at the
  first rejected position, or the *bonus* token after γ accepted drafts.

A round therefore commits ``accepted + 1`` tokens, fewer only when generation
ends inside it (EOS, the token budget, the context, a stop sequence). A round
without drafts may ask the target to **decode** more tokens alone after its
next token (plain target decoding, several tokens for one call): it commits
those too.

This module imports neither torch nor anything above the core, so that
clients, configuration and ``--help`` can name these types cheaply.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from specdec.core.text import excerpt

if TYPE_CHECKING:
    from specdec.core.sampling import Distribution

# Under sampling the draft samples from its top-k tokens and ships that sparse q
# (exact: q is what it sampled from) as (id, prob) pairs, ~6 bytes each on the
# wire, against vocab x 4 bytes per draft for a dense q; both cross twice.
# Truncation changes q, so it can lower acceptance when the draft's distribution
# is flat: with the bundled pair (t = 0.8, top-p 0.95, γ = 4) accepted/proposed
# was 0.41 dense, 0.39 at k = 256, 0.32 at k = 64. 0 = dense. The in-process
# decoder and the coordinator share this default, so one seed gives the same
# tokens in both.
DEFAULT_DRAFT_TOP_K = 256


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. ``temperature == 0`` means greedy (argmax).

    ``top_k == 0`` and ``top_p == 1.0`` disable those filters. ``seed`` makes
    sampling reproducible under the same γ schedule (a drafted position and a
    correction or bonus position draw their token from different streams);
    ``None`` lets the decoder pick one per request.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        validate_sampling(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_seed(self) -> SamplingParams:
        """This, with a fresh random seed filled in if none was given."""
        if self.seed is not None:
            return self
        return dataclasses.replace(self, seed=random.getrandbits(63))


def validate_sampling(params: SamplingParams) -> None:
    """Raise ValueError naming the bad field (used by the dataclass and by servers)."""
    t, k, p = params.temperature, params.top_k, params.top_p
    if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {excerpt(t)}")
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = disabled), got {excerpt(k)}")
    if not isinstance(p, (int, float)) or math.isnan(p) or not (0.0 < p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {excerpt(p)}")
    if params.seed is not None and (not isinstance(params.seed, int) or params.seed < 0):
        raise ValueError(f"seed must be a non-negative integer, got {excerpt(params.seed)}")


@dataclasses.dataclass(frozen=True)
class DraftToken:
    token: int
    q: Distribution | None  # what it was sampled from; None under greedy


@dataclasses.dataclass(frozen=True)
class PassLoad:
    """The target's forward passes a verification ran in, on average: what the
    adaptive policy learns a pass's cost from, and the load from."""

    sequences: float  # sessions per pass (this one among them)
    tokens: float  # new tokens per pass, over all its sessions
    seconds: float  # time of one pass


@dataclasses.dataclass(frozen=True)
class Verdict:
    accepted: int  # how many drafts were accepted (0..γ)
    next_token: int  # the correction (if accepted < γ) or the bonus token
    passes: PassLoad | None = None  # the forward passes it ran in (a batching target reports them)
    decoded: tuple[int, ...] = ()  # tokens the target then decoded alone, after next_token (``decode``)


@dataclasses.dataclass(frozen=True)
class Propose:
    """Ask the draft: roll back to ``position``, append ``new_tokens`` and draft
    ``gamma`` tokens (round ``round_id``)."""

    round_id: int
    position: int
    new_tokens: list[int]
    gamma: int
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Verify:
    """Ask the target: roll back to ``position``, append ``new_tokens`` and judge
    ``drafts``; then decode up to ``decode`` more tokens alone (round ``round_id``)."""

    round_id: int
    position: int
    new_tokens: list[int]
    drafts: list[DraftToken]
    decode: int
    params: SamplingParams


class SessionLost(Exception):
    """Raised by a side whose service no longer holds the session (evicted,
    restarted, or the turn moved to another replica): the round machine asks
    again from position 0 with the whole history."""

    def __init__(self, side: str, cause: str = ""):
        super().__init__(f"the {side} lost the session" + (f": {cause}" if cause else ""))
        self.side, self.cause = side, cause


class Proposer(Protocol):
    def propose(self, call: Propose) -> Iterator[DraftToken]:
        """Roll back to ``call.position``, append ``call.new_tokens`` and draft
        ``call.gamma`` tokens, yielding each as soon as it is drafted (with the q
        it was sampled from, under sampling: the proposer's own, e.g. its top-k).
        It may yield fewer (a remote draft that failed): the round verifies
        what it got, and the output is the target's all the same. Raises
        :class:`SessionLost` before yielding when it no longer holds the session."""


class Verifier(Protocol):
    def verify(self, call: Verify) -> Verdict:
        """Roll back to ``call.position``, append ``call.new_tokens`` and judge
        ``call.drafts``; afterwards hold the accepted drafts and the next token.
        Then decode up to ``call.decode`` more tokens alone (plain target
        decoding, exactly as rounds without drafts would make them), stopping
        after an end-of-sequence token, and hold those too: ``Verdict.decoded``.
        Raises :class:`SessionLost` when it no longer holds the session."""


@dataclasses.dataclass(frozen=True)
class Drafted:
    """A proposer's drafts for one call, all at once, and when the first of them
    existed (seconds after the call began, as the caller sees it; None: not known)."""

    drafts: list[DraftToken]
    first_s: float | None = None


class AsyncProposer(Protocol):
    async def propose(self, call: Propose) -> Drafted:
        """:meth:`Proposer.propose`, awaited: every draft in one answer."""


class AsyncVerifier(Protocol):
    async def verify(self, call: Verify) -> Verdict:
        """:meth:`Verifier.verify`, awaited."""


@dataclasses.dataclass
class SessionState:
    """The committed sequence (prompt and generated tokens), and how long a
    prefix of it each side is known to hold."""

    tokens: list[int]
    draft_synced: int = 0
    target_synced: int = 0


@dataclasses.dataclass(frozen=True)
class RoundResult:
    tokens: list[int]  # committed this round (accepted drafts + next token + decoded, maybe cut short)
    gamma: int  # drafts the round verified (the policy's γ, or fewer if the proposer sent fewer)
    accepted: int
    draft_s: float  # from asking for drafts to holding all of them
    verify_s: float
    finish_reason: str | None  # "eos" | "length" | "stop" | None while generating
    draft_first_s: float | None = None  # until the first draft arrived (the rest is per-token drafting)
    # History tokens each side ran before this round's own work (beyond the one
    # token of the last round): a pre-fill, or the draft catching up after γ = 0.
    draft_caught_up: int = 0
    target_caught_up: int = 0
    verify_passes: PassLoad | None = None  # the target's passes the verification ran in, when reported
    decoded: int = 0  # tokens the target decoded alone after its next token (one pass each), before any cut


class RoundObserver(Protocol):
    """What the round loop reports to; it knows nothing else of telemetry.

    ``round_started`` comes before the round's first call to either side, and
    then exactly one of ``round_finished`` (with the round's result) or
    ``round_failed`` (with what the round raised), before the loop yields."""

    def round_started(self, index: int) -> None: ...

    def round_finished(self, result: RoundResult) -> None: ...

    def round_failed(self, error: BaseException) -> None: ...


class NoObserver:
    """Sees every round and does nothing."""

    def round_started(self, index: int) -> None:
        pass

    def round_finished(self, result: RoundResult) -> None:
        pass

    def round_failed(self, error: BaseException) -> None:
        pass


NO_OBSERVER = NoObserver()


class StopCondition(Protocol):
    """A finish condition beyond EOS and the token budget: a stop sequence."""

    def stop_after(self, tokens: list[int]) -> int | None:
        """Shown each round's committed tokens in order: None to go on, or
        how many of them to keep (up to the one completing the stop sequence)
        when generation ends among them."""
