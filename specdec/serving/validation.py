"""Request validation shared by the draft and target services: each check
raises :class:`~specdec.serving.errors.InvalidRequest` (INVALID_ARGUMENT) with
what is wrong, before any session or model work."""

from __future__ import annotations

from collections.abc import Sequence

from specdec.core.interfaces import SamplingParams
from specdec.core.vocabulary import check_token_ids
from specdec.models.runner import ModelRunner
from specdec.proto import specdec_pb2 as pb
from specdec.serving import convert as pc
from specdec.serving.errors import InvalidRequest
from specdec.serving.names import MAX_SERVICE_NAME_LEN, check_name


def check_session_id(session_id: str) -> None:
    if not session_id:
        raise InvalidRequest("session_id is empty")
    check_name(session_id, "session_id", MAX_SERVICE_NAME_LEN)


def check_round(
    runner: ModelRunner,
    gamma_max: int,
    session_id: str,
    position: int,
    new_tokens: Sequence[int],  # the request's repeated field
    sampling: pb.SamplingParams,
    *,
    gamma: int,
    gamma_field: str = "gamma",
    decode: int = 0,
    vocab_size: int | None = None,
) -> SamplingParams:
    """Validate what every round request carries for ``runner``'s model (its
    context and vocabulary); return its sampling params.

    ``gamma`` is how many tokens the call adds after ``new_tokens`` (drafted
    here, or drafts to verify); ``decode``, how many the target decodes after
    its verdict (``decode_tokens``); both at most ``gamma_max``. ``vocab_size``:
    the ids ``new_tokens`` may hold (default: the model's)."""
    check_session_id(session_id)
    for value, field in ((gamma, gamma_field), (decode, "decode_tokens")):
        if not 0 <= value <= gamma_max:
            raise InvalidRequest(f"{field} {value} is out of range [0, {gamma_max}]")
    total = position + len(new_tokens) + gamma + decode  # (before any copy: a flood of ids is refused as it is)
    if total > runner.max_context:
        decoded = f" + {decode} decode_tokens" if decode else ""
        raise InvalidRequest(
            f"sequence of {total} tokens (position {position} + {len(new_tokens)} new_tokens + "
            f"{gamma} {gamma_field}{decoded}) exceeds the model context of {runner.max_context}"
        )
    if position + len(new_tokens) == 0:
        raise InvalidRequest("nothing to run: position is 0 and new_tokens is empty (empty prompt?)")
    try:
        check_token_ids(new_tokens, vocab_size or runner.vocab_size, "new_tokens")
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    params = pc.sampling_from_proto(sampling)
    if not params.greedy and params.seed is None:
        raise InvalidRequest("sampling.seed is required when temperature > 0 (both services derive "
                             "their random draws from it)")
    return params


def check_vocab(runner: ModelRunner, tokens: list[int], what: str) -> None:
    """``tokens`` (the request's field ``what``) are ids of ``runner``'s vocabulary."""
    try:
        runner.check_tokens(tokens, what)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def sampling_key(sampling: pb.SamplingParams) -> bytes:
    """Sampling params as bytes, for a round's request key (see Session.replay)."""
    return sampling.SerializeToString(deterministic=True)
