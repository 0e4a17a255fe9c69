"""Real-size decode passes with no download: models shaped like Llama-3.1-8B,
Qwen2.5-7B and Llama-3.2-1B (the draft), built from their configurations with
random weights in bfloat16 on the device, run through specdec's batched
forward (paged KV, the device's attention kernel, CUDA graphs). For 1, 16 and
64 sessions of ``--context`` positions each, one decode pass (one new token
per session) is timed and set against the bandwidth bound: the bytes a pass
must read (every weight once, and every session's keys and values) divided by
the device's memory bandwidth, measured here with a large device copy.

    python scripts/gpu_realsize.py [--device cuda:0] [--context 1024] [--sessions 1,16,64]
    python scripts/gpu_realsize.py --device cpu --tiny      # the same code, shapes shrunk (tests)

The measured ÷ bound ratio is how far a pass is from the hardware: 1.0 would be
every byte read at full bandwidth with no launch or compute overhead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

# The published configurations' shapes (no download: only these numbers).
SHAPES = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, rope_theta=500000.0,
                         rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                          "rope_theta": 500000.0}),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=32768, rope_theta=1000000.0, use_sliding_window=False),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                                          "rope_theta": 500000.0}),
}


def build(name: str, device: torch.device, tiny: bool):
    """A random model of ``name``'s shape in bfloat16 on ``device`` (``tiny``: a
    64-wide, 2-layer model of the same family, for running this on a CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[name])
    if tiny:
        shape.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512)
    model_type = shape.pop("model_type")
    config = AutoConfig.for_model(model_type, **shape)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def bandwidth(device: torch.device, gib: float) -> float:
    """Bytes per second a device-to-device copy moves (read + write), best of 5."""
    n = int(gib * (1 << 30)) // 2
    src, dst = torch.empty(n, dtype=torch.bfloat16, device=device), torch.empty(n, dtype=torch.bfloat16,
                                                                                device=device)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n * 2 / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_ms(batched, sessions: int, context: int, passes: int) -> float:
    """Median wall time of one decode pass over ``sessions`` sessions of
    ``context`` positions (their pre-fill excluded)."""
    from specdec.models.attention import BatchRow

    vocab = batched.model.config.vocab_size
    caches = [batched.new_cache() for _ in range(sessions)]
    for s, cache in enumerate(caches):  # pre-fill in chunks of at most 4096 tokens per pass
        tokens = [(s * 31 + i * 7) % vocab for i in range(context)]
        for start in range(0, context, 4096):
            batched.forward_batch([BatchRow(tokens[start:start + 4096], cache, 1)])
    times = []
    for step in range(passes + 2):  # the first two warm up
        sync(batched.device)
        start = time.perf_counter()
        batched.forward_batch([BatchRow([(step + s) % vocab], cache, 1) for s, cache in enumerate(caches)])
        sync(batched.device)
        times.append(time.perf_counter() - start)
    for cache in caches:
        batched.kv.release(cache)
    return statistics.median(times[2:]) * 1000


def main() -> None:
    from specdec.models.batched import BatchedModel
    from specdec.models.lean_llama import LeanLlama, unsupported_reason
    from specdec.models.runner import GRAPH_TOKENS, block_size_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--models", default="llama-3.1-8b,qwen2.5-7b,llama-3.2-1b")
    parser.add_argument("--sessions", default="1,16,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--passes", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="shrunk shapes (runs on a CPU)")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    sessions = [int(s) for s in args.sessions.split(",")]
    bw = bandwidth(device, 0.0625 if args.tiny else 2.0)
    print(f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else device}: "
          f"copy bandwidth {bw / 1e9:.0f} GB/s; context {args.context} per session, bfloat16")
    rows = []
    for name in args.models.split(","):
        started = time.perf_counter()
        model = build(name, device, args.tiny)
        block = block_size_for(device)
        kv_tokens = max(sessions) * (-(-(args.context + args.passes + 2) // block) + 1) * block
        batched = BatchedModel(model, max_tokens=kv_tokens, block_size=block)
        if unsupported_reason(model) is None:
            batched.lean = LeanLlama(model)
        if device.type == "cuda":
            batched.record_graphs(GRAPH_TOKENS)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"{name}: {weights / 1e9:.1f} GB of weights, {batched.kv.bytes_per_token / 1024:.0f} KiB of KV per "
              f"token, {batched.kernel} attention{', CUDA graphs' if batched.graphs else ''}"
              f"{', lean layers' if batched.lean else ''} (built in {time.perf_counter() - started:.0f} s)")
        for n in sessions:
            ms = decode_ms(batched, n, args.context, args.passes)
            read = weights + n * args.context * batched.kv.bytes_per_token
            bound = read / bw * 1000
            rows.append(dict(model=name, sessions=n, ms=ms, bound_ms=bound, ratio=ms / bound))
            print(f"  {n:3d} sessions: {ms:8.2f} ms per decode pass, bound {bound:7.2f} ms "
                  f"({read / 1e9:.2f} GB read), measured / bound {ms / bound:5.2f}, "
                  f"{n / ms * 1000:8.0f} tokens/s")
        del batched, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dict(device=str(device), bandwidth_gbs=bw / 1e9, context=args.context, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
