"""The in-process decoder: draft and target in this process, the round loop of
specdec.core.rounds between them. It is both a library API and the honest baseline the
distributed system is measured against."""

from __future__ import annotations

import dataclasses
import os
import time

from specdec.core.gamma import GammaPolicy, StaticGamma
from specdec.core.interfaces import DEFAULT_DRAFT_TOP_K, NO_OBSERVER, RoundObserver, SamplingParams, SessionState
from specdec.core.rounds import Limits, run_rounds
from specdec.core.text import TextStream, decode_continuation
from specdec.core.vocabulary import check_token_ids, shared_vocabulary
from specdec.models.local import DraftRule, LocalProposer, LocalVerifier, new_draft_sequence
from specdec.models.runner import ModelRunner


@dataclasses.dataclass
class GenerationOutput:
    token_ids: list[int]  # generated ids, prompt excluded
    accepted: list[int]  # accepted drafts per round
    gammas: list[int]  # drafts proposed per round
    rounds: int
    target_forwards: int
    elapsed_s: float
    finish_reason: str  # "eos" | "length" | "stop"
    text: str | None = None  # the generated text (up to a stop string), when the target has a tokenizer

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(self.gammas)
        return sum(self.accepted) / proposed if proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per round (accepted drafts + the target's own token)."""
        return len(self.token_ids) / self.rounds if self.rounds else 0.0


def check_prompt(prompt_ids: list[int], vocab_size: int, context: int) -> None:
    if len(prompt_ids) == 0:
        raise ValueError("prompt is empty: give at least one token")
    check_token_ids(prompt_ids, vocab_size, "prompt_ids")
    if len(prompt_ids) >= context:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens does not fit the model context of {context} "
            "(at least one position must be left to generate)"
        )


def check_pair(target: ModelRunner, draft: ModelRunner) -> int:
    """Draft and target must map ids to the same tokens; returns how many, from
    0, both hold (vocabularies may differ in padding rows)."""
    return shared_vocabulary(f"draft {draft.path}", draft.vocab_size, draft.fingerprint,
                             f"target {target.path}", target.vocab_size, target.fingerprint)


def _runner(model, device: str, dtype: str, lean: bool = False) -> ModelRunner:
    """A path is loaded; anything else is taken to be a ready runner."""
    if isinstance(model, (str, os.PathLike)):
        return ModelRunner(model, device, dtype, lean=lean)
    return model


class SpeculativeDecoder:
    """Speculative decoding with both models in this process.

    >>> dec = SpeculativeDecoder(target="path/to/target", draft="path/to/draft")
    >>> out = dec.generate(prompt_ids, max_new_tokens=64, gamma=4)

    A model loaded from a path runs batched through its own modules, a plain
    Llama through the lean Llama layers as the services' models do
    (``lean=False``: its own modules). The lean target's logits equal the
    model's own to float rounding, so its greedy output is the model's except
    where two tokens tie to the last bit.
    """

    def __init__(
        self,
        target: str | os.PathLike | ModelRunner,
        draft: str | os.PathLike | ModelRunner | None = None,
        *,
        device: str = "cpu",
        draft_device: str | None = None,
        dtype: str = "float32",
        lean: bool = True,
    ):
        self.target = _runner(target, device, dtype, lean=lean)
        self.draft = None
        self.shared_vocab = self.target.vocab_size
        if draft is not None:
            self.draft = _runner(draft, draft_device or device, dtype, lean=lean)
            self.shared_vocab = check_pair(self.target, self.draft)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int = 64,
        sampling: SamplingParams | None = None,
        gamma: int | GammaPolicy = 4,
        draft_top_k: int = DEFAULT_DRAFT_TOP_K,
        stop: list[str] | tuple[str, ...] = (),
        observer: RoundObserver = NO_OBSERVER,
        plain_tokens: int = 1,
    ) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` after ``prompt_ids``. ``gamma`` is a
        fixed count or a policy; 0 (or no draft model) is plain target decoding.
        Under sampling the draft samples from its top ``draft_top_k`` tokens
        (0: its whole distribution) -- exact either way; the default equals the
        coordinator's, so a seed gives the same tokens in-process and distributed.
        ``stop`` strings end the output before them (as the coordinator does;
        needs the target's tokenizer). ``observer`` sees every round.
        ``plain_tokens``: tokens a round without drafts asks of the target (the
        coordinator's --plain-tokens; in one process a call costs nothing, so 1)."""
        params = (sampling or SamplingParams()).with_seed()
        policy = self._policy(gamma)
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
        if draft_top_k < 0:
            raise ValueError(f"draft_top_k must be >= 0, got {draft_top_k}")
        if plain_tokens < 1:
            raise ValueError(f"plain_tokens must be >= 1, got {plain_tokens}")
        prompt_ids = list(prompt_ids)
        context = self.target.max_context
        if self.draft is not None:
            context = min(context, self.draft.max_context)
        check_prompt(prompt_ids, self.target.vocab_size, context)
        text = self._text_stream(stop, prompt_ids)

        start = time.perf_counter()
        state = SessionState(tokens=list(prompt_ids))
        verifier = LocalVerifier(self.target, self.target.new_sequence())
        proposer = None
        if self.draft is not None and not (isinstance(gamma, int) and gamma == 0):
            vocab = self.shared_vocab if self.shared_vocab < self.draft.vocab_size else 0
            proposer = LocalProposer(self.draft, new_draft_sequence(self.draft), DraftRule(draft_top_k, vocab))
        limits = Limits(max_new_tokens, context, frozenset(self.target.eos_token_ids), text, plain_tokens)
        rounds = list(run_rounds(proposer, verifier, state, params=params, gamma_policy=policy, limits=limits,
                                 observer=observer))
        elapsed = time.perf_counter() - start
        token_ids = state.tokens[len(prompt_ids):]
        return GenerationOutput(
            token_ids=token_ids,
            accepted=[r.accepted for r in rounds],
            gammas=[r.gamma for r in rounds],
            rounds=len(rounds),
            target_forwards=len(rounds),
            elapsed_s=elapsed,
            finish_reason=rounds[-1].finish_reason or "length",
            text=self._text(prompt_ids, token_ids, text),
        )

    def _text(self, prompt_ids: list[int], token_ids: list[int], stream: TextStream | None) -> str | None:
        if stream is not None:  # stop strings: what the stream released, up to the stop string
            return stream.take() + stream.finish()
        tok = self.tokenizer
        return None if tok is None else decode_continuation(tok, prompt_ids, token_ids)

    @staticmethod
    def _policy(gamma: int | GammaPolicy) -> GammaPolicy:
        if isinstance(gamma, int):
            if gamma < 0:
                raise ValueError(f"gamma must be >= 0, got {gamma}")
            return StaticGamma(gamma)
        return gamma

    def _text_stream(self, stop, prompt_ids: list[int]) -> TextStream | None:
        """The stop condition: what turns tokens into text as they come and finds
        stop strings; None without stop strings (the text is decoded once, at the end)."""
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        if not stop:
            return None
        if self.tokenizer is None:
            raise ValueError(f"{self.target.path} has no tokenizer, so stop strings cannot be matched")
        return TextStream(self.tokenizer, stop, context_ids=prompt_ids)
