"""``specdec eval-pair``: measure a target/draft pair the way the model card reports it.

Everything is measured on *held-out* stdlib files (the split rule of
``specdec.tools.train_models``), on the CPU, with one torch thread by default so that
the per-token latencies of the two models are comparable:

* per-token latency of each model: KV-cached greedy decoding through the same
  ``ModelRunner`` the decoder uses, after a prompt, median over prompts;
* held-out loss (nats/token) of each model, plus the teacher-forced top-1
  agreement (how often the draft's argmax equals the target's on real text);
* greedy acceptance with the in-process ``SpeculativeDecoder`` for each γ:
  α, the per-token acceptance rate of docs/architecture.md's
  E(γ) = (1 − α^(γ+1)) / (1 − α), = accepted drafts / drafts the target judged;
  the draft acceptance rate as vLLM reports it, accepted / proposed drafts; and
  the mean accepted length = tokens emitted per round (accepted + the target's
  own token);
* the speed-up of speculative greedy decoding over target-only decoding, timed
  side by side in this run (the two alternate per prompt, in alternating order,
  so that load on a shared machine hits both alike).  Every speculative output is
  also checked token-for-token against the target-only output.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specdec.tools.train_models import read_source, split_files

ALPHA_REQUIRED = 0.75  # at γ = 4
LATENCY_RATIO_REQUIRED = 0.2


# ------------------------------------------------------------------------ prompts


def held_out_streams(tokenizer) -> list[list[int]]:
    """Token ids of every held-out file, in the split's sorted order."""
    _, held = split_files()
    # verbose=False: whole files exceed model_max_length; they are cut into windows later.
    return [tokenizer.encode(read_source(f), add_special_tokens=False, verbose=False) for f in held]


def make_prompts(streams: list[list[int]], n: int, prompt_tokens: int, new_tokens: int,
                 seed: int) -> list[list[int]]:
    """``n`` prompts of ``prompt_tokens`` ids cut from held-out files.

    Files long enough for prompt + continuation are used round-robin; the cut
    point in each is drawn from a seeded RNG, so the prompts are the same every run.
    """
    rng = random.Random(seed)
    eligible = [s for s in streams if len(s) >= prompt_tokens + new_tokens]
    if not eligible:
        raise SystemExit("no held-out file is long enough for the requested prompt length")
    prompts = []
    for i in range(n):
        ids = eligible[i % len(eligible)]
        start = rng.randrange(0, len(ids) - prompt_tokens - new_tokens + 1)
        prompts.append(ids[start : start + prompt_tokens])
    return prompts


# ---------------------------------------------------------------- model measurements


def decode_latency_ms(runner, prompt: list[int], n_tokens: int) -> float:
    """Mean wall time of one KV-cached greedy decode step (prompt pre-fill excluded)."""
    seq = runner.new_sequence()
    seq.tokens.extend(prompt)
    logits = runner.logits(seq, 1)
    t0 = time.perf_counter()
    for _ in range(n_tokens):
        seq.tokens.append(int(logits[0].argmax()))
        logits = runner.logits(seq, 1)
    return (time.perf_counter() - t0) / n_tokens * 1000


def interleaved_latency_ms(target, draft, prompts: list[list[int]], n_tokens: int) -> tuple[float, float]:
    """Median per-token decode latency of both models, measured alternately.

    The two models take turns on each prompt (order flipped every prompt), so that
    other load on a shared machine inflates both figures alike and the ratio holds.
    """
    for runner in (target, draft):
        decode_latency_ms(runner, prompts[0], 4)  # warm-up
    times: dict[str, list[float]] = {"target": [], "draft": []}
    for i, p in enumerate(prompts):
        order = (("target", target), ("draft", draft))
        for name, runner in (order if i % 2 == 0 else order[::-1]):
            times[name].append(decode_latency_ms(runner, p, n_tokens))
    return statistics.median(times["target"]), statistics.median(times["draft"])


@torch.inference_mode()
def loss_and_agreement(target, draft, streams: list[list[int]], eos_id: int, windows: int,
                       seq_len: int = 512) -> dict:
    """Held-out loss of both models and their top-1 agreement, teacher-forced.

    The held-out files are joined with EOS exactly as in training and cut into the
    first ``windows`` non-overlapping windows of ``seq_len`` + 1 tokens.
    """
    flat: list[int] = []
    for s in streams:
        flat.extend(s)
        flat.append(eos_id)
    n = min(windows, (len(flat) - 1) // seq_len)
    sums = dict(target=0.0, draft=0.0, agree=0, count=0)
    for i in range(n):
        window = torch.tensor([flat[i * seq_len : (i + 1) * seq_len + 1]])
        inputs, labels = window[:, :-1], window[0, 1:]
        t_logits = target(input_ids=inputs).logits[0].float()
        d_logits = draft(input_ids=inputs).logits[0].float()
        sums["target"] += F.cross_entropy(t_logits, labels, reduction="sum").item()
        sums["draft"] += F.cross_entropy(d_logits, labels, reduction="sum").item()
        sums["agree"] += int((t_logits.argmax(-1) == d_logits.argmax(-1)).sum())
        sums["count"] += labels.numel()
    c = sums["count"]
    return dict(target_loss=sums["target"] / c, draft_loss=sums["draft"] / c,
                top1_agreement=sums["agree"] / c, loss_tokens=c)


# ---------------------------------------------------------------- decoder measurements


def acceptance_table(dec, prompts, new_tokens: int, gammas: list[int], greedy) -> list[dict]:
    """Greedy α and mean accepted length per γ, pooled over all prompts.

    Two acceptance figures are kept apart because they answer different questions:
    ``alpha`` = accepted / drafts the target actually judged (accepted ones plus
    the first rejected one per round): the per-position acceptance probability α
    of E(γ) = (1 − α^(γ+1)) / (1 − α) (docs/architecture.md); and ``acceptance_rate`` =
    accepted / proposed drafts, vLLM's "draft acceptance rate" (it falls with γ,
    since every draft after a rejection is wasted).
    """
    rows = []
    for g in gammas:
        accepted = proposed = judged = tokens = rounds = 0
        elapsed = 0.0
        for p in prompts:
            out = dec.generate(p, max_new_tokens=new_tokens, sampling=greedy, gamma=g)
            accepted += sum(out.accepted)
            proposed += sum(out.gammas)
            judged += sum(min(a + 1, n) for a, n in zip(out.accepted, out.gammas, strict=True))
            tokens += len(out.token_ids)
            rounds += out.rounds
            elapsed += out.elapsed_s
        rate = accepted / proposed if proposed else 0.0
        alpha = accepted / judged if judged else 0.0
        rows.append(dict(gamma=g, alpha=alpha, acceptance_rate=rate, mean_accepted_length=tokens / rounds,
                         expected_length=_expected_length(alpha, g), tokens_per_s=tokens / elapsed))
        print(f"  γ={g}: α={alpha:.3f}  mean accepted length={tokens / rounds:.2f} "
              f"(E(γ)={_expected_length(alpha, g):.2f})  accepted/proposed={rate:.3f}  "
              f"{tokens / elapsed:.1f} tok/s", flush=True)
    return rows


def _expected_length(alpha: float, gamma: int) -> float:
    """E(γ) = (1 − α^(γ+1)) / (1 − α): tokens per round if acceptances were i.i.d."""
    return gamma + 1.0 if alpha >= 1.0 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def side_by_side_speedup(dec, prompts, new_tokens: int, gamma: int, greedy) -> dict:
    """Target-only vs speculative greedy decoding on the same prompts, interleaved.

    The order alternates per prompt (A-B, B-A, ...) so that a slow spell on a shared
    machine is charged to both.  Outputs must be identical (greedy is lossless).
    """
    t_base = t_spec = 0.0
    tokens = mismatches = 0
    for i, p in enumerate(prompts):
        runs = {}
        for g in ((0, gamma) if i % 2 == 0 else (gamma, 0)):
            runs[g] = dec.generate(p, max_new_tokens=new_tokens, sampling=greedy, gamma=g)
        t_base += runs[0].elapsed_s
        t_spec += runs[gamma].elapsed_s
        tokens += len(runs[0].token_ids)
        mismatches += runs[0].token_ids != runs[gamma].token_ids
    return dict(gamma=gamma, prompts=len(prompts), tokens=tokens,
                target_only_tok_per_s=tokens / t_base, speculative_tok_per_s=tokens / t_spec,
                speedup=t_base / t_spec, output_mismatches=mismatches)


# ----------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", type=Path, default=None, help="target model dir (default: bundled)")
    parser.add_argument("--draft", type=Path, default=None, help="draft model dir (default: bundled)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--prompts", type=int, default=24, help="held-out prompts (default 24)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--max-gamma", type=int, default=8, help="α is measured for γ = 1..N")
    parser.add_argument("--speedup-gamma", type=int, default=4)
    parser.add_argument("--latency-tokens", type=int, default=64)
    parser.add_argument("--loss-windows", type=int, default=48,
                        help="held-out windows of 512 tokens for loss/agreement (default 48)")
    parser.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--markdown", type=Path, default=None,
                        help="also write the results as Markdown tables (for the model card)")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 unless greedy α (per token) at γ=4 ≥ 0.75, latency ratio "
                             "≤ 0.2 and speed-up > 1")


def run(args) -> int:
    from specdec import SamplingParams, SpeculativeDecoder
    from specdec.models.bundled import draft_path, target_path

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target_dir = args.target or target_path()
    draft_dir = args.draft or draft_path()
    dec = SpeculativeDecoder(target=target_dir, draft=draft_dir)
    greedy = SamplingParams(temperature=0.0, seed=0)
    tok = dec.tokenizer
    print(f"[eval-pair] target={target_dir} draft={draft_dir} threads={torch.get_num_threads()}")

    streams = held_out_streams(tok)
    prompts = make_prompts(streams, args.prompts, args.prompt_tokens, args.new_tokens, args.seed)
    print(f"[eval-pair] {len(streams)} held-out files, {len(prompts)} prompts of "
          f"{args.prompt_tokens} tokens, {args.new_tokens} new tokens each", flush=True)

    lat_t, lat_d = interleaved_latency_ms(dec.target, dec.draft, prompts[:8], args.latency_tokens)
    print(f"latency per token: target {lat_t:.2f} ms, draft {lat_d:.2f} ms, "
          f"ratio {lat_d / lat_t:.3f}", flush=True)

    quality = loss_and_agreement(dec.target.model, dec.draft.model, streams,
                                 tok.eos_token_id, args.loss_windows)
    print(f"held-out loss (nats/token): target {quality['target_loss']:.4f}, "
          f"draft {quality['draft_loss']:.4f}; teacher-forced top-1 agreement "
          f"{quality['top1_agreement']:.3f} over {quality['loss_tokens']} tokens", flush=True)

    print("greedy acceptance on held-out prompts (in-process SpeculativeDecoder):", flush=True)
    table = acceptance_table(dec, prompts, args.new_tokens, list(range(1, args.max_gamma + 1)), greedy)
    speed = side_by_side_speedup(dec, prompts, args.new_tokens, args.speedup_gamma, greedy)
    print(f"speed-up at γ={speed['gamma']}: {speed['speedup']:.2f}x "
          f"(target-only {speed['target_only_tok_per_s']:.1f} tok/s, speculative "
          f"{speed['speculative_tok_per_s']:.1f} tok/s, {speed['tokens']} tokens, "
          f"{speed['output_mismatches']} output mismatches)", flush=True)

    alpha4 = next((r["alpha"] for r in table if r["gamma"] == 4), None)
    checks = {
        "alpha_at_gamma4>=0.75": alpha4 is not None and alpha4 >= ALPHA_REQUIRED,
        "draft_latency<=0.2x_target": lat_d / lat_t <= LATENCY_RATIO_REQUIRED,
        "speculative_faster": speed["speedup"] > 1.0,
        "greedy_outputs_identical": speed["output_mismatches"] == 0,
    }
    for name, ok in checks.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    result = dict(target=str(target_dir), draft=str(draft_dir), threads=torch.get_num_threads(),
                  command=_command_line(), latency_ms=dict(target=lat_t, draft=lat_d,
                  ratio=lat_d / lat_t), **quality, acceptance=table, speedup=speed, checks=checks)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(format_markdown(result))
    return 0 if (not args.check or all(checks.values())) else 1


def _command_line() -> str:
    """How this run was invoked, spelled as the `specdec eval-pair` command."""
    argv = sys.argv[1:]
    if argv[:1] == ["eval-pair"]:
        argv = argv[1:]
    return " ".join(["specdec eval-pair", *argv])


def format_markdown(r: dict) -> str:
    """The results as the Markdown tables of the model card."""
    lat, sp = r["latency_ms"], r["speedup"]
    lines = [
        f"Measured with {r['threads']} torch thread(s): `{r['command']}`",
        "",
        "| | target | draft | draft / target |",
        "|---|---|---|---|",
        f"| per-token latency (KV-cached decode) | {lat['target']:.2f} ms | {lat['draft']:.2f} ms "
        f"| {lat['ratio']:.3f} |",
        f"| held-out loss (nats/token, {r['loss_tokens']} tokens) | {r['target_loss']:.3f} "
        f"| {r['draft_loss']:.3f} | |",
        "",
        f"Teacher-forced top-1 agreement (draft argmax = target argmax on held-out text): "
        f"{r['top1_agreement']:.3f}.",
        "",
        "| γ | greedy α (accepted / judged) | E(γ) at that α | mean accepted length "
        "| draft acceptance rate (accepted / proposed) | tokens/s |",
        "|---|---|---|---|---|---|",
        *[f"| {a['gamma']} | {a['alpha']:.3f} | {a['expected_length']:.2f} "
          f"| {a['mean_accepted_length']:.2f} | {a['acceptance_rate']:.3f} | {a['tokens_per_s']:.1f} |"
          for a in r["acceptance"]],
        "",
        f"Side-by-side speed-up of speculative greedy decoding (γ = {sp['gamma']}) over "
        f"target-only decoding: **{sp['speedup']:.2f}×** ({sp['speculative_tok_per_s']:.1f} vs "
        f"{sp['target_only_tok_per_s']:.1f} tokens/s over {sp['prompts']} prompts, "
        f"{sp['tokens']} tokens; {sp['output_mismatches']} outputs differed).",
        "",
        *[f"- {'PASS' if ok else 'FAIL'}: `{name}`" for name, ok in r["checks"].items()],
        "",
    ]
    return "\n".join(lines)
