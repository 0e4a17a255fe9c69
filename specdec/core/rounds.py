"""The speculative round, written once, as a step machine: propose -> verify -> commit.

:class:`RoundMachine` does no I/O and does not know where the models are. It
says what it needs next -- a :class:`Propose` (the draft: extend the session by
γ tokens) or a :class:`Verify` (the target: judge the drafts, return how many
are accepted and the next token) -- and is handed the results. It alone owns the
session's positions, its round ids, re-pre-fills and cuts: a side never moves a
position itself, it only reports that it lost the session (:meth:`lost`), and
the machine asks again from position 0 with the whole history.

Two thin drivers run it: :func:`run_machine` calls a synchronous proposer and
verifier (the in-process decoder's local models, through :func:`run_rounds`),
:func:`run_rounds_async` awaits asynchronous ones (the coordinator's gRPC
clients, on its event loop).
Both report each round to an *observer* (the coordinator's makes spans and
metrics); the machine knows nothing of telemetry.

Position bookkeeping. ``state.tokens`` is the committed sequence (prompt and
generated tokens). Each side holds some sequence of its own; ``draft_synced`` and
``target_synced`` are how long a prefix of ``state.tokens`` each is known to hold.
A call passes that position and the committed tokens after it; the side rolls
back to the position and appends them. After a round with n of γ drafts accepted:

* the draft holds tokens + all γ drafts, of which the first n are now committed;
* the target rolled itself back to tokens + n drafts and appended its next token
  (and the tokens it was asked to decode alone after it), so it holds exactly
  the new committed sequence, its last token not yet run.

A round without drafts is plain target decoding; it may ask the target for
several tokens at once (``Limits.plain_tokens``: one call, and one round trip,
for several tokens), which the target decodes exactly as that many one-token
rounds would. The first round of a request asks for one, so that the first
token comes as soon as the pre-fill is done.

A round cut short (EOS, budget, context, stop sequence) commits a prefix of
that, so both sides still hold at least what their ``synced`` position says.

Round ids. A Propose and the Verify of one round share an id (they go to
different services); a repeated call reuses it, so a service that already
applied it answers from its record. A re-pre-fill takes a fresh id: the side
now asked may have applied the round's first form (the turn left it, and came
back).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator

from specdec.core.gamma import GammaPolicy
from specdec.core.interfaces import (
    NO_OBSERVER,
    AsyncProposer,
    AsyncVerifier,
    DraftToken,
    Propose,
    Proposer,
    RoundObserver,
    RoundResult,
    SamplingParams,
    SessionLost,
    SessionState,
    StopCondition,
    Verdict,
    Verifier,
    Verify,
)

__all__ = ["Limits", "Propose", "RoundMachine", "Verify", "run_machine", "run_rounds", "run_rounds_async"]


@dataclasses.dataclass(frozen=True)
class Limits:
    """When generation ends, besides the target choosing an EOS token."""

    max_new_tokens: int
    context: int  # the longest sequence both models can hold
    eos_token_ids: frozenset[int] = frozenset()
    stop: StopCondition | None = None
    plain_tokens: int = 1  # tokens a round without drafts asks of the target


@dataclasses.dataclass
class _Open:
    """The round in progress."""

    gamma: int
    decode: int
    drafts: list[DraftToken] | None = None  # None until proposed (or with γ = 0, never asked)
    draft_s: float = 0.0
    first_s: float | None = None
    draft_from: int | None = None  # the position of the round's last Propose / Verify
    target_from: int = 0


class RoundMachine:
    """One request's rounds over ``state``, which already ends with the prompt.

    Drive it: ``call = next_call()`` until None; answer a Propose with
    :meth:`proposed`, a Verify with :meth:`verified` (which commits the round and
    returns it), a side that no longer holds the session with :meth:`lost`, and
    a call that raised with :meth:`failed`. ``params.seed`` must be set: both
    sides derive their randomness from it."""

    def __init__(self, state: SessionState, *, params: SamplingParams, gamma_policy: GammaPolicy, limits: Limits,
                 drafting: bool = True, round_id: int = 1, observer: RoundObserver = NO_OBSERVER):
        self.state, self.params, self.policy, self.limits = state, params, gamma_policy, limits
        self.drafting, self.observer = drafting, observer
        self.round_id = round_id  # the id of the round in progress, or of the next one
        self.generated = 0
        self.rounds = 0  # committed
        self.finish_reason: str | None = None
        self._open: _Open | None = None

    @property
    def room(self) -> int:
        """Tokens this request may still commit."""
        return min(self.limits.max_new_tokens - self.generated, self.limits.context - len(self.state.tokens))

    def next_call(self) -> Propose | Verify | None:
        """What the round in progress needs next (starting one if none is), or
        None when generation has ended."""
        if self._open is None:
            if self.finish_reason or self.room <= 0:
                return None
            self._open = self._start()
        r, state = self._open, self.state
        if r.gamma and r.drafts is None:
            r.draft_from = state.draft_synced
            return Propose(self.round_id, state.draft_synced, state.tokens[state.draft_synced:], r.gamma, self.params)
        r.target_from = state.target_synced
        return Verify(self.round_id, state.target_synced, state.tokens[state.target_synced:], r.drafts or [],
                      r.decode, self.params)

    def _start(self) -> _Open:
        # The last token of a round always comes from the target, so γ ≤ room - 1.
        room = self.room
        gamma = max(0, min(self.policy.choose(), room - 1)) if self.drafting else 0
        decode = 0 if gamma or not self.generated else min(self.limits.plain_tokens, room) - 1
        self.observer.round_started(self.rounds)
        return _Open(gamma, decode)

    def proposed(self, drafts: list[DraftToken], seconds: float = 0.0, first_s: float | None = None) -> None:
        """The draft's answer: the drafts it made (it may send fewer than γ, none
        included: the round verifies what it got, and the output is the target's
        all the same)."""
        r = self._require(Propose)
        r.drafts, r.draft_s, r.first_s = list(drafts), seconds, first_s

    def verified(self, verdict: Verdict, seconds: float = 0.0) -> RoundResult:
        """The target's answer: the round commits (cut at the first finish
        condition) and is returned."""
        r, state = self._require(Verify), self.state
        drafts = r.drafts or []
        decoded = list(verdict.decoded[:r.decode])
        tokens = [d.token for d in drafts[:verdict.accepted]] + [verdict.next_token, *decoded]
        # History tokens each side ran before the round's own work: normally just
        # the last round's token; more is a pre-fill (or the draft catching up).
        draft_behind = max(0, len(state.tokens) - r.draft_from - 1) if drafts and r.draft_from is not None else 0
        target_behind = max(0, len(state.tokens) - r.target_from - 1)
        kept, finish = _cut(tokens, self.limits, self.limits.max_new_tokens - self.generated, self.room)
        base = len(state.tokens)
        state.tokens.extend(kept)
        if drafts:
            state.draft_synced = min(base + verdict.accepted, len(state.tokens))
        state.target_synced = len(state.tokens)
        result = RoundResult(kept, len(drafts), verdict.accepted, r.draft_s, seconds, finish, r.first_s,
                             draft_behind, target_behind, verdict.passes, len(decoded))
        self._open, self.round_id, self.rounds = None, self.round_id + 1, self.rounds + 1
        self.generated += len(kept)
        self.finish_reason = finish
        self.observer.round_finished(result)
        self.policy.observe(result)
        return result

    def lost(self, side: str) -> None:
        """``side`` ("draft" | "target") no longer holds the session (it evicted
        it, restarted, or the turn moved to another replica): its next call
        starts from position 0 with the whole history, under a fresh round id."""
        if side not in ("draft", "target"):
            raise ValueError(f"side must be 'draft' or 'target', got {side!r}")
        setattr(self.state, f"{side}_synced", 0)
        self.round_id += 1

    def failed(self, error: BaseException) -> None:
        """A call of the round in progress raised ``error``: the round is over,
        nothing of it committed (the caller decides whether the turn goes on)."""
        if self._open is not None:
            self._open = None
            self.observer.round_failed(error)

    def _require(self, kind: type) -> _Open:
        r = self._open
        expected = Propose if r is not None and r.gamma and r.drafts is None else Verify
        if r is None or kind is not expected:
            raise RuntimeError(f"the machine is not waiting for a {kind.__name__} answer")
        return r


def _cut(new: list[int], limits: Limits, budget: int, room: int) -> tuple[list[int], str | None]:
    """The round's tokens up to the first EOS (kept) or the end of the token
    budget or the context; then up to a stop sequence (the token completing it
    kept), which the stop condition sees only among tokens that are kept."""
    finish = None
    eos = next((i for i, tok in enumerate(new) if tok in limits.eos_token_ids), None)
    if eos is not None:
        new, finish = new[: eos + 1], "eos"
    elif len(new) >= min(budget, room):
        new, finish = new[: min(budget, room)], "length"
    if limits.stop is not None:
        kept = limits.stop.stop_after(new)
        if kept is not None:
            return new[:kept], "stop"
    return new, finish


# ----------------------------------------------------------------- drivers


def run_rounds(proposer: Proposer | None, verifier: Verifier, state: SessionState, *, params: SamplingParams,
               gamma_policy: GammaPolicy, limits: Limits, observer: RoundObserver = NO_OBSERVER
               ) -> Iterator[RoundResult]:
    """Generate after ``state.tokens`` with synchronous sides; one result per
    round as it commits, the last with its ``finish_reason``."""
    machine = RoundMachine(state, params=params, gamma_policy=gamma_policy, limits=limits,
                           drafting=proposer is not None, observer=observer)
    return run_machine(proposer, verifier, machine)


def run_machine(proposer: Proposer | None, verifier: Verifier, machine: RoundMachine) -> Iterator[RoundResult]:
    """Drive ``machine`` with synchronous sides: each call it asks for, answered."""
    while (call := machine.next_call()) is not None:
        t0 = time.perf_counter()
        try:
            if isinstance(call, Propose):
                drafts, first = [], None
                for draft in proposer.propose(call):
                    drafts.append(draft)
                    first = first or time.perf_counter() - t0
                machine.proposed(drafts, time.perf_counter() - t0, first)
            else:
                result = machine.verified(verifier.verify(call), time.perf_counter() - t0)
        except SessionLost as e:
            machine.lost(e.side)
            continue
        except BaseException as e:
            machine.failed(e)
            raise
        if isinstance(call, Verify):
            yield result


async def run_rounds_async(proposer: AsyncProposer | None, verifier: AsyncVerifier, machine: RoundMachine
                           ) -> AsyncIterator[RoundResult]:
    """:func:`run_machine` for sides whose calls are awaited."""
    while (call := machine.next_call()) is not None:
        t0 = time.perf_counter()
        try:
            if isinstance(call, Propose):
                drafted = await proposer.propose(call)
                machine.proposed(drafted.drafts, time.perf_counter() - t0, drafted.first_s)
            else:
                result = machine.verified(await verifier.verify(call), time.perf_counter() - t0)
        except SessionLost as e:
            machine.lost(e.side)
            continue
        except BaseException as e:
            machine.failed(e)
            raise
        if isinstance(call, Verify):
            yield result
