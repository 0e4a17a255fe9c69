"""The OpenAI API's requests and responses, and their conversion to and from a
Generate's (:class:`GenerateJob`; :class:`Delta` events, then
:class:`GenerationStats`).

Requests are pydantic models that forbid fields they do not declare: a
parameter specdec does not know is refused (400, naming it), never ignored.
Parameters OpenAI defines that specdec cannot honour (``n`` > 1, ``logprobs``,
``echo``, tools, penalties ...) are declared, and refused by
:func:`refuse_unsupported` unless they hold their neutral value. Responses are
plain dicts in OpenAI's shapes (``text_completion``, ``chat.completion`` and
their streamed chunks), with the request's speculation figures under
``metrics.speculative_decoding`` in vLLM's names.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from specdec.core.interfaces import SamplingParams
from specdec.serving import errors
from specdec.serving.generation import Delta, GenerateJob, GenerationStats

# OpenAI's default for /v1/completions; a chat's is what the context leaves (up to --max-new-tokens-cap).
DEFAULT_COMPLETION_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0  # OpenAI's: sampling, with a seed drawn for the request when it gives none
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
MAX_MESSAGES = 4096  # a chat request's messages, at most (each is checked, then rendered)


class ParameterError(errors.InvalidRequest):
    """A request parameter that is wrong or not supported: 400, naming it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = None  # vLLM's: refused unless false


class _Request(BaseModel):
    """What both endpoints take."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1 (vLLM's "off"): no top-k filter
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    # specdec's own (the SDKs' extra_body)
    session_id: str | None = None
    gamma_policy: str | None = None
    # OpenAI's, refused unless neutral (see NEUTRAL)
    n: Any = None
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Any = None
    best_of: Any = None
    suffix: Any = None


class ChatRequest(_Request):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = Field(None, ge=1)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None


# The values of OpenAI's parameters that ask for nothing specdec lacks.
NEUTRAL: dict[str, tuple] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
    "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}


def refuse_unsupported(request: _Request) -> None:
    """ParameterError naming the first parameter that asks for what specdec
    does not do."""
    for name, neutral in NEUTRAL.items():
        if name in type(request).model_fields:
            value = getattr(request, name)
            if not any(_same(value, allowed) for allowed in neutral):
                raise ParameterError(f"{name} is not supported by this server (specdec): leave it out", name)
    options = request.stream_options
    if options is not None and options.continuous_usage_stats:
        raise ParameterError("stream_options.continuous_usage_stats is not supported: usage comes in the last "
                             "chunk (include_usage)", "stream_options")


def _same(value, allowed) -> bool:
    """``value`` is ``allowed`` (a number equal to it; True is not 1, nor False 0)."""
    if value is None or allowed is None or isinstance(value, bool) or isinstance(allowed, bool):
        return value is allowed
    if isinstance(value, (int, float)) and isinstance(allowed, (int, float)):
        return value == allowed
    return type(value) is type(allowed) and value == allowed


# ------------------------------------------------------------------ requests -> GenerateJob


def completion_prompt(request: CompletionRequest) -> tuple[str, tuple[int, ...]]:
    """``(text, ())`` or ``("", token ids)``: one prompt (a list of one is
    fine; more than one is refused)."""
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ParameterError(f"prompt holds {len(prompt)} prompts: this server takes one prompt per request",
                                 "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ParameterError("prompt is empty", "prompt")
        return prompt, ()
    if not prompt:
        raise ParameterError("prompt is empty", "prompt")
    return "", tuple(prompt)


def completion_job(request: CompletionRequest, max_tokens_cap: int) -> GenerateJob:
    """The request's own faults (ParameterError), then its job."""
    refuse_unsupported(request)
    text, ids = completion_prompt(request)
    budget = _max_tokens(request.max_tokens, "max_tokens", DEFAULT_COMPLETION_TOKENS, max_tokens_cap)
    return _job(request, budget, prompt=text, prompt_ids=ids)


def chat_budget(request: ChatRequest, max_tokens_cap: int) -> int:
    """The request's own faults (ParameterError), found before it is admitted:
    what it asks for that specdec does not do, its token budget past the cap,
    too many messages. Returns its token budget (for :func:`chat_job`)."""
    refuse_unsupported(request)
    if len(request.messages) > MAX_MESSAGES:
        raise ParameterError(f"messages holds {len(request.messages)} messages: this server takes at most "
                             f"{MAX_MESSAGES} a request", "messages")
    given, name = (request.max_completion_tokens, "max_completion_tokens") if request.max_completion_tokens \
        else (request.max_tokens, "max_tokens")
    return _max_tokens(given, name, max_tokens_cap, max_tokens_cap)


def chat_job(request: ChatRequest, prompt: str, max_tokens: int) -> GenerateJob:
    """``prompt``: the messages as the chat template rendered them;
    ``max_tokens``: what :func:`chat_budget` returned."""
    return _job(request, max_tokens, prompt=prompt)


def _max_tokens(given: int | None, name: str, default: int, cap: int) -> int:
    if given is None:
        return min(default, cap)
    if given > cap:
        raise ParameterError(f"{name} {given} is more than this server allows ({cap}: its --max-new-tokens-cap)",
                             name)
    return given


def _job(request: _Request, max_tokens: int, prompt: str = "", prompt_ids: tuple[int, ...] = ()) -> GenerateJob:
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    return GenerateJob(prompt=prompt, prompt_ids=prompt_ids, max_new_tokens=max_tokens, sampling=sampling(request),
                       gamma_policy=request.gamma_policy or "", stop=stop, session_id=request.session_id or "")


def sampling(request: _Request) -> SamplingParams:
    """OpenAI's defaults: temperature 1, no top-p or top-k filter; no seed: the
    coordinator draws one for the request."""
    temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    top_k = max(0, request.top_k or 0)
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=request.seed)


# ------------------------------------------------------------------ events -> responses


@dataclasses.dataclass
class Reply:
    """One response's identity: its id, when it was made, the model, and its kind."""

    chat: bool
    model: str
    id: str = ""
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, stats: GenerationStats) -> dict[str, Any]:
        """The whole (non-streamed) response."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish_reason(stats))
        body = self._head("chat.completion" if self.chat else "text_completion")
        body.update(choices=[choice], usage=usage(stats), metrics=metrics(stats))
        return body

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              with_usage: bool = False) -> dict[str, Any]:
        """A streamed chunk: a delta's ``text``, or (``finish``) the last one;
        a chat's first carries the assistant's ``role``."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice.update(logprobs=None, finish_reason=finish)
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice]
        if with_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, stats: GenerationStats) -> dict[str, Any]:
        """``stream_options.include_usage``'s last chunk: no choices, the usage and the metrics."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=usage(stats), metrics=metrics(stats))
        return body

    def stream(self, event: Delta | GenerationStats, first: bool, with_usage: bool) -> list[dict[str, Any]]:
        """The chunks one event becomes."""
        if isinstance(event, Delta):
            return [self.chunk(event.text, role=first, with_usage=with_usage)]
        chunks = [self.chunk(finish=finish_reason(event), role=first, with_usage=with_usage)]
        if with_usage:
            chunks.append(self.usage_chunk(event))
        return chunks


def finish_reason(stats: GenerationStats) -> str:
    """specdec's eos and stop are OpenAI's "stop"; length is "length"."""
    return FINISH_REASONS.get(stats.finish_reason, stats.finish_reason)


def usage(stats: GenerationStats) -> dict[str, int]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens}


def metrics(stats: GenerationStats) -> dict[str, Any]:
    """The request's speculation, in vLLM's names (``num_drafts``: rounds that
    drafted; ``mean_acceptance_length``: tokens per drafting round, its own
    token included; ``draft_acceptance_rate``: accepted / drafted, a fraction),
    with specdec's rounds and γ per round."""
    drafts = sum(1 for gamma in stats.gammas if gamma > 0)
    longest = max(stats.gammas, default=0)
    per_position = [sum(1 for gamma, accepted in zip(stats.gammas, stats.accepted_per_round, strict=False)
                        if gamma > i and accepted > i) for i in range(longest)]
    return {"speculative_decoding": {
        "num_drafts": drafts,
        "num_draft_tokens": stats.drafted_tokens,
        "num_accepted_tokens": stats.accepted_tokens,
        "num_accepted_tokens_per_pos": per_position,
        "mean_acceptance_length": 1 + stats.accepted_tokens / drafts if drafts else None,
        "draft_acceptance_rate": stats.accepted_tokens / stats.drafted_tokens if stats.drafted_tokens else None,
        "rounds": stats.rounds,
        "gammas": list(stats.gammas),
        "accepted_per_round": list(stats.accepted_per_round),
    }}


def collected(events: list[Delta | GenerationStats]) -> tuple[str, GenerationStats]:
    """A finished turn's text and stats."""
    stats = events[-1]
    assert isinstance(stats, GenerationStats)
    return "".join(e.text for e in events if isinstance(e, Delta)), stats

