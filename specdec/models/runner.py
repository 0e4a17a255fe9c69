"""Loading a causal LM from a local directory and running it over growing,
rewindable token sequences, many in one batched forward pass, each with its
keys and values in the model's paged KV store."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import pathlib

import torch

from specdec.core.interfaces import SamplingParams
from specdec.core.sampling import process_logits_rows
from specdec.core.vocabulary import check_token_ids
from specdec.models import lean_llama
from specdec.models.attention import BatchRow
from specdec.models.batched import BatchedModel, UnsupportedModel, architecture, check_config
from specdec.models.paged_kv import KVExhausted, PagedCache
from specdec.models.tokenizer import load_tokenizer, vocabulary_fingerprint

# Never reach for a hub: models come from local directories only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# On a CUDA device, passes of up to this many tokens replay CUDA graphs of the
# whole pass (specdec.models.cuda_graphs): decoding batches.
GRAPH_TOKENS = 256
# Positions per KV block: FlashAttention's paged kernel wants 256 on CUDA.
BLOCK_SIZE = {"cuda": 256}
DEFAULT_BLOCK_SIZE = 16
# The KV budget of a runner not given one (the in-process decoder's): this many
# sequences of the model's whole context (grown on demand off CUDA).
IN_PROCESS_SEQUENCES = 8

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Sequence:
    """One session's view in one model: every token it holds, and the KV cache of
    a prefix of them. ``tokens[cache_length:]`` are pending (appended but not yet
    run through the model)."""

    tokens: list[int]
    cache: PagedCache

    @property
    def cache_length(self) -> int:
        return self.cache.length


@dataclasses.dataclass
class Pass:
    """What one sequence asks of a forward pass: logits predicting the tokens
    after each of the last ``last`` positions of ``seq.tokens``, with at least
    the last ``run`` tokens run (recomputed if cached). :meth:`ModelRunner.run_passes`
    sets ``ran``: how many tokens it ran.

    Its reply (:func:`replies`) covers the first ``vocab`` ids (0: all of
    them) and, where ``params`` sample, is their probabilities rather than the
    logits: processed with every other sampling pass of the forward in one step."""

    seq: Sequence
    last: int = 1
    run: int = 0
    params: SamplingParams | None = None
    vocab: int = 0
    ran: int = 0


@dataclasses.dataclass(frozen=True)
class KVSettings:
    """How a runner stores keys and values (:mod:`specdec.models.paged_kv`).

    ``tokens``: the budget in positions (0: IN_PROCESS_SEQUENCES whole
    contexts); on CUDA at most what ``memory_fraction`` of the device's free
    memory holds. ``block_size`` 0: the device's default.
    ``keep_behind``: how deep a rollback keeps a sliding window's blocks.
    ``kernel``: ``padded`` | ``varlen`` | None (the device's default)."""

    tokens: int = 0
    block_size: int = 0
    memory_fraction: float = 0.8
    keep_behind: int = 64
    kernel: str | None = None


class ModelRunner:
    """A Hugging Face causal LM on one device, with its tokenizer when it has one.

    Every model runs through :class:`specdec.models.batched.BatchedModel`:
    several sequences in one pass (:meth:`run_passes`), keys and values in one
    paged store. ``lean=True`` runs a plain Llama's layers through
    :mod:`specdec.models.lean_llama` (less Python per token, the same store and
    attention); on a CUDA device decode-sized passes replay CUDA graphs unless
    ``cuda_graphs=False``. A model that cannot run batched is refused here
    (:class:`UnsupportedModel`, a ValueError naming the architecture and why)."""

    def __init__(self, path: str | os.PathLike, device: str = "cpu", dtype: str = "float32", *,
                 lean: bool = False, cuda_graphs: bool = True, kv: KVSettings | None = None):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.path = pathlib.Path(path)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"{self.path} is not a model directory (no config.json)")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = parse_device(device)
        config = AutoConfig.from_pretrained(self.path, local_files_only=True)
        check_config(config)  # before loading any weights
        try:
            model = AutoModelForCausalLM.from_pretrained(self.path, dtype=DTYPES[dtype], local_files_only=True)
        except ValueError as e:  # no causal-LM class for this config
            raise UnsupportedModel(f"model_type {config.model_type!r} cannot be served: {e}") from None
        self.model = model.to(self.device).eval()
        self.max_context: int = getattr(model.config, "max_position_embeddings", None) or 2048
        kv = kv or KVSettings()
        self.forward = BatchedModel(
            self.model, max_tokens=kv.tokens or IN_PROCESS_SEQUENCES * self.max_context,
            memory_fraction=kv.memory_fraction, kernel=kv.kernel,
            block_size=block_size_for(self.device, kv.block_size),
            keep_behind=kv.keep_behind)
        if lean:
            reason = lean_llama.unsupported_reason(self.model)
            if reason is None:
                self.forward.lean = lean_llama.LeanLlama(self.model)
            else:
                log.info("%s runs its own modules, not the lean Llama layers: %s", self.path, reason)
        if cuda_graphs and self.device.type == "cuda":
            self.forward.record_graphs(GRAPH_TOKENS)
        self.tokens_run = 0  # tokens through the model, for metrics
        config = self.model.config
        self.vocab_size: int = config.vocab_size
        self.tokenizer = load_tokenizer(self.path)
        self.eos_token_ids: set[int] = _eos_ids(config, self.tokenizer)
        # What a draft runs in place of an id only its target holds (a row of
        # the target's padding): the drafts that follow are a worse guess, never
        # a wrong output, since q is exactly what they were sampled from.
        pad = getattr(config, "pad_token_id", None)
        self.placeholder_id: int = pad if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0
        self.fingerprint: str = vocabulary_fingerprint(self.path, self.vocab_size)
        self.architecture = architecture(self.model)

    @property
    def kv_bytes_per_token(self) -> int:
        """Device memory one position of one session's KV takes: keys and values
        of every layer."""
        return self.forward.kv.bytes_per_token

    @property
    def kv_block_size(self) -> int:
        return self.forward.kv.block_size

    @property
    def kv_capacity(self) -> int:
        """Positions the KV store holds per group (the budget, in whole blocks)."""
        return self.forward.kv.max_tokens

    @property
    def lean(self) -> bool:
        return self.forward.lean is not None

    @property
    def name(self) -> str:
        return self.path.name

    def new_sequence(self) -> Sequence:
        return Sequence(tokens=[], cache=self.new_cache())

    def new_cache(self) -> PagedCache:
        """An empty KV cache for one sequence of this model (its blocks go back
        to the pool when it is garbage collected)."""
        return self.forward.new_cache()

    def fork(self, seq: Sequence, position: int) -> Sequence:
        """A new sequence holding ``seq``'s first ``position`` tokens and a copy
        of the KV cache of as many of them as ``seq`` holds: a branch drafting
        on from there leaves ``seq`` as it is."""
        return Sequence(tokens=seq.tokens[:position], cache=self.forward.kv.fork(seq.cache, position))

    def rollback(self, seq: Sequence, position: int) -> None:
        """Keep the first ``position`` tokens (and at most that much cache)."""
        if position > len(seq.tokens):
            raise ValueError(f"cannot roll back to {position}: only {len(seq.tokens)} tokens held")
        del seq.tokens[position:]
        self.uncache(seq, position)

    def uncache(self, seq: Sequence, keep: int) -> None:
        """Keep at most the first ``keep`` positions in the KV cache; the tokens
        stay, and the next pass runs the rest."""
        if seq.cache_length > keep:
            self.forward.kv.crop(seq.cache, keep)

    def logits(self, seq: Sequence, last: int = 1, run: int = 0) -> torch.Tensor:
        """Run the pending tokens; return float32 logits [last, V] predicting the
        tokens after each of the last ``last`` positions of ``seq.tokens``.

        If fewer than ``max(last, run)`` tokens are pending, the cache is rewound so
        that they are recomputed (e.g. the same sequence asked twice, or a pass
        repeated exactly: ``run`` fixes which tokens go through it together)."""
        return self.run_passes([Pass(seq, last, run)])[0]

    @property
    def batched(self) -> bool:
        """Whether :meth:`run_passes` may run several sequences in one forward
        pass (not for rotary scalings that depend on the sequence's length)."""
        return self.forward.batched

    @torch.inference_mode()
    def run_passes(self, passes: list[Pass]) -> list[torch.Tensor]:
        """For several sequences (distinct ones), in one forward pass: each
        pass's reply (:func:`replies`), logits as :meth:`logits` gives them or
        probabilities."""
        rows = [self._pending(p) for p in passes]
        self.tokens_run += sum(len(ids) for ids in rows)
        if any(max(ids) >= self.vocab_size for ids in rows):  # the target's own ids a draft lacks
            rows = [[t if t < self.vocab_size else self.placeholder_id for t in ids] for ids in rows]
        batch = [BatchRow(ids, p.seq.cache, p.last) for ids, p in zip(rows, passes, strict=True)]
        try:
            logits = self.forward.forward_batch(batch)
        except KVExhausted:
            gc.collect()  # caches of dropped sequences in reference cycles give their blocks back
            logits = self.forward.forward_batch(batch)
        return replies(passes, [out.float() for out in logits])

    def pass_tokens(self, p: Pass) -> int:
        """How many tokens :meth:`run_passes` will run for ``p``."""
        held = len(p.seq.tokens)
        return held - max(0, min(p.seq.cache_length, held - max(p.last, p.run)))

    def _pending(self, p: Pass) -> list[int]:
        """The tokens ``p`` runs, its cache rewound to just before them."""
        seq = p.seq
        if not seq.tokens:
            raise ValueError("cannot run an empty sequence")
        if len(seq.tokens) > self.max_context:
            raise ValueError(
                f"sequence of {len(seq.tokens)} tokens exceeds the model context of {self.max_context}"
            )
        start = min(seq.cache_length, len(seq.tokens) - max(p.last, p.run))
        if start < seq.cache_length:
            start = self.forward.kv.crop(seq.cache, start)  # 0 where a sliding window must be run again
        p.ran = len(seq.tokens) - start
        return seq.tokens[start:]

    def check_tokens(self, tokens: list[int], what: str = "tokens") -> None:
        check_token_ids(tokens, self.vocab_size, what)


def replies(passes: list[Pass], logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """What each pass is sent back, from its logits [last, V]: their first
    ``vocab`` ids, and for a sampling pass their probabilities. The rows of
    all sampling passes are processed together, in one batched step
    (:func:`process_logits_rows`) per width: each row exactly as alone."""
    out = [x[:, :p.vocab] if p.vocab else x for p, x in zip(passes, logits, strict=True)]
    sampling = [i for i, p in enumerate(passes) if p.params is not None and not p.params.greedy]
    for width in {out[i].shape[-1] for i in sampling}:  # one width unless drafts cut to their target's ids
        group = [i for i in sampling if out[i].shape[-1] == width]
        params = [passes[i].params for i in group for _ in range(passes[i].last)]  # one per row
        probs = process_logits_rows(torch.cat([out[i] for i in group]), params)  # [rows, width]
        for i, rows in zip(group, probs.split([passes[i].last for i in group]), strict=True):
            out[i] = rows
    return out


def parse_device(device: str | torch.device) -> torch.device:
    """A torch device that exists here; ValueError saying why not otherwise
    (rather than an assertion deep inside the first ``.to()``)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device}: CUDA is not available (torch {torch.__version__}, "
                             f"{'built without CUDA' if torch.version.cuda is None else 'no GPU visible'})")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif parsed.type != "cpu":  # mps, xpu, ...: torch.<type>.is_available() where torch has one
        available = getattr(getattr(torch, parsed.type, None), "is_available", None)
        if available is None or not available():
            raise ValueError(f"device {device}: {parsed.type} is not available here (torch {torch.__version__})")
    return parsed


def block_size_for(device: str | torch.device, requested: int = 0) -> int:
    """Positions per KV block: ``requested``, or the device's default."""
    return requested or BLOCK_SIZE.get(torch.device(device).type, DEFAULT_BLOCK_SIZE)


def _eos_ids(config, tokenizer) -> set[int]:
    ids = getattr(config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}
