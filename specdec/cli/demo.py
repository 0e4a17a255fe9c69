"""``specdec demo``: the whole system in one command.

Starts the draft, target and coordinator services on loopback (free ports; on
the CPU the draft on half the cores, the target, the coordinator and this client
on the other half, as the benchmark lays them out), streams
a speculative completion of a code prompt to stdout as the rounds commit, then
runs the same prompt through the same services as plain target decoding
(γ = 0) and prints acceptance, γ, tokens/s and the speedup -- both measured in
this run, on this machine, so the figure is honest rather than quoted.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

from specdec.cli.serve import Stack, add_model_arguments, model_dirs, split_cores

DEFAULT_PROMPT = 'class Error(Exception):\n    """Base class for exceptions in this module."""\n    pass\n\n\nclass'


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="text to complete (default: the start of a Python class)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--gamma-policy", default="adaptive",
                   help="static:N | heuristic | adaptive (default adaptive)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--http-port", type=int, default=0, metavar="PORT",
                   help="also serve the coordinator's OpenAI-compatible HTTP API on http://127.0.0.1:PORT/v1 "
                        "while the demo runs (default 0: off; the demo's services take free ports and stop "
                        "when it ends: `specdec serve` keeps them up, on 8000)")


def run(args: argparse.Namespace) -> int:
    from specdec.core.gamma import parse_gamma_policy
    from specdec.serving.client import Client
    from specdec.serving.config import CoordinatorConfig
    from specdec.serving.server import free_port

    if args.max_new_tokens <= 0:
        raise ValueError(f"--max-new-tokens must be > 0, got {args.max_new_tokens}")
    if not 0 <= args.http_port <= 65535:
        raise ValueError(f"--http-port must be a port in [1, 65535], or 0 for none, got {args.http_port}")
    parse_gamma_policy(args.gamma_policy, gamma_max=CoordinatorConfig.model_fields["gamma_max"].default)
    target, draft = model_dirs(args)
    log = pathlib.Path(tempfile.mkdtemp(prefix="specdec-demo-")) / "services.log"
    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    say = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731 -- stdout is the completion
    devices = {"draft": args.device_draft, "target": args.device_target}
    cpus = split_cores(devices)
    where = "" if cpus is None else (f"; draft on CPU cores {_cores(cpus['draft'])}, target, coordinator and this "
                                     f"client on {_cores(cpus['target'])}")
    say(f"starting draft ({draft.name}, {args.device_draft}), target ({target.name}, {args.device_target}) "
        f"and coordinator on loopback (logs: {log}{where}) ...")
    if cpus is not None:  # this process is the client: it works while the target waits, as the coordinator does
        os.sched_setaffinity(0, cpus["coordinator"])
    stack = Stack(target=target, draft=draft, ports=ports, tokenizer=args.tokenizer, devices=devices, log=log,
                  cpus=cpus, http_port=args.http_port)
    try:
        stack.wait_serving()
        http = f", OpenAI-compatible HTTP API {stack.http_url()} (until the demo ends)" if args.http_port else ""
        say(f"serving: coordinator {stack.address('coordinator')}{http}, draft {stack.address('draft')}, "
            f"target {stack.address('target')}\n")
        with Client(stack.address("coordinator"), timeout=600) as client:
            request = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
            for policy in (args.gamma_policy, "static:0"):  # warm both paths up (first passes are slow)
                client.complete(args.prompt, max_new_tokens=8, gamma_policy=policy)

            sys.stdout.write(args.prompt)
            sys.stdout.flush()
            ids, spec = [], None
            for event in client.generate(args.prompt, gamma_policy=args.gamma_policy, **request):
                if hasattr(event, "text"):
                    sys.stdout.write(event.text)
                    sys.stdout.flush()
                    ids.extend(event.token_ids)
                else:
                    spec = event
            print()

            say("\nmeasuring target-only decoding (gamma 0) on the same services ...")
            base = client.complete(args.prompt, gamma_policy="static:0", **request)
        say(summary(spec, base.stats, args.gamma_policy, same=base.token_ids == ids,
                    greedy=args.temperature == 0))
    except KeyboardInterrupt:
        return 130
    finally:
        stack.stop()
    return 0


def _cores(cores: set[int]) -> str:
    return ",".join(map(str, sorted(cores)))


def summary(spec, base, policy: str, *, same: bool, greedy: bool) -> str:
    """The demo's closing lines."""
    gammas = [g for g in spec.gammas if g]
    tokens_per_round = spec.generated_tokens / spec.rounds if spec.rounds else 0.0
    speedup = spec.tokens_per_second / base.tokens_per_second if base.tokens_per_second else 0.0
    lines = [
        "",
        f"acceptance    {spec.acceptance_rate:.0%} ({spec.accepted_tokens} of {spec.drafted_tokens} drafted tokens)",
        f"gamma         {policy}: mean {spec.mean_gamma:.1f} over {spec.rounds} rounds"
        + (f"; drafted in {len(gammas)} of them (gamma {min(gammas)}-{max(gammas)})" if gammas else "; never drafted"),
        f"drafts ready  {spec.prepared_rounds} of {len(gammas)} drafting rounds: prepared while the target verified "
        f"the round before",
        f"speculative   {spec.tokens_per_second:7.1f} tokens/s  ({spec.generated_tokens} tokens, {spec.rounds} rounds, "
        f"{tokens_per_round:.2f} tokens/round, {spec.elapsed_s:.2f} s)",
        f"target only   {base.tokens_per_second:7.1f} tokens/s  ({base.generated_tokens} tokens, "
        f"{base.elapsed_s:.2f} s)",
        f"speedup       {speedup:.2f}x",
        "",
        "where the time went        ms per round | ms per token | target only, ms per token",
        *breakdown(spec, base),
    ]
    if greedy:
        lines.insert(7, f"same output as target-only decoding: {'yes' if same else 'NO'}")
    return "\n".join(lines)


def breakdown(spec, base) -> list[str]:
    """One line per share of the wall time: per speculative round, and per
    token of each run (what the speedup compares)."""
    ours, theirs = spec.time_split(), base.time_split()
    ms = lambda seconds, count: 1000 * seconds / max(1, count)  # noqa: E731
    return [f"  {name:<28}{ms(ours[name], spec.rounds):8.2f} {ms(ours[name], spec.generated_tokens):14.2f} "
            f"{ms(theirs[name], base.generated_tokens):14.2f}" for name in ours]

