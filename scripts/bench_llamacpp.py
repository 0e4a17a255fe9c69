"""specdec against llama.cpp on the same model pair, side by side in one run.

The bundled target and draft are converted to GGUF (float32, with llama.cpp's own
``convert_hf_to_gguf.py``) and every row generates greedily from the same
held-out prompts, one thread per model, in an order shuffled per prompt:

* llama.cpp target-only and speculative (``llama-completion``,
  ``llama-speculative`` from ``--bin``: llama.cpp's own tools), and target-only
  through its Python binding (``llama-cpp-python``, where installed);
* specdec in process: target-only (γ = 0) and adaptive γ;
* specdec through its three services on loopback (no added round trip):
  static:0 and adaptive, in ``specdec bench``'s layout (draft on core 0; target,
  coordinator and this client on core 1).

Tokens per second count the prompt's pre-fill and the generation, as each row
times them itself (llama.cpp's tools print their own timings, which leave out
loading the model). Every row must give the same tokens as Hugging Face's greedy
decoding of the target; the table says where one does not. Last, the floor
torch's products alone set: the target's matrix products for one token, timed
over its weights as the lean forward holds them.

Needs llama.cpp's sources (for the converter and its ``gguf-py``) and its tools
or binding; none of it is a dependency of specdec or its tests. See
docs/benchmarks.md for the commands that fetch and build them.

    python scripts/bench_llamacpp.py --llama-cpp PATH/TO/llama.cpp --bin PATH/TO/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import random
import re
import subprocess
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent


def convert(llama_cpp: pathlib.Path, model_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """``model_dir`` as a float32 GGUF file (made once; reused while newer than the model)."""
    weights = model_dir / "model.safetensors"
    if out.exists() and out.stat().st_mtime > weights.stat().st_mtime:
        return out
    # The converter recognises a tokenizer by hashing how it splits a test
    # string; ours (byte-level BPE, trained here) is not in its list, though
    # its pre-tokenizer is GPT-2's. So: GPT-2's vocabulary writer and
    # pre-tokenizer name, everything else as the converter does it.
    code = f"""
import sys
sys.path[:0] = [{str(llama_cpp)!r}, {str(llama_cpp / "gguf-py")!r}]
import conversion.base, conversion.llama
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
conversion.llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
import runpy
sys.argv = ["convert_hf_to_gguf.py", {str(model_dir)!r}, "--outtype", "f32", "--outfile", {str(out)!r}]
runpy.run_path({str(llama_cpp / "convert_hf_to_gguf.py")!r}, run_name="__main__")
"""
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    return out


# ------------------------------------------------------------------ llama.cpp rows
# Each row: (prompt ids, n) -> (generated ids, or a tool's text and its count of tokens; seconds).


def llama_completion(bin_dir: pathlib.Path, gguf: pathlib.Path, text: str, n: int, core: int):
    """``llama-completion``: the time it reports for the prompt, the generation and sampling."""
    err, out = _run_tool([bin_dir / "llama-completion", "-m", gguf, "-n", str(n), "--temp", "0", "-t", "1",
                          "-tb", "1", "-no-cnv", "--no-display-prompt", "--no-warmup"], text, core)
    ms = sum(float(m) for m in re.findall(r"(?:prompt eval|\beval|sampling) time =\s*([\d.]+) ms", err))
    runs = re.search(r"\beval time =.*/\s*(\d+) runs", err)  # the first token comes from the prompt's pass
    return (out, int(runs.group(1)) + 1 if runs else n), ms / 1000


def llama_speculative(bin_dir: pathlib.Path, target: pathlib.Path, draft: pathlib.Path, drafts: int, text: str,
                      n: int, core: int):
    """``llama-speculative`` with up to ``drafts`` drafts a round: the encode and decode times it reports.
    It prints the prompt before the generation."""
    err, out = _run_tool([bin_dir / "llama-speculative", "-m", target, "-md", draft, "-n", str(n), "--temp", "0",
                          "-t", "1", "-tb", "1", "-td", "1", "-tbd", "1", "--spec-draft-n-max", str(drafts)],
                         text, core)
    seconds = sum(float(s) for s in re.findall(r"(?:en|de)coded\s+\d+ tokens in\s+([\d.]+) seconds", err))
    decoded = re.search(r"decoded\s+(\d+) tokens", err)
    return (out[len(text):] if out.startswith(text) else out, int(decoded.group(1)) if decoded else n), seconds


def _run_tool(argv: list, prompt: str, core: int) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(prompt)
        f.flush()
        done = subprocess.run(["taskset", "-c", str(core), *map(str, argv), "-f", f.name],
                              capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stderr, done.stdout


class LlamaBinding:
    """llama.cpp through llama-cpp-python: the prompt in one ``eval``, then one
    ``eval`` per token, the argmax of its logits (no sampler chain in Python)."""

    def __init__(self, gguf: pathlib.Path):
        import llama_cpp
        import numpy

        self._api, self._np = llama_cpp, numpy
        self.llm = llama_cpp.Llama(str(gguf), n_threads=1, n_threads_batch=1, n_ctx=1024, verbose=False)

    def generate(self, prompt: list[int], n: int) -> tuple[list[int], float]:
        llm, np = self.llm, self._np
        start = time.perf_counter()
        llm.reset()
        llm.eval(prompt)
        out: list[int] = []
        while True:
            logits = np.ctypeslib.as_array(self._api.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
            out.append(int(logits.argmax()))
            if len(out) == n:
                return out, time.perf_counter() - start
            llm.eval(out[-1:])


# ------------------------------------------------------------------ the floor


def product_floor_ms(runner, repeats: int = 200) -> float:
    """Milliseconds one token's matrix products take through torch, alone: the
    target's layers' q/k/v, output, gate/up and down products and the LM head,
    over the weights as the lean forward holds them."""
    lean = runner.forward.lean
    weights = [w for layer in lean.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    inputs = {w.shape[0]: torch.randn(1, w.shape[0], dtype=w.dtype, device=w.device) for w in weights}
    x = torch.randn(1, lean.lm_head.shape[1], dtype=lean.lm_head.dtype)

    def one_token():
        for w in weights:
            inputs[w.shape[0]] @ w
        torch.nn.functional.linear(x, lean.lm_head)

    with torch.inference_mode():
        for _ in range(20):
            one_token()
        start = time.perf_counter()
        for _ in range(repeats):
            one_token()
    return (time.perf_counter() - start) / repeats * 1e3


# ------------------------------------------------------------------ the run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", required=True, type=pathlib.Path,
                        help="llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py)")
    parser.add_argument("--bin", type=pathlib.Path, default=None,
                        help="llama.cpp's built tools (llama-completion, llama-speculative); without it, only "
                        "the Python binding's target-only row")
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts of 128 tokens (default 8)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    parser.add_argument("--drafts", default="4,8", help="llama-speculative's drafts per round to try (default 4,8)")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench-llamacpp"),
                        help="where the GGUF files, the services' logs and results.json go")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    from specdec.core.gamma import AdaptiveGamma
    from specdec.core.interfaces import SamplingParams
    from specdec.models import bundled
    from specdec.models.decoder import SpeculativeDecoder
    from specdec.serving.client import Client
    from specdec.tools.bench import COORDINATOR_CORE, IN_PROCESS_CORE, Processes, pin
    from specdec.tools.eval_pair import held_out_streams, make_prompts

    sys.path.insert(0, str(HERE))
    from cpu_per_round import start_services  # this folder's sibling script

    torch.set_num_threads(1)
    target_dir, draft_dir = bundled.target_path(), bundled.draft_path()
    target_gguf = convert(args.llama_cpp, target_dir, args.out / "target-f32.gguf")
    draft_gguf = convert(args.llama_cpp, draft_dir, args.out / "draft-f32.gguf")
    dec = SpeculativeDecoder(target_dir, draft_dir)
    tokenizer = dec.tokenizer
    prompts = make_prompts(held_out_streams(tokenizer), args.prompts, 128, args.tokens, seed=0)
    greedy = SamplingParams(temperature=0.0, seed=0)
    hf = dec.target.model
    reference = []  # Hugging Face's own greedy decoding of the target
    for prompt in prompts:
        ids = torch.tensor([prompt])
        reference.append(hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist())

    procs = Processes(args.out)
    pids, port = start_services(procs)
    try:
        pin(COORDINATOR_CORE)  # before the client: grpc's threads take the affinity of the thread starting them
        client = Client(f"127.0.0.1:{port}", timeout=300)
        client.wait_ready(120)
        adaptive = AdaptiveGamma(gamma_max=8)

        def in_process(gamma):
            def row(prompt, n):
                pin(IN_PROCESS_CORE)
                out = dec.generate(prompt, max_new_tokens=n, sampling=greedy, gamma=gamma)
                return out.token_ids, out.elapsed_s
            return row

        def in_process_adaptive(prompt, n):
            nonlocal adaptive
            adaptive = adaptive.for_new_request()
            return in_process(adaptive)(prompt, n)

        def services(policy):
            def row(prompt, n):
                pin(COORDINATOR_CORE)
                start = time.perf_counter()
                out = client.complete(prompt_ids=prompt, max_new_tokens=n, temperature=0.0, gamma_policy=policy)
                return list(out.token_ids), time.perf_counter() - start
            return row

        rows = {}
        if args.bin:
            rows["llama.cpp target-only (llama-completion)"] = lambda p, n: llama_completion(
                args.bin, target_gguf, tokenizer.decode(p), n, IN_PROCESS_CORE)
            for drafts in [int(d) for d in args.drafts.split(",")]:
                rows[f"llama.cpp speculative, {drafts} drafts (llama-speculative)"] = (
                    lambda p, n, d=drafts: llama_speculative(args.bin, target_gguf, draft_gguf, d,
                                                             tokenizer.decode(p), n, IN_PROCESS_CORE))
        if importlib.util.find_spec("llama_cpp") is not None:
            binding = LlamaBinding(target_gguf)
            rows["llama.cpp target-only (llama-cpp-python)"] = lambda p, n: (pin(IN_PROCESS_CORE),
                                                                              binding.generate(p, n))[1]
        if not rows:
            raise SystemExit("no llama.cpp to compare with: give --bin, or pip install llama-cpp-python")
        rows["specdec target-only, in process"] = in_process(0)
        rows["specdec adaptive, in process"] = in_process_adaptive
        rows["specdec static:0, services"] = services("static:0")
        rows["specdec adaptive, services"] = services("adaptive")

        results = run_rows(rows, prompts, args.tokens, reference, tokenizer)
        pin(IN_PROCESS_CORE)
        floor = product_floor_ms(dec.target)
    finally:
        procs.stop()
    report(results, floor, args)
    return 0


def run_rows(rows: dict, prompts: list[list[int]], n: int, reference: list[list[int]], tokenizer) -> dict:
    """Every row on every prompt, rows shuffled per prompt, after one untimed
    warm-up each. Per row: tokens, seconds, and whether every output was the reference."""
    for row in rows.values():
        row(prompts[0], 8)
    totals = {name: {"tokens": 0, "seconds": 0.0, "same": True} for name in rows}
    order = list(rows)
    for i, prompt in enumerate(prompts):
        random.Random(i).shuffle(order)
        for name in order:
            out, seconds = rows[name](prompt, n)
            if isinstance(out, tuple):  # a tool's text: compared as text
                (text, tokens), expected = out, tokenizer.decode(reference[i])
                same = text[:len(expected)] == expected
            else:
                same, tokens = out[:n] == reference[i][:len(out)], len(out)
            totals[name]["tokens"] += tokens
            totals[name]["seconds"] += seconds
            totals[name]["same"] &= same
    for t in totals.values():
        t["tok_s"] = t["tokens"] / t["seconds"]
    return totals


def report(results: dict, floor_ms: float, args) -> None:
    llama = {k: v["tok_s"] for k, v in results.items() if k.startswith("llama.cpp")}
    plain = max(v for k, v in llama.items() if "target-only" in k)
    best = max(llama.values())
    ours = {k: v["tok_s"] for k, v in results.items() if k.startswith("specdec")}
    lines = [f"{args.prompts} prompts × {args.tokens} tokens, greedy, 1 thread per model; "
             "tok/s = generated tokens ÷ (pre-fill + generation)", "",
             "| row | tok/s | ÷ llama.cpp target-only | same tokens as Hugging Face |", "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['tok_s']:.1f} | {r['tok_s'] / plain:.2f} | {'yes' if r['same'] else 'NO'} |")
    lines += ["", f"torch's matrix products alone, one token of the target: {floor_ms:.2f} ms "
              f"(llama.cpp's whole token at its target-only rate: {1000 / plain:.2f} ms)", "",
              "ratios:",
              f"  specdec in-process target-only ÷ llama.cpp target-only: "
              f"{ours['specdec target-only, in process'] / plain:.2f}",
              f"  specdec in-process adaptive ÷ the better llama.cpp row: "
              f"{ours['specdec adaptive, in process'] / best:.2f}",
              f"  specdec static:0 through the services ÷ in-process target-only: "
              f"{ours['specdec static:0, services'] / ours['specdec target-only, in process']:.2f}"]
    print("\n".join(lines))
    (args.out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": results,
                                                       "product_floor_ms": floor_ms}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
