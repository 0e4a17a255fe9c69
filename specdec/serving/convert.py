"""Every conversion between protobuf messages and specdec's core types.

Used by the services and the coordinator alike, so the wire format is decided
here once:

* ``SamplingParams``: proto ``top_p`` unset -> 1.0; ``seed`` unset -> None.
* ``Distribution``: float32 little-endian bytes. Dense: ``ids`` empty, one value
  per vocabulary entry from id 0 (the ids past the last have probability 0).
  Sparse (the draft's truncated top-k): ``probs[j]`` is the probability of
  ``ids[j]``. Decoding is one ``np.frombuffer`` and validates what
  the lossless acceptance test relies on (right length, finite, non-negative, ids
  inside the vocabulary and unique).
* ``DraftToken``, ``Verdict`` (``VerifyResponse``) and ``ServerTiming``.
* The coordinator's side of a call: requests built here, replies decoded here
  (:class:`DraftReply`, :class:`VerifyReply`, :class:`CallTiming`). A draft's
  q stays as it came (:class:`WireDist`): the coordinator forwards it to the
  target without decoding or encoding it again.
* A Generate: its request (``GenerateJob``) and its events (``Delta``,
  ``GenerationStats``), between the client and the coordinator.

Decoders raise :class:`specdec.serving.errors.InvalidRequest` (-> INVALID_ARGUMENT) with
a message naming the field.

Distributions are torch tensors: ``specdec.core.sampling`` (which brings torch)
is imported inside the functions that build them, so that
:mod:`specdec.serving.client` does not load torch: ~3 s and ~190 MB for a
process that only talks to a coordinator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from specdec.core.interfaces import DraftToken, SamplingParams, Verdict
from specdec.proto import specdec_pb2 as pb
from specdec.serving.errors import InvalidRequest
from specdec.serving.generation import Delta, GenerateJob, GenerationStats, ModelFacts
from specdec.serving.timing import CallTiming, ServerTiming

if TYPE_CHECKING:
    import torch

    from specdec.core.sampling import Distribution

_F32_LE = np.dtype("<f4")

# ------------------------------------------------------------------ sampling


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(temperature=params.temperature, top_k=params.top_k)
    if params.top_p != 1.0:
        msg.top_p = params.top_p
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def sampling_from_proto(msg: pb.SamplingParams | None) -> SamplingParams:
    """Unset message = greedy. Invalid values -> InvalidRequest naming the field."""
    if msg is None:
        return SamplingParams()
    try:
        return SamplingParams(
            temperature=msg.temperature,
            top_k=msg.top_k,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
        )
    except ValueError as e:
        raise InvalidRequest(f"sampling: {e}") from None


# ------------------------------------------------------------------ distributions


def _probs_bytes(t: torch.Tensor) -> bytes:
    arr = t.detach().cpu().float().contiguous().numpy()  # float(): bfloat16 has no numpy dtype
    return arr.astype(_F32_LE, copy=False).tobytes()


@dataclasses.dataclass(frozen=True)
class WireDist:
    """A q as the draft sent it, opaque outside this module: the coordinator
    hands it on to the target's Verify as it is (the target validates it)."""

    _msg: pb.Distribution = dataclasses.field(repr=False)


def dist_to_proto(q: Distribution | WireDist) -> pb.Distribution:
    """A dense [V] tensor or a SparseDist -> Distribution. Tensors on a device are
    copied to the host here; copy them first to time that copy separately. A
    WireDist passes through untouched."""
    from specdec.core.sampling import SparseDist

    if isinstance(q, WireDist):
        return q._msg
    if isinstance(q, SparseDist):
        return pb.Distribution(ids=q.ids.detach().cpu().tolist(), probs=_probs_bytes(q.probs))
    if q.dim() != 1:
        raise ValueError(f"a dense distribution is one row [V], got shape {tuple(q.shape)}")
    return pb.Distribution(probs=_probs_bytes(q))


_SUM_TOLERANCE = 1e-3


def dist_from_proto(msg: pb.Distribution, vocab_size: int | None = None, what: str = "distribution") -> Distribution:
    """Distribution -> dense float32 tensor [V] or SparseDist (on the CPU).

    With ``vocab_size`` the ids / dense length are checked against it: a dense
    distribution may be shorter (it covers the first ids, the others have
    probability 0: a draft that holds fewer rows than its target), not longer."""
    import torch

    from specdec.core.sampling import SparseDist

    raw = msg.probs
    if len(raw) % 4:
        raise InvalidRequest(f"{what}: probs has {len(raw)} bytes, not a whole number of float32 values")
    # Checked in numpy: a few µs where torch's small ops took ~80 per distribution,
    # γ times per round on the target's critical path.
    values = np.frombuffer(raw, dtype=_F32_LE).astype(np.float32)  # astype copies: writable
    n = values.size
    if n == 0:
        raise InvalidRequest(f"{what}: probs is empty")
    if not np.isfinite(values).all() or (values < 0).any():
        raise InvalidRequest(f"{what}: probabilities must be finite and >= 0")
    if not values.any():
        raise InvalidRequest(f"{what}: all probabilities are 0")
    probs = torch.from_numpy(values)
    if len(msg.ids) == 0:
        if vocab_size is not None and n > vocab_size:
            raise InvalidRequest(f"{what}: dense distribution has {n} values, the vocabulary has {vocab_size}")
        _check_sum(values, what)
        return probs
    if len(msg.ids) != n:
        raise InvalidRequest(f"{what}: {len(msg.ids)} ids but {n} probabilities")
    ids = np.array(msg.ids, dtype=np.int64)
    if vocab_size is not None and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = next(int(i) for i in msg.ids if not 0 <= i < vocab_size)
        raise InvalidRequest(f"{what}: token id {bad} is outside the vocabulary [0, {vocab_size})")
    if n > 1 and not np.diff(np.sort(ids)).all():  # a repeat sorts next to itself
        raise InvalidRequest(f"{what}: ids are not unique")
    _check_sum(values, what)
    return SparseDist(ids=torch.from_numpy(ids), probs=probs)


def _check_sum(values: np.ndarray, what: str) -> None:
    """The acceptance test reads q(y) as a probability: a q that does not sum to 1
    would silently bias it. A normalised q's float32 rounding is far inside this."""
    total = float(values.sum(dtype=np.float64))
    if abs(total - 1.0) > _SUM_TOLERANCE:
        raise InvalidRequest(f"{what}: probabilities must sum to 1, got {total:.6g}")


def dist_prob(q: Distribution, token: int) -> float:
    """q(token) for a dense or sparse distribution (unnormalised, as sent); 0
    for an id past a dense q's last."""
    from specdec.core.sampling import SparseDist

    if isinstance(q, SparseDist):
        hit = (q.ids == token).nonzero()
        return float(q.probs[hit[0, 0]]) if hit.numel() else 0.0
    return float(q[token]) if 0 <= token < q.shape[0] else 0.0


# ------------------------------------------------------------------ draft tokens


def draft_token_to_proto(d: DraftToken, timing: ServerTiming | None = None) -> pb.DraftToken:
    msg = pb.DraftToken(token=d.token)
    if d.q is not None:
        msg.q.CopyFrom(dist_to_proto(d.q))
    if timing is not None:
        msg.timing.CopyFrom(timing_to_proto(timing))
    return msg


def draft_token_from_proto(msg: pb.DraftToken, vocab_size: int | None = None) -> DraftToken:
    q = dist_from_proto(msg.q, vocab_size, f"q of draft token {msg.token}") if msg.HasField("q") else None
    return DraftToken(token=msg.token, q=q)


# ------------------------------------------------------------------ verdicts and timings


def verdict_to_proto(v: Verdict, timing: ServerTiming | None = None) -> pb.VerifyResponse:
    msg = pb.VerifyResponse(accepted=v.accepted, next_token=v.next_token, decoded_tokens=v.decoded)
    if timing is not None:
        msg.timing.CopyFrom(timing_to_proto(timing))
    return msg


def verdict_from_proto(msg: pb.VerifyResponse) -> Verdict:
    """With the forward passes it ran in, when the target reported them."""
    return verify_reply_from_proto(msg).verdict


def timing_to_proto(t: ServerTiming) -> pb.ServerTiming:
    return pb.ServerTiming(**dataclasses.asdict(t.reported()))


def timing_from_proto(msg: pb.ServerTiming) -> CallTiming:
    return CallTiming(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(CallTiming)})


# ------------------------------------------------------------------ replies (coordinator side)


@dataclasses.dataclass(frozen=True)
class DraftReply:
    """A draft's ProposeAll reply. Each q is a WireDist, for the target's Verify."""

    drafts: list[DraftToken]
    timing: CallTiming
    first_draft_s: float  # from the call's arrival at the draft to its first draft
    last_draft_s: float  # ... and to its last
    prepared: bool  # every draft was made ahead, before the call came
    wire_bytes: int  # the reply's size on the wire

    @property
    def drafting_s(self) -> float:
        """The draft's time from its first draft to its last."""
        return self.last_draft_s - self.first_draft_s


def draft_reply_from_proto(msg: pb.Proposal) -> DraftReply:
    drafts = [DraftToken(d.token, WireDist(d.q) if d.HasField("q") else None) for d in msg.drafts]
    return DraftReply(drafts, timing_from_proto(msg.timing), msg.first_draft_s, msg.last_draft_s, msg.prepared,
                      msg.ByteSize())


@dataclasses.dataclass(frozen=True)
class VerifyReply:
    """A target's Verify reply."""

    verdict: Verdict
    timing: CallTiming
    wire_bytes: int  # the reply's size on the wire


def verify_reply_from_proto(msg: pb.VerifyResponse) -> VerifyReply:
    timing = timing_from_proto(msg.timing)
    verdict = Verdict(msg.accepted, msg.next_token, timing.pass_load(), tuple(msg.decoded_tokens))
    return VerifyReply(verdict, timing, msg.ByteSize())


def wire_bytes(request: pb.ProposeRequest | pb.VerifyRequest) -> int:
    """A request's size on the wire (one this module built)."""
    return request.ByteSize()


def tokenizer_file_from_proto(chunk: pb.TokenizerChunk) -> tuple[str, bytes]:
    """A GetTokenizer chunk: (file name, the next piece of that file)."""
    return chunk.file, chunk.data


def ended_from_proto(msg: pb.EndSessionResponse) -> bool:
    """Whether the service held the session EndSession freed."""
    return msg.existed


# ------------------------------------------------------------------ model facts (coordinator side)


def model_facts_from_proto(msg: pb.ModelInfo) -> ModelFacts:
    return ModelFacts(model_name=msg.model_name, vocab_size=msg.vocab_size, vocab_fingerprint=msg.vocab_fingerprint,
                      max_context=msg.max_context, eos_token_ids=frozenset(msg.eos_token_ids),
                      gamma_max=msg.gamma_max if msg.HasField("gamma_max") else None,
                      architecture=msg.architecture, has_tokenizer=msg.has_tokenizer)


# ------------------------------------------------------------------ requests (coordinator side)


def model_info_request() -> pb.ModelInfoRequest:
    return pb.ModelInfoRequest()


def tokenizer_request() -> pb.TokenizerRequest:
    return pb.TokenizerRequest()


def end_session_request(session_id: str) -> pb.EndSessionRequest:
    return pb.EndSessionRequest(session_id=session_id)


def propose_request(
    session_id: str,
    round_id: int,
    position: int,
    new_tokens: Iterable[int],
    gamma: int,
    params: SamplingParams,
    draft_top_k: int = 0,
    target_vocab_size: int = 0,
) -> pb.ProposeRequest:
    return pb.ProposeRequest(
        session_id=session_id, round_id=round_id, position=position, new_tokens=list(new_tokens),
        gamma=gamma, sampling=sampling_to_proto(params), draft_top_k=draft_top_k,
        target_vocab_size=target_vocab_size,
    )


def verify_request(
    session_id: str,
    round_id: int,
    position: int,
    new_tokens: Iterable[int],
    drafts: list[DraftToken],
    params: SamplingParams,
    decode: int = 0,
) -> pb.VerifyRequest:
    """Under greedy decoding no q is sent (the target does not need it). Each
    draft's q: a WireDist (forwarded as the draft sent it) or a distribution."""
    msg = pb.VerifyRequest(
        session_id=session_id, round_id=round_id, position=position, new_tokens=list(new_tokens),
        draft_tokens=[d.token for d in drafts], sampling=sampling_to_proto(params), decode_tokens=decode,
    )
    if not params.greedy:
        for d in drafts:
            if d.q is None:
                raise ValueError(f"draft token {d.token} has no q; sampling needs one per draft")
            msg.draft_q.append(dist_to_proto(d.q))
    return msg


# ------------------------------------------------------------------ Generate (client <-> coordinator)


def generate_request(job: GenerateJob) -> pb.GenerateRequest:
    """``draft_top_k`` / ``resume_after`` None leave the optional field unset."""
    return pb.GenerateRequest(
        session_id=job.session_id, prompt=job.prompt, prompt_ids=list(job.prompt_ids),
        max_new_tokens=job.max_new_tokens, sampling=sampling_to_proto(job.sampling), gamma_policy=job.gamma_policy,
        stop=list(job.stop), draft_top_k=job.draft_top_k, turn_id=job.turn_id,
        resume_after=job.resume_after)


def job_from_proto(request: pb.GenerateRequest) -> GenerateJob:
    return GenerateJob(
        prompt=request.prompt,
        prompt_ids=tuple(request.prompt_ids),
        max_new_tokens=request.max_new_tokens,
        sampling=sampling_from_proto(request.sampling if request.HasField("sampling") else None),
        gamma_policy=request.gamma_policy,
        stop=tuple(request.stop),
        session_id=request.session_id,
        draft_top_k=request.draft_top_k if request.HasField("draft_top_k") else None,
        turn_id=request.turn_id,
        resume_after=request.resume_after if request.HasField("resume_after") else None,
    )


def event_to_proto(event: Delta | GenerationStats) -> pb.GenerateResponse:
    if isinstance(event, Delta):
        return pb.GenerateResponse(delta=pb.TokenDelta(token_ids=event.token_ids, text=event.text))
    return pb.GenerateResponse(stats=pb.GenerationStats(**dataclasses.asdict(event)))


def event_from_proto(msg: pb.GenerateResponse) -> Delta | GenerationStats:
    if msg.HasField("delta"):
        return Delta(list(msg.delta.token_ids), msg.delta.text)
    stats = msg.stats
    values = {f.name: getattr(stats, f.name) for f in dataclasses.fields(GenerationStats)}
    values["gammas"] = list(stats.gammas)
    values["accepted_per_round"] = list(stats.accepted_per_round)
    return GenerationStats(**values)


def close_session_response(existed: bool) -> pb.CloseSessionResponse:
    return pb.CloseSessionResponse(existed=existed)
