"""``specdec train-models``: train the bundled target/draft pair from scratch.

Why this exists: the machines this project runs on cannot download models, yet the
demo, the benchmarks and every acceptance-rate figure need a *real* pair -- a target
that has learnt something and a draft that agrees with it.  The one corpus present on
every machine is the source of the Python standard library of the running
interpreter, so both models are code-completion models for stdlib Python.

Pipeline (each phase is resumable from the work directory):

1. corpus   -- every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` in sorted
               relative-path order, minus ``site-packages`` and test directories;
               a fixed ~5 % of files (hash of the relative path) is held out.
2. tokenizer-- byte-level BPE (vocab 4096) trained on the training files only.
3. target   -- an 8-layer Llama trained with plain next-token cross-entropy.
4. draft    -- a 1-layer Llama distilled from the target: KL(target || draft),
               first on corpus windows (off-policy), then on the target's own
               greedy continuations of corpus prefixes (on-policy): those are the
               sequences the draft must predict during speculative decoding.
5. export   -- both saved in bf16, Hugging Face format, with the tokenizer.

Reproducibility: seeds are fixed and the data order is a pure function of
(seed, step).  By default the learning-rate schedule follows *time* -- the compute
time the process gets, capped in wall time -- so that the command fits its budget
on any machine; the number of steps done therefore depends on the machine's speed
and load.  Pass ``--target-steps``/``--draft-steps`` to get a
step-based schedule that is bit-for-bit repeatable on the same software stack.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

EOS_TOKEN = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 512
TARGET_MAX_POSITIONS = 1024
HELD_OUT_MODULUS = 20  # 1 in 20 files (~5 %) is held out
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test"})

TARGET_CONFIG = dict(
    hidden_size=320,
    num_hidden_layers=8,
    num_attention_heads=5,
    num_key_value_heads=5,
    intermediate_size=864,
)
DRAFT_CONFIG = dict(
    hidden_size=256,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=768,
)

# Share of --minutes given to each training phase; the rest covers tokenizer
# training, corpus encoding, evaluation and export.
TARGET_SHARE = 0.60
DRAFT_SHARE = 0.12  # off-policy distillation on corpus windows
ONPOLICY_SHARE = 0.22  # on-policy distillation on the target's greedy continuations
ONPOLICY_PREFIX = 128  # corpus tokens before each continuation
ONPOLICY_NEW = 128  # greedy tokens the target adds to each prefix


# --------------------------------------------------------------------------- corpus


def stdlib_root() -> Path:
    """The standard-library directory of the interpreter running this code."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def is_held_out(rel_path: str) -> bool:
    """Fixed held-out rule: sha256 of the POSIX relative path, modulo 20, equals 0.

    A hash (rather than e.g. "every 20th file") keeps a file's membership stable
    when other files are added or removed in another Python version.
    """
    digest = hashlib.sha256(rel_path.encode("utf-8")).hexdigest()
    return int(digest, 16) % HELD_OUT_MODULUS == 0


def list_source_files(root: Path | None = None) -> list[str]:
    """All stdlib ``*.py`` files (POSIX relative paths), sorted, tests excluded."""
    root = root or stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        files.append(rel.as_posix())
    return sorted(files)


def split_files(root: Path | None = None) -> tuple[list[str], list[str]]:
    """(training files, held-out files), both in sorted order."""
    files = list_source_files(root)
    held = [f for f in files if is_held_out(f)]
    train = [f for f in files if not is_held_out(f)]
    return train, held


def read_source(rel_path: str, root: Path | None = None) -> str:
    """File text; undecodable bytes are replaced so that odd files cannot abort a run."""
    root = root or stdlib_root()
    return (root / rel_path).read_text(encoding="utf-8", errors="replace")


# ------------------------------------------------------------------------ tokenizer


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """Byte-level BPE over the training texts.

    Byte-level pre-tokenisation with the full 256-byte initial alphabet means any
    string -- tabs, blank lines, non-ASCII -- encodes without an unknown token and
    decodes back to exactly the same string.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, directory: Path) -> None:
    """Save so that ``AutoTokenizer.from_pretrained(directory)`` works offline."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=None,
        pad_token=EOS_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=TARGET_MAX_POSITIONS,
    )
    hf.save_pretrained(str(directory))



def encode_texts(tok, texts: list[str]) -> torch.Tensor:
    """One long int32 stream: file, EOS, file, EOS, ... in the given order."""
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------- models


def make_config(arch: dict, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=TARGET_MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        **arch,
    )


def make_model(arch: dict, eos_id: int, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(make_config(arch, eos_id))


def count_params(model) -> int:
    """Unique parameters (the tied embedding / LM head counted once)."""
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------- data order


class WindowSampler:
    """Deterministic batches of SEQ_LEN+1 windows from a token stream.

    Batch ``step`` is a pure function of (seed, step): the windows of each epoch
    are a seeded permutation of non-overlapping window starts.  Resuming at step k
    therefore continues with exactly the batches an uninterrupted run would see.
    """

    def __init__(self, tokens: torch.Tensor, batch_size: int, seed: int, seq_len: int = SEQ_LEN):
        self.tokens = tokens
        self.batch_size = batch_size
        self.seed = seed
        self.seq_len = seq_len
        self.n_windows = (len(tokens) - 1) // seq_len
        self._epoch = -1
        self._perm: torch.Tensor | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1000 + epoch)
            self._perm = torch.randperm(self.n_windows, generator=gen)
            self._epoch = epoch
        return self._perm

    def batch(self, step: int) -> torch.Tensor:
        rows = []
        for i in range(step * self.batch_size, (step + 1) * self.batch_size):
            epoch, idx = divmod(i, self.n_windows)
            start = int(self._permutation(epoch)[idx]) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1])
        return torch.stack(rows).long()


class GreedyContinuationSampler:
    """Batches of corpus prefixes continued greedily by the target (on-policy data).

    Under greedy speculative decoding the draft only ever sees the target's own
    greedy output, so that is the distribution to distil on (DistillSpec, Zhou et
    al. 2023).  Batch ``step`` is a pure function of (seed, step) and the target's
    weights: the prefixes come from a ``WindowSampler`` and greedy decoding is
    deterministic.  EOS is suppressed so every row has the same length.
    """

    def __init__(self, teacher, tokens: torch.Tensor, batch_size: int, seed: int,
                 prefix_len: int = ONPOLICY_PREFIX, new_tokens: int = ONPOLICY_NEW):
        self.teacher = teacher
        self.prefixes = WindowSampler(tokens, batch_size, seed, seq_len=prefix_len - 1)
        self.prefix_len = prefix_len
        self.new_tokens = new_tokens
        self.seq_len = prefix_len + new_tokens - 1  # inputs per row, as WindowSampler counts them

    @torch.no_grad()
    def batch(self, step: int) -> torch.Tensor:
        prefixes = self.prefixes.batch(step)
        return self.teacher.generate(input_ids=prefixes, attention_mask=torch.ones_like(prefixes),
                                     do_sample=False, max_new_tokens=self.new_tokens,
                                     min_new_tokens=self.new_tokens, pad_token_id=0)


# ------------------------------------------------------------------------ training


@dataclass
class PhaseSpec:
    """What differs between the target phase and the draft phase."""

    name: str
    budget_s: float
    max_steps: int | None  # None: schedule by time (see train_phase)
    lr: float
    batch_size: int
    seed: int
    warmup: float = 0.03  # fraction of the schedule
    min_lr_ratio: float = 0.1
    wall_cap: float = 1.5  # the phase ends at wall_cap * budget_s of wall time at the latest


def lr_at(progress: float, spec: PhaseSpec) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio * lr`` at progress 1."""
    if progress < spec.warmup:
        return spec.lr * max(progress, 1e-3) / spec.warmup
    p = min(1.0, (progress - spec.warmup) / (1 - spec.warmup))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def make_optimizer(model, lr: float) -> torch.optim.Optimizer:
    """AdamW; no weight decay on norms (1-D parameters)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of the target."""
    logits = model(input_ids=batch[:, :-1]).logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


def distill_loss(draft, teacher, batch: torch.Tensor, start: int = 0) -> torch.Tensor:
    """KL(p_target || q_draft), averaged over the positions from ``start`` on.

    Forward KL puts the draft's mass where the target's is, which is what raises
    the chance that the draft's argmax equals the target's argmax (greedy α).
    ``start`` skips the corpus prefix of on-policy rows: only the predictions of
    the target's own tokens count there.
    """
    inputs = batch[:, :-1]
    with torch.no_grad():
        t_logp = F.log_softmax(teacher(input_ids=inputs).logits[:, start:].float(), dim=-1)
    d_logp = F.log_softmax(draft(input_ids=inputs).logits[:, start:].float(), dim=-1)
    kl = (t_logp.exp() * (t_logp - d_logp)).sum(-1)
    return kl.mean()


def _save_checkpoint(path: Path, state: dict) -> None:
    """Atomic write: a crash mid-save leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def train_phase(model, loss_fn, sampler: WindowSampler | GreedyContinuationSampler, spec: PhaseSpec, ckpt: Path,
                checkpoint_every_s: float = 120.0) -> dict:
    """Run one phase to the end of its schedule, resuming from ``ckpt`` if present.

    Progress is steps/max_steps with a step schedule.  Otherwise it is the
    *compute* time the process got (CPU seconds / threads) over the budget, so that
    other load on a shared machine slows the run down instead of cutting training
    short -- bounded by ``wall_cap`` x budget of wall time.  Both clocks are stored
    in the checkpoint so a resumed run keeps its budget.
    """
    opt = make_optimizer(model, spec.lr)
    step, elapsed, wall, ema = 0, 0.0, 0.0, None
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        step, elapsed, ema = state["step"], state["elapsed"], state["ema"]
        wall = state.get("wall", elapsed)
        if state.get("done"):
            return state["summary"]
        print(f"[{spec.name}] resuming at step {step}, {elapsed:.0f}s elapsed", flush=True)

    def progress() -> float:
        if spec.max_steps:
            return step / spec.max_steps
        return max(elapsed / spec.budget_s, wall / (spec.wall_cap * spec.budget_s))

    model.train()
    total = spec.max_steps if spec.max_steps else int(spec.budget_s)
    bar = tqdm(total=total, desc=spec.name, unit="step" if spec.max_steps else "s",
               mininterval=10, file=sys.stderr)
    bar.update(step if spec.max_steps else int(elapsed))
    last_ckpt = time.monotonic()
    while progress() < 1.0:
        t0, c0 = time.monotonic(), time.process_time()
        for group in opt.param_groups:
            group["lr"] = lr_at(progress(), spec)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, sampler.batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        wall += time.monotonic() - t0
        elapsed += (time.process_time() - c0) / torch.get_num_threads()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        before = bar.n
        bar.update((step if spec.max_steps else int(elapsed)) - before)
        bar.set_postfix(step=step, loss=f"{ema:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)
        if time.monotonic() - last_ckpt > checkpoint_every_s:
            _save_checkpoint(ckpt, dict(model=model.state_dict(), optim=opt.state_dict(),
                                        step=step, elapsed=elapsed, wall=wall, ema=ema))
            last_ckpt = time.monotonic()
    bar.close()
    summary = dict(steps=step, compute_seconds=round(elapsed, 1), wall_seconds=round(wall, 1),
                   final_loss_ema=round(ema, 4),
                   tokens_seen=step * spec.batch_size * sampler.seq_len, lr=spec.lr,
                   batch_size=spec.batch_size, seq_len=sampler.seq_len)
    _save_checkpoint(ckpt, dict(model=model.state_dict(), optim=opt.state_dict(), step=step,
                                elapsed=elapsed, wall=wall, ema=ema, done=True, summary=summary))
    return summary


@torch.no_grad()
def held_out_loss(model, tokens: torch.Tensor, max_windows: int = 48, seq_len: int = SEQ_LEN) -> float:
    """Mean next-token cross-entropy (nats/token) over the first held-out windows."""
    model.eval()
    n = min(max_windows, (len(tokens) - 1) // seq_len)
    total, count = 0.0, 0
    for i in range(0, n, 8):
        batch = torch.stack([tokens[j * seq_len : j * seq_len + seq_len + 1]
                             for j in range(i, min(n, i + 8))]).long()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits.float()
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1),
                                 reduction="sum").item()
        count += batch[:, 1:].numel()
    return total / count


# -------------------------------------------------------------------------- export


def export_model(model, tokenizer_dir: Path, out_dir: Path, info: dict) -> None:
    """bf16 safetensors + config + tokenizer files + a small training.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out_dir / f.name)
    (out_dir / "training.json").write_text(json.dumps(info, indent=2) + "\n")


def write_split_file(out: Path, train: list[str], held: list[str], root: Path) -> None:
    """HELD_OUT.md: the exact held-out file list of the run that made the weights."""
    lines = [
        "# Held-out split",
        "",
        f"Rule: `sha256(relative_path) % {HELD_OUT_MODULUS} == 0` over the POSIX path relative",
        f"to the stdlib directory. Stdlib used: `{root}` (Python {sys.version.split()[0]}).",
        f"Training files: {len(train)}; held-out files: {len(held)} (never seen by tokenizer",
        "or model training).",
        "",
        *[f"- `{f}`" for f in held],
        "",
    ]
    (out / "HELD_OUT.md").write_text("\n".join(lines))


# ----------------------------------------------------------------------------- CLI


def default_out_dir() -> Path:
    from specdec.models.bundled import models_dir

    return models_dir()


def default_work_dir(out: Path) -> Path:
    """Checkpoints live outside the package tree so they never ship as package data."""
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    key = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:12]
    return base / "specdec" / "train-models" / key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: the package's bundled models dir)")
    parser.add_argument("--minutes", type=float, default=55.0,
                        help=f"total time budget in minutes (default 55): {TARGET_SHARE * 100:.0f}%% target "
                             f"training, {DRAFT_SHARE * 100:.0f}%% + {ONPOLICY_SHARE * 100:.0f}%% draft "
                             "distillation (corpus, then the target's greedy output), the rest data and export")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="checkpoints for resuming (default: ~/.cache/specdec/train-models/<hash of out>)")
    parser.add_argument("--wall-cap", type=float, default=1.5,
                        help="the budget counts compute time (CPU s / threads); on a loaded machine "
                             "each phase still stops after this factor x its budget of wall time")
    parser.add_argument("--fresh", action="store_true", help="discard checkpoints and start over")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch threads (default 2)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--target-steps", type=int, default=None,
                        help="step-based schedule for the target (bit-for-bit reproducible)")
    parser.add_argument("--draft-steps", type=int, default=None,
                        help="step-based schedule for the draft (bit-for-bit reproducible)")
    parser.add_argument("--onpolicy-steps", type=int, default=None,
                        help="step-based schedule for the draft's on-policy phase (bit-for-bit reproducible)")


def _run_settings(args) -> dict:
    return dict(minutes=args.minutes, seed=args.seed, target_steps=args.target_steps,
                draft_steps=args.draft_steps, onpolicy_steps=args.onpolicy_steps,
                target=TARGET_CONFIG, draft=DRAFT_CONFIG, vocab=VOCAB_SIZE, seq_len=SEQ_LEN,
                shares=[TARGET_SHARE, DRAFT_SHARE, ONPOLICY_SHARE], onpolicy=[ONPOLICY_PREFIX, ONPOLICY_NEW])


def _prepare_work_dir(work: Path, settings: dict, fresh: bool) -> None:
    """Resume only a run with identical settings; anything else must be explicit."""
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    settings_file = work / "settings.json"
    if settings_file.exists():
        if json.loads(settings_file.read_text()) != json.loads(json.dumps(settings)):
            raise SystemExit(f"{work} holds a run with other settings; pass --fresh to discard it")
    else:
        settings_file.write_text(json.dumps(settings, indent=2))


def _tokenizer_and_data(work: Path, train_files: list[str], held_files: list[str]):
    """Phase 1-2, cached in the work dir: tokenizer plus encoded train/held-out streams."""
    from tokenizers import Tokenizer

    tok_dir = work / "tokenizer"
    data_file = work / "tokens.pt"
    if not (tok_dir / "tokenizer.json").exists():
        texts = [read_source(f) for f in train_files]
        t0 = time.monotonic()
        tok = train_tokenizer(texts)
        save_tokenizer(tok, tok_dir)
        print(f"[tokenizer] trained in {time.monotonic() - t0:.0f}s", flush=True)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    if not data_file.exists():
        data = dict(train=encode_texts(tok, [read_source(f) for f in train_files]),
                    held=encode_texts(tok, [read_source(f) for f in held_files]))
        torch.save(data, data_file)
    data = torch.load(data_file)
    print(f"[data] train tokens {len(data['train']):,}, held-out tokens {len(data['held']):,}", flush=True)
    return tok, tok_dir, data


def run(args) -> int:
    t_start = time.monotonic()
    torch.set_num_threads(args.threads)
    out = (args.out or default_out_dir()).resolve()
    work = (args.work_dir or default_work_dir(out)).resolve()
    settings = _run_settings(args)
    _prepare_work_dir(work, settings, args.fresh)
    print(f"[train-models] out={out} work={work} threads={args.threads}", flush=True)

    root = stdlib_root()
    train_files, held_files = split_files(root)
    print(f"[corpus] {root}: {len(train_files)} training files, {len(held_files)} held out", flush=True)
    tok, tok_dir, data = _tokenizer_and_data(work, train_files, held_files)
    eos_id = tok.token_to_id(EOS_TOKEN)
    budget = args.minutes * 60

    target = make_model(TARGET_CONFIG, eos_id, args.seed)
    t_spec = PhaseSpec("target", budget * TARGET_SHARE, args.target_steps, lr=2e-3,
                       batch_size=4, seed=args.seed, wall_cap=args.wall_cap)
    t_summary = train_phase(target, lm_loss, WindowSampler(data["train"], 4, args.seed),
                            t_spec, work / "target.ckpt")
    t_summary["held_out_loss"] = round(held_out_loss(target, data["held"]), 4)
    print(f"[target] {t_summary}", flush=True)

    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)
    draft = make_model(DRAFT_CONFIG, eos_id, args.seed + 1)
    d_spec = PhaseSpec("draft", budget * DRAFT_SHARE, args.draft_steps, lr=3e-3,
                       batch_size=4, seed=args.seed + 1, wall_cap=args.wall_cap)
    d_summary = train_phase(draft, lambda m, b: distill_loss(m, target, b),
                            WindowSampler(data["train"], 4, args.seed + 1), d_spec, work / "draft.ckpt")
    print(f"[draft] off-policy {d_summary}", flush=True)
    o_spec = PhaseSpec("draft-onpolicy", budget * ONPOLICY_SHARE, args.onpolicy_steps, lr=1e-3,
                       batch_size=16, seed=args.seed + 2, wall_cap=args.wall_cap)
    o_summary = train_phase(draft, lambda m, b: distill_loss(m, target, b, start=ONPOLICY_PREFIX - 1),
                            GreedyContinuationSampler(target, data["train"], 16, args.seed + 2),
                            o_spec, work / "draft-onpolicy.ckpt")
    print(f"[draft] on-policy {o_summary}", flush=True)
    d_summary = dict(d_summary, held_out_loss=round(held_out_loss(draft, data["held"]), 4), onpolicy=o_summary)

    common = dict(seed=args.seed, threads=args.threads, minutes=args.minutes,
                  python=sys.version.split()[0], torch=torch.__version__,
                  train_files=len(train_files), held_out_files=len(held_files),
                  train_tokens=len(data["train"]), held_out_tokens=len(data["held"]))
    export_model(target, tok_dir, out / "target",
                 dict(common, role="target", params=count_params(target), **t_summary))
    export_model(draft, tok_dir, out / "draft",
                 dict(common, role="draft", params=count_params(draft),
                      distilled_from="target", loss="KL(target||draft)", **d_summary))
    write_split_file(out, train_files, held_files, root)
    print(f"[train-models] done in {(time.monotonic() - t_start) / 60:.1f} min -> {out}", flush=True)
    return 0
