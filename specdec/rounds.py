"""The speculative round, written once: propose -> verify -> commit.

The loop here does not know where the models are. It talks to a *proposer* (the
draft: extend the session by γ tokens) and a *verifier* (the target: check the
drafts, return how many are accepted and the next token). The in-process decoder
plugs in local models; the coordinator plugs in gRPC clients of the draft and
target services, which themselves wrap the same local implementations.

Position bookkeeping. ``state.tokens`` is the committed sequence (prompt and
generated tokens). Each side holds some sequence of its own; ``draft_synced`` and
``target_synced`` are how long a prefix of ``state.tokens`` each is known to hold.
A call passes that position and the committed tokens after it; the side rolls
back to the position and appends them. After a round with n of γ drafts accepted:

* the draft holds tokens + all γ drafts, of which the first n are now committed;
* the target rolled itself back to tokens + n drafts and appended its next token,
  so it holds exactly the new committed sequence (the next token not yet run).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Iterator, Protocol

import torch

from specdec.gamma import GammaPolicy
from specdec.sampling import SamplingParams, SparseDist
from specdec.telemetry import TRACE_ONLY, RoundObserver
from specdec.verification import Verdict


Distribution = torch.Tensor | SparseDist  # dense float32 [V], or sparse


@dataclasses.dataclass(frozen=True)
class DraftToken:
    token: int
    q: Distribution | None  # what it was sampled from; None under greedy


class Proposer(Protocol):
    def propose(
        self, position: int, new_tokens: list[int], gamma: int, params: SamplingParams, draft_top_k: int
    ) -> Iterator[DraftToken]:
        """Roll back to ``position``, append ``new_tokens`` and draft ``gamma``
        tokens, yielding each as soon as it is drafted."""


class Verifier(Protocol):
    def verify(
        self, position: int, new_tokens: list[int], drafts: list[DraftToken], params: SamplingParams
    ) -> Verdict:
        """Roll back to ``position``, append ``new_tokens`` and judge ``drafts``;
        afterwards hold the accepted drafts and the next token."""


@dataclasses.dataclass
class SessionState:
    tokens: list[int]
    draft_synced: int = 0
    target_synced: int = 0


@dataclasses.dataclass(frozen=True)
class RoundResult:
    tokens: list[int]  # committed this round (accepted drafts + next token, maybe cut short)
    gamma: int
    accepted: int
    draft_s: float  # from asking for drafts to holding all of them
    verify_s: float
    finish_reason: str | None  # "eos" | "length" | None while generating
    draft_first_s: float | None = None  # until the first draft arrived (the rest is per-token drafting)
    # History tokens each side ran before this round's own work (beyond the one
    # token of the last round): a pre-fill, or the draft catching up after γ = 0.
    draft_caught_up: int = 0
    target_caught_up: int = 0


def dense_rows(qs: list[Distribution], vocab_size: int, device: torch.device) -> torch.Tensor:
    """Stack draft distributions into a dense [γ, V] float32 tensor."""
    if qs and not any(isinstance(q, SparseDist) for q in qs):
        return torch.stack(qs).to(device, torch.float32)  # already dense: one op
    out = torch.zeros(len(qs), vocab_size, dtype=torch.float32, device=device)
    for i, q in enumerate(qs):
        if isinstance(q, SparseDist):
            out[i].index_copy_(0, q.ids.to(device), q.probs.to(device, torch.float32))
        else:
            out[i].copy_(q)
    return out


def run_rounds(
    proposer: Proposer | None,
    verifier: Verifier,
    state: SessionState,
    *,
    max_new_tokens: int,
    params: SamplingParams,
    gamma_policy: GammaPolicy,
    eos_token_ids: set[int],
    context_limit: int,
    draft_top_k: int = 0,
    observer: RoundObserver = TRACE_ONLY,
) -> Iterator[RoundResult]:
    """Generate after ``state.tokens`` (which already ends with the prompt) until
    ``max_new_tokens``, an EOS token, or the context limit; one result per round.

    ``params.seed`` must be set: both sides derive their randomness from it.
    ``observer`` sees every round (a span per round when tracing is on; the
    coordinator's adds metrics)."""
    generated = 0
    for index in itertools.count():
        room = min(max_new_tokens - generated, context_limit - len(state.tokens))
        if room <= 0:
            return
        # The last token of a round always comes from the target, so γ ≤ room - 1.
        gamma = 0 if proposer is None else max(0, min(gamma_policy.choose(), room - 1))

        # Normally each side lacks just the last round's token; more is pre-fill.
        draft_behind = max(0, len(state.tokens) - state.draft_synced - 1) if gamma else 0
        target_behind = max(0, len(state.tokens) - state.target_synced - 1)
        with observer.round(index) as observed:
            t0 = time.perf_counter()
            drafts: list[DraftToken] = []
            first = None
            if gamma:
                stream = proposer.propose(state.draft_synced, state.tokens[state.draft_synced:], gamma, params,
                                          draft_top_k)
                for draft in stream:
                    drafts.append(draft)
                    first = first or time.perf_counter() - t0
            t1 = time.perf_counter()
            verdict = verifier.verify(state.target_synced, state.tokens[state.target_synced:], drafts, params)
            t2 = time.perf_counter()

            base = len(state.tokens)
            new = [d.token for d in drafts[: verdict.accepted]] + [verdict.next_token]
            new, finish = _cut(new, eos_token_ids, max_new_tokens - generated, room)
            state.tokens.extend(new)
            generated += len(new)
            if gamma:
                state.draft_synced = min(base + verdict.accepted, len(state.tokens))
            state.target_synced = len(state.tokens)
            # Earlier rounds' telemetry, done while the draft computed, is not the draft's time.
            paused = observed.paused_s
            result = RoundResult(new, gamma, verdict.accepted, t1 - t0 - paused, t2 - t1, finish,
                                 None if first is None else max(0.0, first - paused), draft_behind, target_behind)
            observed.done(result)
        gamma_policy.observe(result)
        yield result
        if finish:
            return


def _cut(new: list[int], eos_ids: set[int], budget: int, room: int) -> tuple[list[int], str | None]:
    """Stop at the first EOS (kept) or when the token budget or context is used up."""
    for i, tok in enumerate(new):
        if tok in eos_ids:
            return new[: i + 1], "eos"
    if len(new) >= budget:
        return new[:budget], "length"
    if len(new) >= room:
        return new[:room], "length"
    return new, None
