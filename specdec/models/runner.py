"""Loading a causal LM from a local directory and running it over a growing,
rewindable token sequence with a KV cache."""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib

import torch

from specdec.core.vocabulary import check_token_ids
from specdec.models import kv_cache
from specdec.models.lean_llama import BatchRow, LeanLlama, unsupported_reason
from specdec.models.tokenizer import load_tokenizer, vocabulary_fingerprint

# Never reach for a hub: models come from local directories only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# On a CUDA device, passes of up to this many tokens replay CUDA graphs of the
# lean forward's per-layer work (specdec.models.cuda_graphs): decoding batches.
GRAPH_TOKENS = 256

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Sequence:
    """One session's view in one model: every token it holds, and the KV cache of
    a prefix of them. ``tokens[cache_length:]`` are pending (appended but not yet
    run through the model)."""

    tokens: list[int]
    cache: object

    @property
    def cache_length(self) -> int:
        return kv_cache.cache_length(self.cache)


@dataclasses.dataclass
class Pass:
    """What one sequence asks of a forward pass: logits predicting the tokens
    after each of the last ``last`` positions of ``seq.tokens``, with at least
    the last ``run`` tokens run (recomputed if cached). :meth:`ModelRunner.run_passes`
    sets ``ran``: how many tokens it ran."""

    seq: Sequence
    last: int = 1
    run: int = 0
    ran: int = 0


class ModelRunner:
    """A Hugging Face causal LM on one device, with its tokenizer when it has one.

    ``lean=True`` runs a Llama-architecture model through specdec.models.lean_llama:
    the same weights with less Python per token, and several sequences in one
    pass (:meth:`run_passes`), on a CUDA device through CUDA graphs unless
    ``cuda_graphs=False``. Other models keep Hugging Face's forward, with a log
    line saying why."""

    def __init__(self, path: str | os.PathLike, device: str = "cpu", dtype: str = "float32", *,
                 lean: bool = False, cuda_graphs: bool = True):
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.path = pathlib.Path(path)
        if not (self.path / "config.json").is_file():
            raise ValueError(f"{self.path} is not a model directory (no config.json)")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.device = parse_device(device)
        self.model = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=DTYPES[dtype], local_files_only=True
        ).to(self.device)
        self.model.eval()
        self.forward_model: torch.nn.Module | LeanLlama = self.model  # what kv_cache.forward runs
        if lean:
            reason = unsupported_reason(self.model)
            if reason is None:
                graphs = cuda_graphs and self.device.type == "cuda"
                self.forward_model = LeanLlama(self.model, graph_tokens=GRAPH_TOKENS if graphs else 0)
            else:
                log.info("%s runs Hugging Face's forward, not the lean one: %s", self.path, reason)
        self.tokens_run = 0  # tokens through the model, for metrics
        config = self.model.config
        self.vocab_size: int = config.vocab_size
        self.max_context: int = getattr(config, "max_position_embeddings", None) or 2048
        self.tokenizer = load_tokenizer(self.path)
        self.eos_token_ids: set[int] = _eos_ids(config, self.tokenizer)
        self.fingerprint: str = vocabulary_fingerprint(self.path, self.vocab_size)

    @property
    def kv_bytes_per_token(self) -> int:
        """Device memory one token of one session's KV cache takes: keys and values
        of every layer."""
        config = self.model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        element = self.model.get_input_embeddings().weight.element_size()
        return 2 * config.num_hidden_layers * kv_heads * head_dim * element

    @property
    def lean(self) -> bool:
        return isinstance(self.forward_model, LeanLlama)

    @property
    def name(self) -> str:
        return self.path.name

    def new_sequence(self) -> Sequence:
        return Sequence(tokens=[], cache=self.new_cache())

    def new_cache(self) -> object:
        """An empty KV cache for one sequence of this model."""
        return kv_cache.new_cache(self.forward_model)

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
            kv_cache.crop_cache(seq.cache, keep)

    def logits(self, seq: Sequence, last: int = 1, run: int = 0) -> torch.Tensor:
        """Run the pending tokens; return float32 logits [last, V] predicting the
        tokens after each of the last ``last`` positions of ``seq.tokens``.

        If fewer than ``max(last, run)`` tokens are pending, the cache is rewound so
        that they are recomputed (e.g. the same sequence asked twice, or a pass
        repeated exactly: ``run`` fixes which tokens go through it together)."""
        return self.run_passes([Pass(seq, last, run)])[0]

    @property
    def batched(self) -> bool:
        """Whether :meth:`run_passes` runs several sequences in one forward pass
        (the lean forward), rather than one after another."""
        return self.lean

    @torch.inference_mode()
    def run_passes(self, passes: list[Pass]) -> list[torch.Tensor]:
        """:meth:`logits` for several sequences (distinct ones), in one forward pass
        where the model runs through the lean forward, else one pass each."""
        rows = [self._pending(p) for p in passes]
        self.tokens_run += sum(len(ids) for ids in rows)
        if self.lean:
            batch = [BatchRow(ids, p.seq.cache, p.last) for ids, p in zip(rows, passes, strict=True)]
            logits = self.forward_model.forward_batch(batch)
        else:
            logits = [kv_cache.forward(self.forward_model, torch.tensor([ids], dtype=torch.long, device=self.device),
                                       p.seq.cache, logits_to_keep=p.last) for ids, p in zip(rows, passes, strict=True)]
        return [out.float() for out in logits]

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
            kv_cache.crop_cache(seq.cache, start)
        p.ran = len(seq.tokens) - start
        return seq.tokens[start:]

    def check_tokens(self, tokens: list[int], what: str = "tokens") -> None:
        check_token_ids(tokens, self.vocab_size, what)


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


def _eos_ids(config, tokenizer) -> set[int]:
    ids = getattr(config, "eos_token_id", None)
    if ids is None and tokenizer is not None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}
