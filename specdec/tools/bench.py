"""``specdec bench``: the whole system against its peers, side by side in one run.

On the bundled pair and held-out code prompts, greedy and sampling:

* target-only decoding (our decoder with γ = 0);
* Hugging Face assisted generation in-process (``generate(assistant_model=…)``,
  constant and heuristic schedules);
* our in-process decoder (static γ, heuristic, adaptive);
* distributed over loopback — draft service, target service and coordinator as
  separate processes, each service pinned to its own core with one torch
  thread — with added round-trip times through ``specdec netem`` proxies, for
  static γ, heuristic and adaptive policies.

Every configuration runs on every prompt, and the order of configurations is
reshuffled per prompt, so that a slow spell on a shared machine is spread over
all rows rather than charged to one. Each configuration first serves one short
untimed request, so that no row pays a process's first calls. Ratios, not
absolute numbers, are the point.
Writes JSON, a Markdown table and a PNG plot (speedup vs RTT, a line per policy).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import random
import subprocess
import sys
import time

import torch

from specdec.serving.server import free_port

DRAFT_CORE, TARGET_CORE = 0, 1
IN_PROCESS_CORE = 1
# The coordinator's work (receiving drafts, forwarding them, streaming tokens out)
# happens while the target waits for them, so it shares the target's core and the
# draft's core is left to drafting.
COORDINATOR_CORE = TARGET_CORE
IN_PROCESS_CORES = f"in-process: 1 process on core {IN_PROCESS_CORE}, 1 torch thread"
DISTRIBUTED_CORES = (f"draft service on core {DRAFT_CORE}, target service on core {TARGET_CORE}, coordinator, "
                     f"proxies and client on core {COORDINATOR_CORE}; 1 torch thread each")


def pin(core: int) -> None:
    """Move this (the benchmark's) process to ``core`` when the machine has it."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, {core} & os.sched_getaffinity(0) or os.sched_getaffinity(0))


@dataclasses.dataclass
class Totals:
    """What one configuration accumulated over all prompts."""

    tokens: int = 0
    seconds: float = 0.0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    bytes: int = 0
    draft_s: float = 0.0
    target_s: float = 0.0
    network_s: float = 0.0

    def add(self, tokens, seconds, rounds=0, drafted=0, accepted=0, nbytes=0, draft_s=0.0, target_s=0.0, network_s=0.0):
        self.tokens += tokens
        self.seconds += seconds
        self.rounds += rounds
        self.drafted += drafted
        self.accepted += accepted
        self.bytes += nbytes
        self.draft_s += draft_s
        self.target_s += target_s
        self.network_s += network_s


@dataclasses.dataclass(frozen=True)
class Config:
    name: str  # e.g. "distributed adaptive"
    kind: str  # target-only | hf-assisted | in-process | distributed
    policy: str  # γ policy or schedule
    rtt_ms: float
    cores: str
    draft_ahead: bool = True  # distributed: the draft service drafts ahead (its default)


# ------------------------------------------------------------------ in-process runs


def run_ours(dec, prompt, new_tokens, sampling, policy, totals: Totals) -> None:
    """``policy``: a γ policy object; an adaptive one starts from the last
    prompt's (:meth:`AdaptiveGamma.for_new_request`), as the coordinator starts
    each request from the last of its regime."""
    out = dec.generate(prompt, max_new_tokens=new_tokens, sampling=sampling, gamma=policy)
    totals.add(len(out.token_ids), out.elapsed_s, out.rounds, sum(out.gammas), sum(out.accepted))


def run_hf_assisted(target, draft, prompt, new_tokens, sampling, schedule: str, totals: Totals) -> None:
    """Hugging Face assisted generation with the same models, in this process."""
    ids = torch.tensor([prompt], device=target.device)
    kwargs = dict(do_sample=False) if sampling.greedy else dict(
        do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k or None)
    if not sampling.greedy:
        torch.manual_seed(sampling.seed)
    gamma = int(schedule.split(":")[1]) if ":" in schedule else 5
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(
            ids, assistant_model=draft, max_new_tokens=new_tokens, num_assistant_tokens=gamma,
            num_assistant_tokens_schedule="heuristic" if schedule == "heuristic" else "constant",
            pad_token_id=target.config.eos_token_id, **kwargs,
        )
    totals.add(out.shape[1] - len(prompt), time.perf_counter() - start)


# ------------------------------------------------------------------ distributed runs


class Processes:
    """Child processes pinned to cores, stopped together."""

    def __init__(self, log_dir: pathlib.Path):
        self.children: list[subprocess.Popen] = []
        self.log_dir = log_dir

    def start(self, name: str, args: list[str], core: int) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        cores = {core} & os.sched_getaffinity(0) or os.sched_getaffinity(0)
        log = open(self.log_dir / f"{name}.log", "w")
        self.children.append(subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", *args], env=env, stdout=log, stderr=subprocess.STDOUT,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
        ))

    def stop(self) -> None:
        for child in self.children:
            child.terminate()
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(20)
            if child.poll() is None:
                child.kill()


def start_cluster(procs: Processes, target_dir, draft_dir, rtts: list[float],
                  devices: dict[str, str]) -> dict[tuple[float, bool], str]:
    """Draft and target once, on ``devices["draft"]`` and ``devices["target"]``;
    per RTT a coordinator (through netem proxies when RTT > 0); with 0 ms among
    the RTTs also a draft service started with --no-draft-ahead and its
    coordinator. Returns {(rtt_ms, draft_ahead): coordinator address}."""
    draft_port, plain_draft_port, target_port = free_port(), free_port(), free_port()
    draft_args = ["draft-service", "--model", str(draft_dir), "--device", devices["draft"]]
    procs.start("draft", [*draft_args, "--port", str(draft_port)], core=DRAFT_CORE)
    if 0.0 in rtts:
        procs.start("draft-no-ahead", [*draft_args, "--port", str(plain_draft_port), "--no-draft-ahead"],
                    core=DRAFT_CORE)
    procs.start("target", ["target-service", "--model", str(target_dir), "--port", str(target_port),
                           "--device", devices["target"]], core=TARGET_CORE)
    target_addr = f"127.0.0.1:{target_port}"
    coordinators = {}
    for rtt, ahead in [(rtt, True) for rtt in rtts] + ([(0.0, False)] if 0.0 in rtts else []):
        draft_addr = f"127.0.0.1:{draft_port if ahead else plain_draft_port}"
        to_target = target_addr
        if rtt > 0:
            for name, upstream in (("draft", draft_addr), ("target", target_addr)):
                port = free_port()
                procs.start(f"netem-{name}-{rtt:g}ms", [
                    "netem", "--listen", f"127.0.0.1:{port}", "--upstream", upstream, "--delay-ms", str(rtt / 2),
                ], core=COORDINATOR_CORE)
                if name == "draft":
                    draft_addr = f"127.0.0.1:{port}"
                else:
                    to_target = f"127.0.0.1:{port}"
        port = free_port()
        procs.start(f"coordinator-{rtt:g}ms{'' if ahead else '-no-ahead'}", [
            "coordinator", "--draft", draft_addr, "--target", to_target, "--port", str(port),
            "--tokenizer", str(target_dir), "--http-port", "0",  # several at once: gRPC only
        ], core=COORDINATOR_CORE)
        coordinators[rtt, ahead] = f"127.0.0.1:{port}"
    return coordinators


def run_distributed(client, prompt, new_tokens, sampling, policy: str, totals: Totals) -> None:
    start = time.perf_counter()
    out = client.complete(
        prompt_ids=prompt, max_new_tokens=new_tokens, temperature=sampling.temperature,
        top_p=sampling.top_p, top_k=sampling.top_k, seed=sampling.seed, gamma_policy=policy,
    )
    s = out.stats
    totals.add(
        s.generated_tokens, time.perf_counter() - start, s.rounds, s.drafted_tokens, s.accepted_tokens,
        getattr(s, "bytes_sent", 0) + getattr(s, "bytes_received", 0),
        getattr(s, "draft_compute_s", 0.0), getattr(s, "target_compute_s", 0.0), getattr(s, "network_s", 0.0),
    )


# ------------------------------------------------------------------ the run


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a reduced matrix that finishes in under 5 minutes")
    p.add_argument("--out", default="bench-results", help="directory for results.json, results.md, speedup.png")
    p.add_argument("--target", default=None, help="target model directory (default: bundled)")
    p.add_argument("--draft", default=None, help="draft model directory (default: bundled)")
    p.add_argument("--prompts", type=int, default=None, help="number of held-out prompts (default 8, quick 4)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens per completion (default 96, quick 64)")
    p.add_argument("--rtts", default=None, help="added RTTs in ms (default 0,2,10,30; quick 0,10,30)")
    p.add_argument("--modes", default="greedy,sampling", help="greedy and/or sampling")
    p.add_argument("--device-target", default="cpu", help="torch device of the target model, in process and as a "
                   "service (default cpu), e.g. cuda:0")
    p.add_argument("--device-draft", default=None, help="torch device of the draft model (default: the target's)")
    p.add_argument("--matrices", default="single,concurrency",
                   help="single (one session at a time, the rows above) and/or concurrency (many sessions at once)")
    p.add_argument("--sessions", default=None, help="concurrent sessions of the concurrency matrix "
                   "(default 1,4,16,32; quick 1,16)")
    p.add_argument("--random-pair", default=None, metavar="FAMILY",
                   help="instead of --target/--draft: a pair of FAMILY's shape (qwen2, qwen3, mistral, gemma2, llama) "
                   "with random weights and the bundled tokenizer, built under --out")


def plan(args) -> tuple[list[Config], list[float]]:
    rtts = [float(x) for x in (args.rtts or ("0,10,30" if args.quick else "0,2,10,30")).split(",")]
    statics = [2, 4] if args.quick else [1, 2, 3, 4, 6, 8]
    policies = [f"static:{g}" for g in statics] + ["heuristic", "adaptive"]
    configs = [Config("target-only", "target-only", "static:0", 0, IN_PROCESS_CORES)]
    configs += [Config(f"HF assisted {s}", "hf-assisted", s, 0, IN_PROCESS_CORES)
                for s in (["constant:4", "heuristic"])]
    configs += [Config(f"in-process {p}", "in-process", p, 0, IN_PROCESS_CORES)
                for p in (["static:4", "adaptive"] if args.quick else policies)]
    for rtt in rtts:
        configs.append(Config(f"distributed static:0 @{rtt:g}ms", "distributed", "static:0", rtt, DISTRIBUTED_CORES))
        configs += [Config(f"distributed {p} @{rtt:g}ms", "distributed", p, rtt, DISTRIBUTED_CORES) for p in policies]
    if 0.0 in rtts:  # what drafting ahead buys: the same rounds with a draft service that waits idle
        configs += [Config(f"distributed {p} @0ms, no draft-ahead", "distributed", p, 0.0, DISTRIBUTED_CORES, False)
                    for p in ("static:4", "adaptive")]
    return configs, rtts


def run(args: argparse.Namespace) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.models import bundled
    from specdec.models.tokenizer import load_tokenizer
    from specdec.tools import bench_concurrency
    from specdec.tools.eval_pair import held_out_streams, make_prompts

    hf_logging.set_verbosity_error()
    matrices = {m.strip() for m in args.matrices.split(",")}
    if not matrices or matrices - {"single", "concurrency"}:
        raise ValueError(f"--matrices {args.matrices!r}: give single and/or concurrency")
    sessions = [int(n) for n in (args.sessions or ("1,16" if args.quick else "1,4,16,32")).split(",")]
    if any(n <= 0 for n in sessions):
        raise ValueError(f"--sessions {args.sessions}: every count must be > 0")
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    target_dir = pathlib.Path(args.target or bundled.target_path())
    draft_dir = pathlib.Path(args.draft or bundled.draft_path())
    if args.random_pair:
        from specdec.tools.random_pair import make_random_pair

        target_dir, draft_dir = make_random_pair(args.random_pair, out_dir / f"pair-{args.random_pair}")
    n_prompts = args.prompts or (4 if args.quick else 8)
    new_tokens = args.new_tokens or (64 if args.quick else 96)
    devices = {"target": args.device_target, "draft": args.device_draft or args.device_target}
    record = {"command": " ".join(["specdec", "bench", *sys.argv[2:]]), "prompts": n_prompts,
              "new_tokens": new_tokens, "target": str(target_dir), "draft": str(draft_dir), "devices": devices}

    torch.set_num_threads(1)
    all_cores = os.sched_getaffinity(0)
    streams = held_out_streams(load_tokenizer(target_dir))
    procs = Processes(out_dir)
    try:
        if "single" in matrices:
            prompts = make_prompts(streams, n_prompts, 128, new_tokens, seed=0)
            record["results"], record["rtts"] = run_single(args, procs, target_dir, draft_dir, devices, prompts)
            procs.stop()
            procs = Processes(out_dir)
        if "concurrency" in matrices:
            prompts = make_prompts(streams, max(16, max(sessions)), 128, new_tokens, seed=1)
            record["concurrency"] = bench_concurrency.run_concurrency(procs, target_dir, draft_dir, devices,
                                                                      prompts, sessions, new_tokens)
    finally:
        procs.stop()
        os.sched_setaffinity(0, all_cores)

    (out_dir / "results.json").write_text(json.dumps(record, indent=2))
    markdown = format_markdown(record)
    (out_dir / "results.md").write_text(markdown)
    if "results" in record:
        plot(record["results"], record["rtts"], out_dir / "speedup.png")
    if "concurrency" in record:
        bench_concurrency.plot(record["concurrency"], out_dir / "concurrency.png")
    print(markdown)
    print(f"wrote {out_dir}/results.json, results.md and the plots")
    return 0


def run_single(args, procs: Processes, target_dir: pathlib.Path, draft_dir: pathlib.Path, devices: dict[str, str],
               prompts: list[list[int]]) -> tuple[dict, list[float]]:
    """The single-session matrix: every configuration serves every prompt."""
    from transformers import AutoModelForCausalLM

    from specdec.core.gamma import AdaptiveGamma, parse_gamma_policy
    from specdec.core.interfaces import SamplingParams
    from specdec.models.decoder import SpeculativeDecoder
    from specdec.serving.client import Client

    configs, rtts = plan(args)
    dec = SpeculativeDecoder(target_dir, draft_dir, device=devices["target"], draft_device=devices["draft"])
    hf_target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().to(devices["target"])
    hf_draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval().to(devices["draft"])
    new_tokens = args.new_tokens or (64 if args.quick else 96)
    coordinators = start_cluster(procs, target_dir, draft_dir, rtts, devices)
    clients = {key: Client(addr, timeout=300) for key, addr in coordinators.items()}
    for c in clients.values():
        c.wait_ready(120)
    modes = [m.strip() for m in args.modes.split(",")]

    def run_config(c: Config, prompt, tokens: int, sampling, policy, totals: Totals) -> None:
        # As the client of distributed rows this process sits with the
        # coordinator, off the draft's core.
        pin(COORDINATOR_CORE if c.kind == "distributed" else IN_PROCESS_CORE)
        if c.kind in ("target-only", "in-process"):
            run_ours(dec, prompt, tokens, sampling, policy, totals)
        elif c.kind == "hf-assisted":
            run_hf_assisted(hf_target, hf_draft, prompt, tokens, sampling, c.policy, totals)
        else:
            run_distributed(clients[c.rtt_ms, c.draft_ahead], prompt, tokens, sampling, c.policy, totals)

    def fresh_policy(c: Config):
        return parse_gamma_policy(c.policy, 16) if c.kind in ("in-process", "target-only") else None

    # One short untimed request per configuration first, with a policy of its
    # own: a path's first calls in a process (on a GPU, its lazy kernel loading
    # too) are then not charged to whichever row the shuffle puts first.
    warm_up = SamplingParams() if modes[0] == "greedy" else SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    for c in configs:
        run_config(c, prompts[0], 8, warm_up, fresh_policy(c), Totals())
    results = {}
    for mode in modes:
        totals = {c: Totals() for c in configs}
        policies = {c: fresh_policy(c) for c in configs}
        rng = random.Random(mode)
        for i, prompt in enumerate(prompts):
            sampling = SamplingParams() if mode == "greedy" else SamplingParams(temperature=0.8, top_p=0.95, seed=i)
            order = configs[:]
            rng.shuffle(order)
            for c in order:
                policy = policies[c]
                if isinstance(policy, AdaptiveGamma):
                    policy = policies[c] = policy.for_new_request()
                run_config(c, prompt, new_tokens, sampling, policy, totals[c])
            print(f"[{mode}] prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
        results[mode] = summarise(configs, totals)
    for client in clients.values():
        client.close()
    return results, rtts


def summarise(configs: list[Config], totals: dict[Config, Totals]) -> list[dict]:
    base = totals[configs[0]]
    base_rate = base.tokens / base.seconds
    rows = []
    for c in configs:
        t = totals[c]
        rate = t.tokens / t.seconds if t.seconds else 0.0
        phases = t.draft_s + t.target_s + t.network_s
        rows.append({
            **dataclasses.asdict(c),
            "tokens_per_s": rate,
            "speedup": rate / base_rate,
            "alpha": t.accepted / t.drafted if t.drafted else None,
            "mean_accepted_length": t.tokens / t.rounds if t.rounds else None,
            "bytes_per_round": t.bytes / t.rounds if t.rounds and t.bytes else None,
            "share_draft": t.draft_s / t.seconds if phases else None,
            "share_target": t.target_s / t.seconds if phases else None,
            "share_network": t.network_s / t.seconds if phases else None,
        })
    return rows


def _fmt(x, spec):
    return "–" if x is None else format(x, spec)


def format_markdown(record: dict) -> str:
    from specdec.tools import bench_concurrency

    devices = record.get("devices", {"target": "cpu", "draft": "cpu"})
    lines = [f"Command: `{record['command']}` — {record['prompts']} held-out prompts × "
             f"{record['new_tokens']} tokens; target on {devices['target']}, draft on {devices['draft']}.", ""]
    if "concurrency" in record:
        lines += ["### concurrency (greedy, aggregate tokens/s)", "",
                  bench_concurrency.format_markdown(record["concurrency"]), ""]
    for mode, rows in record.get("results", {}).items():
        lines += [f"### {mode}", "",
                  "| configuration | RTT ms | tok/s | speedup | accepted / proposed | tokens/round | bytes/round "
                  "| draft | target | network | cores |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(
                f"| {r['name']} | {r['rtt_ms']:g} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}× | "
                f"{_fmt(r['alpha'], '.2f')} | {_fmt(r['mean_accepted_length'], '.2f')} | "
                f"{_fmt(r['bytes_per_round'], '.0f')} | {_fmt(r['share_draft'], '.0%')} | "
                f"{_fmt(r['share_target'], '.0%')} | {_fmt(r['share_network'], '.0%')} | {r['cores']} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(results: dict, rtts: list[float], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, (mode, rows) in zip(axes[0], results.items(), strict=True):
        dist = [r for r in rows if r["kind"] == "distributed" and r["draft_ahead"]]
        for policy in dict.fromkeys(r["policy"] for r in dist):
            pts = sorted((r["rtt_ms"], r["speedup"]) for r in dist if r["policy"] == policy)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"distributed speedup over target-only ({mode})")
        ax.set_xlabel("added RTT (ms)")
        ax.set_ylabel("speedup")
        ax.set_xticks(rtts)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
