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
from specdec.serving.names import MAX_NAME_LEN, check_name

# Bounds on a Generate request's strings, checked before anything else is done
# for it: before tokenising, before any lease or service call. Every stop
# string is looked for in every round's new text, so their number and length
# bound that work (specdec.core.text: a round's search covers, per stop string,
# the new text and that string's length before it). OpenAI allows 4 stop sequences;
# 64 of up to 256 characters cover the end markers of any chat template, role
# headers and multi-line delimiters many times over, while at these bounds the
# text handling of a turn costs at most about twice what it costs without stop
# strings (scripts/bench_stop_strings.py). A γ policy is a word or "static:N".
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256
MAX_GAMMA_POLICY_CHARS = 64
MAX_ID_CHARS = MAX_NAME_LEN  # session_id, turn_id (specdec.serving.names)


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

    @staticmethod
    def check_sizes(job: GenerateJob) -> None:
        """The bounds on the request's strings (the prompt's, which depends on
        the model's context, is :meth:`validate`'s). Each refusal costs no more
        than counting: a flood of stop strings is not looked through."""
        if len(job.stop) > MAX_STOP_STRINGS:
            raise errors.InvalidRequest(
                f"too many stop strings ({len(job.stop)}): at most {MAX_STOP_STRINGS} are allowed")
        for i, stop in enumerate(job.stop):
            if not stop:
                raise errors.InvalidRequest("stop strings must not be empty")
            if len(stop) > MAX_STOP_CHARS:
                raise errors.InvalidRequest(
                    f"stop[{i}] has {len(stop)} characters: a stop string may have at most {MAX_STOP_CHARS}")
        if len(job.gamma_policy) > MAX_GAMMA_POLICY_CHARS:
            raise errors.InvalidRequest(
                f"gamma_policy has {len(job.gamma_policy)} characters, more than {MAX_GAMMA_POLICY_CHARS}: use "
                "'static:N', 'heuristic' or 'adaptive'")
        check_name(job.session_id, "session_id", MAX_ID_CHARS)
        check_name(job.turn_id, "turn_id", MAX_ID_CHARS)

    def _check_fields(self, job: GenerateJob, pair: PairInfo) -> None:
        self.check_sizes(job)
        if job.prompt and job.prompt_ids:
            raise errors.InvalidRequest("both prompt and prompt_ids are set: give exactly one")
        if not job.prompt and not job.prompt_ids:
            raise errors.InvalidRequest("prompt is empty: give a prompt (text) or prompt_ids")
        if job.resume_after is not None and not (job.session_id and job.turn_id):
            raise errors.InvalidRequest("resume_after needs the session_id and turn_id of the turn to resume")
        cap = self.config.max_new_tokens_cap
        if not 0 < job.max_new_tokens <= cap:
            raise errors.InvalidRequest(f"max_new_tokens must be in [1, {cap}], got {job.max_new_tokens}")
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
