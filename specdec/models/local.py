"""Drafting and verifying with a local model: the compute behind the draft and
target services and the in-process decoder alike.

Each piece of work is written once, as *steps*: a generator that yields a
:class:`~specdec.models.runner.Pass` when it needs logits (and is sent them back,
or their probabilities: the pass says how they are sampled),
yields a :class:`DraftToken` whenever it has drafted one, and returns its result.
Who runs the passes is not its business: :func:`run_alone` runs each as its own
forward pass (the in-process decoder); the services' scheduler runs the passes of
many sessions' steps together, in one batched forward pass
(:mod:`specdec.serving.scheduler`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch

from specdec.core.interfaces import DraftToken, Propose, SamplingParams, Verdict, Verify
from specdec.core.sampling import STREAM_DRAFT, sample, truncate_top_k, uniform
from specdec.core.verification import dense_rows, verify_greedy, verify_stochastic
from specdec.models.paged_kv import KVExhausted
from specdec.models.runner import ModelRunner, Pass, Sequence

# yields a Pass (sent its reply [last, V] back: logits, or probabilities where it samples)
# or a DraftToken (sent None); returns R
Steps = Generator["Pass | DraftToken", "torch.Tensor | None", Any]


def run_alone(runner: ModelRunner, steps: Steps) -> Generator[DraftToken, None, Any]:
    """Drive ``steps`` with one forward pass per :class:`Pass`: yields its drafts
    as they are made, returns its result."""
    reply = None
    while True:
        try:
            item = steps.send(reply)
        except StopIteration as done:
            return done.value
        if isinstance(item, Pass):
            reply = runner.run_passes([item])[0]
        else:
            reply = None
            yield item


def result_alone(runner: ModelRunner, steps: Steps) -> Any:
    """The result of ``steps`` (which draft nothing), each pass run alone."""
    driver = run_alone(runner, steps)
    try:
        next(driver)
    except StopIteration as done:
        return done.value
    raise RuntimeError("these steps draft tokens: iterate run_alone() instead")


@dataclasses.dataclass(frozen=True)
class DraftRule:
    """How the draft samples, beyond the request's SamplingParams: from the top
    ``top_k`` of q (0: all of it), among the first ``vocab`` ids only (0: all
    of them) -- the ids the target holds too, when their vocabularies differ
    in padding rows. q is exactly what is sampled from either way."""

    top_k: int = 0
    vocab: int = 0


def draft_steps(
    runner: ModelRunner,
    seq: DraftSequence,
    position: int,
    new_tokens: list[int],
    gamma: int,
    params: SamplingParams,
    rule: DraftRule = DraftRule(),
) -> Steps:
    """Roll ``seq`` back to ``position``, append ``new_tokens``, then sample
    ``gamma`` tokens one by one, yielding each with the distribution it was
    sampled from (see :class:`DraftRule`). Returns how many drafts made ahead
    it reused.

    Drafts that :func:`draft_ahead_steps` made since the last call and that this
    call would make again are yielded without running the model."""
    ahead, seq.ahead = seq.ahead, None  # valid until the sequence next changes: now
    branches, seq.branches = seq.branches, []  # (the others' blocks go back when they are dropped)
    branch = next((b for b in branches if b.reusable(position, new_tokens, params, rule)), None)
    if seq.runner_ups is not None:  # those of the drafts this call keeps
        runner_ups = branch.seq.runner_ups if branch is not None else seq.runner_ups
        seq.runner_ups = {p: t for p, t in runner_ups.items() if p >= position}
    if branch is not None:  # the session goes on as the branch: it holds new_tokens and drafts after position
        seq.tokens, seq.cache = branch.seq.tokens, branch.seq.cache
        reused = branch.drafts[:gamma]
        ahead = None
    else:
        reused = ahead.reusable(seq, position, new_tokens, gamma, params, rule) if ahead else []
    if reused:  # seq already holds new_tokens and the reused drafts after position
        held = position + len(new_tokens) + len(reused)
        runner.rollback(seq, held)
        runner.uncache(seq, held - 1)  # the last draft stays un-run, as a freshly drafted one is
        yield from reused
    else:
        runner.rollback(seq, position)
        if ahead is not None:  # forget the passes drafting ahead made: run what a fresh request runs
            runner.uncache(seq, ahead.cached)
        seq.tokens.extend(new_tokens)
    for _ in range(gamma - len(reused)):
        yield (yield from draft_one(runner, seq, params, rule))
    return len(reused)


def draft_tokens(runner: ModelRunner, seq: DraftSequence, position: int, new_tokens: list[int], gamma: int,
                 params: SamplingParams, rule: DraftRule = DraftRule()) -> Iterator[DraftToken]:
    """:func:`draft_steps` with each pass run alone: the drafts, as they are made."""
    return run_alone(runner, draft_steps(runner, seq, position, new_tokens, gamma, params, rule))


def draft_one(runner: ModelRunner, seq: Sequence, params: SamplingParams, rule: DraftRule,
              run: int = 1) -> Steps:
    """Sample the token after ``seq``, append it and return it. The draw is a pure
    function of (the tokens before it, params, seed, rule): the seed's uniform
    for this position. ``run``: run at least the last ``run`` tokens, cached or
    not (see :func:`draft_ahead_steps`)."""
    # Over the ids the target holds too (rule.vocab): q exactly restricted to them.
    # Greedy: the logits; else q, processed with the other sampling rows of the pass.
    reply = (yield Pass(seq, 1, run, params, rule.vocab))[0]
    if params.greedy:
        token, q = int(reply.argmax()), None
    else:
        u = uniform(params.seed, len(seq.tokens), STREAM_DRAFT)
        if rule.top_k > 0:
            q = truncate_top_k(reply, rule.top_k)
            token = int(q.ids[sample(q.probs, u)])
        else:
            q = reply.clone()  # kept with the draft: not a view holding the whole pass's rows
            token = sample(q, u)
    if isinstance(seq, DraftSequence) and seq.runner_ups is not None:
        seq.runner_ups[len(seq.tokens)] = runner_up(reply, token)
    seq.tokens.append(token)
    return DraftToken(token, q)


def runner_up(scores: torch.Tensor, token: int) -> int:
    """The likeliest token after ``token`` by the draft's logits or its q (the
    same order: processing keeps the order of what it does not cut): its best
    guess at the target's correction where the target rejects ``token``."""
    if scores.numel() < 2:
        return token  # no other: a branch for it would never match a correction
    top = torch.topk(scores, 2).indices.tolist()
    return top[0] if top[0] != token else top[1]


@dataclasses.dataclass
class DraftSequence(Sequence):
    """A draft session's sequence, with the drafts made ahead of its next
    request: on it, for the round bet on (:func:`draft_ahead`), and on branches
    for other outcomes of the round being verified (:func:`branch_steps`);
    and, by position, the runner-up of each token it drafted (:func:`runner_up`)."""

    ahead: DraftsAhead | None = None
    branches: list[Branch] = dataclasses.field(default_factory=list)
    runner_ups: dict[int, int] | None = None  # None: not kept (no branches drafted for this session)


@dataclasses.dataclass
class Branch:
    """Drafts made ahead for one outcome of the round being verified: the
    target keeps the first ``position`` tokens and appends ``token`` (its
    correction of the draft there, guessed as the draft's runner-up). ``seq``,
    a fork of the session's sequence, holds them: ``tokens[:position] + [token]
    + drafts``."""

    position: int
    token: int
    seq: DraftSequence
    drafts: list[DraftToken]
    params: SamplingParams
    rule: DraftRule

    def reusable(self, position: int, new_tokens: list[int], params: SamplingParams, rule: DraftRule) -> bool:
        """Whether a request asks for the outcome this branch bet on, as it drafted."""
        return (position == self.position and list(new_tokens) == [self.token] and params == self.params
                and rule == self.rule and bool(self.drafts))


def new_draft_sequence(runner: ModelRunner, branching: bool = False) -> DraftSequence:
    """An empty draft session; ``branching``: it keeps each draft's runner-up,
    for :func:`branch_steps` (a top-2 per draft that nothing else needs)."""
    return DraftSequence(tokens=[], cache=runner.new_cache(), runner_ups={} if branching else None)


@dataclasses.dataclass
class DraftsAhead:
    """What :func:`draft_ahead` made: ``drafts`` are ``seq.tokens[start:]``, the
    first of them the guess at the target's next token, drafted with ``params``
    and ``rule``; the KV cache held ``cached`` positions before.
    """

    start: int
    cached: int
    drafts: list[DraftToken]
    params: SamplingParams
    rule: DraftRule

    def reusable(self, seq: Sequence, position: int, new_tokens: list[int], gamma: int,
                 params: SamplingParams, rule: DraftRule) -> list[DraftToken]:
        """The drafts (up to ``gamma``) this request would make, if they were made
        ahead: only for the round bet on -- the request continues from the drafts
        the sequence held with one new token, the target's, equal to the guess.

        Drafting is deterministic given the tokens before a position, the params
        and k (:func:`draft_one`), and the drafts made ahead were run through the
        model in the same passes as a fresh request runs them, so they are
        bit-identical to the ones this request would make, q included."""
        first = position + len(new_tokens)  # where the first requested draft lands
        if (params != self.params or rule != self.rule or len(self.drafts) < 2
                or not new_tokens or first != self.start + 1 or position < self.cached
                or seq.tokens[position:first] != list(new_tokens)):
            return []
        return self.drafts[1:1 + gamma]


def held_tokens(seq: DraftSequence) -> int:
    """How many tokens a session holds as far as its callers know. Drafts made
    ahead are the service's own bet: no caller may name a position inside them,
    and they do not count against the token cap (at most γ + 3 per session)."""
    ahead = seq.ahead  # read once: the model's executor may replace it meanwhile
    return ahead.start if ahead is not None else len(seq.tokens)


def draft_ahead_steps(runner: ModelRunner, seq: DraftSequence, params: SamplingParams, rule: DraftRule,
                      count: int, stop: Callable[[], bool]) -> Steps:
    """Keep drafting after ``seq`` up to ``count`` tokens, as if the target will
    accept every draft and pick the draft's own next token (the guess) after
    them: done on the draft's device while the target verifies, so when the
    guess is right the next round's drafts already exist (kept in ``seq.ahead``
    for the next :func:`draft_steps`). ``stop`` is asked before each token:
    real work waiting for the model comes first. Returns how many were made;
    closed between passes, it leaves ``seq.ahead`` holding what it made.

    Float rounding depends on how tokens are grouped into passes, so the passes
    are those of a fresh request: the next request would run the tokens not yet
    run together with its first new token in one pass, so the draft after the
    guess comes from one pass over those tokens and the guess."""
    start, cached = len(seq.tokens), seq.cache_length
    drafts: list[DraftToken] = []
    seq.ahead = DraftsAhead(start, cached, drafts, params, rule)
    while len(drafts) < count and len(seq.tokens) < runner.max_context and not stop():
        run = start - cached + 1 if len(drafts) == 1 else 1
        drafts.append((yield from draft_one(runner, seq, params, rule, run)))
    return len(drafts)


# Rejection positions drafted ahead for (besides the outcome that every draft is
# accepted): with acceptance α per draft, the first rejection is at position j
# with probability α^j (1 - α), so the first ones carry most of it.
DRAFT_BRANCHES = 2


def branch_steps(runner: ModelRunner, seq: DraftSequence, position: int, params: SamplingParams, rule: DraftRule,
                 count: int, stop: Callable[[], bool]) -> Steps:
    """While the target verifies, draft ahead for another outcome than
    :func:`draft_ahead_steps` bets on: the target rejects the draft at
    ``position`` and corrects it with the draft's runner-up there. On a fork of
    ``seq`` (its blocks shared up to ``position``), up to ``count`` drafts,
    kept in ``seq.branches`` for the next :func:`draft_steps`. ``stop`` is asked
    before each draft. Returns how many were made (0: no runner-up known there,
    or no KV room for the fork).

    The drafts come from the tokens before them, the params and the rule, as a
    fresh request's would: a prepared draft is just a draft, with its exact q."""
    token = (seq.runner_ups or {}).get(position)
    if token is None or position > len(seq.tokens) or stop():
        return 0
    try:
        fork = runner.fork(seq, position)
    except KVExhausted:
        return 0
    fork = DraftSequence(tokens=[*fork.tokens, token], cache=fork.cache, runner_ups={})
    branch = Branch(position, token, fork, [], params, rule)
    seq.branches.append(branch)
    while len(branch.drafts) < count and len(fork.tokens) < runner.max_context and not stop():
        branch.drafts.append((yield from draft_one(runner, fork, params, rule)))
    return len(branch.drafts)


def draft_ahead(runner: ModelRunner, seq: DraftSequence, params: SamplingParams, rule: DraftRule, count: int,
                stop: Callable[[], bool]) -> int:
    """:func:`draft_ahead_steps`, each pass run alone."""
    return result_alone(runner, draft_ahead_steps(runner, seq, params, rule, count, stop))


def verify_steps(
    runner: ModelRunner,
    seq: Sequence,
    position: int,
    new_tokens: list[int],
    drafts: list[DraftToken],
    params: SamplingParams,
    decode: int = 0,
) -> Steps:
    """Roll ``seq`` back to ``position``, append ``new_tokens`` and the drafts, run
    them in one forward pass and judge the drafts. Afterwards ``seq`` holds the
    accepted drafts followed by the next token (not yet run), then up to
    ``decode`` tokens decoded alone after it (:func:`decode_one`, one pass each;
    none after an end-of-sequence token). Returns the Verdict."""
    runner.rollback(seq, position)
    seq.tokens.extend(new_tokens)
    first = len(seq.tokens)  # where drafts[0] lands
    seq.tokens.extend(d.token for d in drafts)
    verdict = judge(runner, (yield Pass(seq, len(drafts) + 1, params=params)), drafts, params, first)
    runner.rollback(seq, first + verdict.accepted)
    seq.tokens.append(verdict.next_token)
    decoded = []
    while (len(decoded) < decode and seq.tokens[-1] not in runner.eos_token_ids
           and len(seq.tokens) < runner.max_context):
        decoded.append((yield from decode_one(runner, seq, params)))
    return dataclasses.replace(verdict, decoded=tuple(decoded)) if decoded else verdict


def decode_one(runner: ModelRunner, seq: Sequence, params: SamplingParams) -> Steps:
    """Plain target decoding: the token after ``seq``, appended and returned. It
    is judged as a round without drafts at this position judges its next token,
    so several decoded in one call are the tokens as many one-token rounds give."""
    token = judge(runner, (yield Pass(seq, 1, params=params)), [], params, len(seq.tokens)).next_token
    seq.tokens.append(token)
    return token


def judge(runner: ModelRunner, reply: torch.Tensor, drafts: list[DraftToken], params: SamplingParams,
          first: int) -> Verdict:
    """The verdict on ``drafts`` (landing at position ``first``) from the target's
    reply [γ + 1, V] at their positions: its logits when greedy, else p, its
    probabilities (processed with the other sampling rows of the pass)."""
    tokens = [d.token for d in drafts]
    if params.greedy:
        return verify_greedy(tokens, reply)
    p = reply
    q = dense_rows([d.q for d in drafts], runner.vocab_size, p.device) if drafts else p[:0]  # [γ, V]
    return verify_stochastic(tokens, q, p, seed=params.seed, first_position=first)


def verify_drafts(runner: ModelRunner, seq: Sequence, position: int, new_tokens: list[int],
                  drafts: list[DraftToken], params: SamplingParams, decode: int = 0) -> Verdict:
    """:func:`verify_steps` run alone."""
    return result_alone(runner, verify_steps(runner, seq, position, new_tokens, drafts, params, decode))


@dataclasses.dataclass
class LocalProposer:
    """The draft model in this process, for one session."""

    runner: ModelRunner
    seq: DraftSequence

    rule: DraftRule = DraftRule()

    def propose(self, call: Propose) -> Iterator[DraftToken]:
        return draft_tokens(self.runner, self.seq, call.position, call.new_tokens, call.gamma, call.params, self.rule)


@dataclasses.dataclass
class LocalVerifier:
    """The target model in this process, for one session."""

    runner: ModelRunner
    seq: Sequence

    def verify(self, call: Verify) -> Verdict:
        return verify_drafts(self.runner, self.seq, call.position, call.new_tokens, call.drafts, call.params,
                             call.decode)
