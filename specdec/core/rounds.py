"""The speculative round, written once: propose -> verify -> commit.

The loop here does not know where the models are. It talks to a *proposer* (the
draft: extend the session by γ tokens) and a *verifier* (the target: check the
drafts, return how many are accepted and the next token). The in-process decoder
plugs in local models; the coordinator plugs in gRPC clients of the draft and
target services, which themselves wrap the same local implementations. It
reports each round to an *observer* (the coordinator's makes spans and metrics)
and knows nothing of telemetry itself.

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
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterator

from specdec.core.gamma import GammaPolicy
from specdec.core.interfaces import (
    NO_OBSERVER,
    DraftToken,
    Proposer,
    RoundObserver,
    RoundResult,
    SamplingParams,
    SessionState,
    StopCondition,
    Verifier,
)


@dataclasses.dataclass(frozen=True)
class Limits:
    """When generation ends, besides the target choosing an EOS token."""

    max_new_tokens: int
    context: int  # the longest sequence both models can hold
    eos_token_ids: frozenset[int] = frozenset()
    stop: StopCondition | None = None
    plain_tokens: int = 1  # tokens a round without drafts asks of the target


def run_rounds(
    proposer: Proposer | None,
    verifier: Verifier,
    state: SessionState,
    *,
    params: SamplingParams,
    gamma_policy: GammaPolicy,
    limits: Limits,
    observer: RoundObserver = NO_OBSERVER,
) -> Iterator[RoundResult]:
    """Generate after ``state.tokens`` (which already ends with the prompt) until
    a limit ends it; one result per round, the last with its ``finish_reason``.

    ``params.seed`` must be set: both sides derive their randomness from it."""
    generated = 0
    for index in itertools.count():
        room = min(limits.max_new_tokens - generated, limits.context - len(state.tokens))
        if room <= 0:
            return
        # The last token of a round always comes from the target, so γ ≤ room - 1.
        gamma = 0 if proposer is None else max(0, min(gamma_policy.choose(), room - 1))
        decode = 0 if gamma or not generated else min(limits.plain_tokens, room) - 1
        observer.round_started(index)
        try:
            result = _one_round(proposer, verifier, state, gamma, decode, params)
            result = _commit(result, state, limits, limits.max_new_tokens - generated, room)
        except BaseException as e:
            observer.round_failed(e)
            raise
        observer.round_finished(result)
        generated += len(result.tokens)
        gamma_policy.observe(result)
        yield result
        if result.finish_reason:
            return


def _one_round(proposer: Proposer | None, verifier: Verifier, state: SessionState, gamma: int, decode: int,
               params: SamplingParams) -> RoundResult:
    """Draft γ tokens, verify them; the result's ``tokens`` are what the target
    accepted plus its own next token (and the ``decode`` more it was asked for),
    not yet committed."""
    # Normally each side lacks just the last round's token; more is pre-fill.
    draft_behind = max(0, len(state.tokens) - state.draft_synced - 1) if gamma else 0
    target_behind = max(0, len(state.tokens) - state.target_synced - 1)
    t0 = time.perf_counter()
    drafts: list[DraftToken] = []
    first = None
    if gamma:
        for draft in proposer.propose(state.draft_synced, state.tokens[state.draft_synced:], gamma, params):
            drafts.append(draft)
            first = first or time.perf_counter() - t0
    t1 = time.perf_counter()
    verdict = verifier.verify(state.target_synced, state.tokens[state.target_synced:], drafts, params, decode)
    t2 = time.perf_counter()
    decoded = verdict.decoded[:decode]
    tokens = [d.token for d in drafts[: verdict.accepted]] + [verdict.next_token, *decoded]
    return RoundResult(tokens, len(drafts), verdict.accepted, t1 - t0, t2 - t1, None, first,
                       draft_behind if drafts else 0, target_behind, verdict.passes, len(decoded))


def _commit(result: RoundResult, state: SessionState, limits: Limits, budget: int, room: int) -> RoundResult:
    """Append the round's tokens to ``state``, cut at the first finish condition."""
    tokens, finish = _cut(result.tokens, limits, budget, room)
    base = len(state.tokens)
    state.tokens.extend(tokens)
    if result.gamma:
        state.draft_synced = min(base + result.accepted, len(state.tokens))
    state.target_synced = len(state.tokens)
    return dataclasses.replace(result, tokens=tokens, finish_reason=finish)


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
