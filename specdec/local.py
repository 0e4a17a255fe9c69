"""Drafting and verifying with a local model: the compute behind the draft and
target services and the in-process decoder alike."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from specdec.model_runner import ModelRunner, Sequence
from specdec.rounds import DraftToken, dense_rows
from specdec.sampling import (
    STREAM_DRAFT,
    SamplingParams,
    process_logits,
    sample,
    truncate_top_k,
    uniform,
)
from specdec.verification import Verdict, verify_greedy, verify_stochastic


def draft_tokens(
    runner: ModelRunner,
    seq: Sequence,
    position: int,
    new_tokens: list[int],
    gamma: int,
    params: SamplingParams,
    draft_top_k: int = 0,
) -> Iterator[DraftToken]:
    """Roll ``seq`` back to ``position``, append ``new_tokens``, then sample
    ``gamma`` tokens one by one, yielding each with the distribution it was
    sampled from (truncated to the top ``draft_top_k`` when > 0)."""
    runner.rollback(seq, position)
    seq.tokens.extend(new_tokens)
    for _ in range(gamma):
        logits = runner.logits(seq, 1)[0]
        if params.greedy:
            token, q = int(logits.argmax()), None
        else:
            q = process_logits(logits, params)
            u = uniform(params.seed, len(seq.tokens), STREAM_DRAFT)
            if draft_top_k > 0:
                q = truncate_top_k(q, draft_top_k)
                token = int(q.ids[sample(q.probs, u)])
            else:
                token = sample(q, u)
        seq.tokens.append(token)
        yield DraftToken(token, q)


def verify_drafts(
    runner: ModelRunner,
    seq: Sequence,
    position: int,
    new_tokens: list[int],
    drafts: list[DraftToken],
    params: SamplingParams,
) -> Verdict:
    """Roll ``seq`` back to ``position``, append ``new_tokens`` and the drafts, run
    them in one forward pass and judge the drafts. Afterwards ``seq`` holds the
    accepted drafts followed by the next token (not yet run)."""
    runner.rollback(seq, position)
    seq.tokens.extend(new_tokens)
    first = len(seq.tokens)  # where drafts[0] lands
    tokens = [d.token for d in drafts]
    seq.tokens.extend(tokens)
    logits = runner.logits(seq, len(drafts) + 1)
    if params.greedy:
        verdict = verify_greedy(tokens, logits)
    else:
        p = process_logits(logits, params)
        q = dense_rows([d.q for d in drafts], runner.vocab_size, p.device)
        verdict = verify_stochastic(tokens, q, p, seed=params.seed, first_position=first)
    runner.rollback(seq, first + verdict.accepted)
    seq.tokens.append(verdict.next_token)
    return verdict


@dataclasses.dataclass
class LocalProposer:
    """The draft model in this process, for one session."""

    runner: ModelRunner
    seq: Sequence

    def propose(self, position, new_tokens, gamma, params, draft_top_k):
        return draft_tokens(self.runner, self.seq, position, new_tokens, gamma, params, draft_top_k)


@dataclasses.dataclass
class LocalVerifier:
    """The target model in this process, for one session."""

    runner: ModelRunner
    seq: Sequence

    def verify(self, position, new_tokens, drafts, params):
        return verify_drafts(self.runner, self.seq, position, new_tokens, drafts, params)
