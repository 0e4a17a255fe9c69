"""Everything about a client's Generate request that can be checked before a
session is touched, and what is decided for it."""

from __future__ import annotations

import dataclasses
import functools

from specdec.coordinator.pair import PairInfo
from specdec.core import gamma as gamma_policies
from specdec.core.gamma import GammaPolicy
from specdec.core.interfaces import SamplingParams
from specdec.core.vocabulary import check_token_ids
from specdec.serving import errors
from specdec.serving.config import CoordinatorConfig
from specdec.serving.generation import GenerateJob
from specdec.serving.names import check_name


@dataclasses.dataclass(frozen=True)
class Request:
    """A job that passed every check, with what is decided for it."""

    job: GenerateJob
    prompt_ids: list[int]
    policy: GammaPolicy  # a fresh policy object
    params: SamplingParams  # the seed filled in
    draft_top_k: int  # the k in force
    plain_tokens: int = 1  # tokens a round without drafts asks of the target

    @property
    def gamma_policy(self) -> str:
        return self.job.gamma_policy


def parse_gamma_policy(spec: str, gamma_max: int, plain_tokens: int = 1) -> GammaPolicy:
    """"static:N" | "heuristic" | "adaptive" -> a fresh policy object
    (:func:`specdec.core.gamma.parse_gamma_policy`), bad specs as INVALID_ARGUMENT."""
    try:
        return gamma_policies.parse_gamma_policy(spec, gamma_max, plain_tokens)
    except ValueError as e:
        raise errors.InvalidRequest(str(e)) from None


class RequestCheck:
    """Validates jobs against the coordinator's limits and the model pair;
    raises InvalidRequest naming the problem."""

    def __init__(self, config: CoordinatorConfig, tokenizer=None):
        self.config, self.tokenizer = config, tokenizer

    def validate(self, job: GenerateJob, pair: PairInfo) -> Request:
        self._check_fields(job, pair)
        # A call adds at most gamma_max tokens after the target's next one.
        plain = min(self.config.plain_tokens, pair.gamma_max + 1)
        policy = parse_gamma_policy(job.gamma_policy or self.config.default_gamma_policy, pair.gamma_max, plain)
        ids = self._prompt_ids(job, pair)
        top_k = self.config.default_draft_top_k if job.draft_top_k is None else job.draft_top_k
        if not job.gamma_policy:
            job = dataclasses.replace(job, gamma_policy=self.config.default_gamma_policy)
        return Request(job, ids, policy, job.sampling.with_seed(), min(top_k, pair.vocab_size), plain)

    def _check_fields(self, job: GenerateJob, pair: PairInfo) -> None:
        if job.prompt and job.prompt_ids:
            raise errors.InvalidRequest("both prompt and prompt_ids are set: give exactly one")
        if not job.prompt and not job.prompt_ids:
            raise errors.InvalidRequest("prompt is empty: give a prompt (text) or prompt_ids")
        check_name(job.session_id, "session_id")
        check_name(job.turn_id, "turn_id")
        if job.resume_after is not None and not (job.session_id and job.turn_id):
            raise errors.InvalidRequest("resume_after needs the session_id and turn_id of the turn to resume")
        cap = self.config.max_new_tokens_cap
        if not 0 < job.max_new_tokens <= cap:
            raise errors.InvalidRequest(f"max_new_tokens must be in [1, {cap}], got {job.max_new_tokens}")
        if any(not s for s in job.stop):
            raise errors.InvalidRequest("stop strings must not be empty")
        if (job.prompt or job.stop) and self.tokenizer is None:
            what = "a text prompt" if job.prompt else "stop strings"
            raise errors.InvalidRequest(f"this coordinator has no tokenizer, so it cannot take {what}: send prompt_ids")
        if job.draft_top_k is not None and not 0 <= job.draft_top_k <= pair.vocab_size:
            raise errors.InvalidRequest(f"draft_top_k must be in [0, {pair.vocab_size}], got {job.draft_top_k}")

    def _prompt_ids(self, job: GenerateJob, pair: PairInfo) -> list[int]:
        if job.prompt:
            longest = self._longest_token_chars
            if len(job.prompt) > pair.context * longest:  # tokenizing megabytes takes seconds: refuse first
                raise errors.InvalidRequest(
                    f"prompt of {len(job.prompt)} characters cannot fit the model context of {pair.context} "
                    f"tokens (no token stands for more than {longest} characters)")
            # No BOS/special tokens: the same ids as `specdec generate --local`, and a
            # later turn of a session appends plain text to the history.
            ids = list(self.tokenizer.encode(job.prompt, add_special_tokens=False))
            if not ids:
                raise errors.InvalidRequest("prompt is empty after tokenization")
        else:
            ids = list(job.prompt_ids)
        try:
            check_token_ids(ids, pair.vocab_size, "prompt_ids")
        except ValueError as e:
            raise errors.InvalidRequest(str(e)) from None
        return ids

    @functools.cached_property
    def _longest_token_chars(self) -> int:
        """The most characters of text one token can stand for (its string in the
        vocabulary: byte-level BPE spells each byte as one character), so a text
        prompt longer than context × this many characters cannot fit."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)
