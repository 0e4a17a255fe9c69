"""``specdec loadtest``: many concurrent streaming sessions against a coordinator.

N client threads share one channel; each sends requests one after another (the
next as soon as the last ends) until ``--requests`` have been sent or
``--duration`` has passed. Prompts are the benchmark's held-out code windows
(the same every run) unless ``--prompt`` gives others. Reported:

* aggregate tokens/s: generated tokens of successful requests / wall time;
* time to first token (TTFT) and inter-token latency (ITL), p50 and p99: ITL is
  the gap between two streamed deltas spread over the tokens of the later one
  (a round commits several tokens at once);
* requests/s, and errors by gRPC status code.

``--turns T`` makes each session a conversation of T turns on one named
session (the first turn sends a whole prompt, later ones a 16-token follow-up).
``--check`` then compares every greedy turn, after the run, with target-only
decoding (γ = 0) of the same history through the same coordinators: speculation,
batching and any failover during the run must not change a token.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import sys
import threading
import time

DEFAULT_SESSIONS = 8


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it: times relative to its start, in seconds."""

    tokens: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    first_token_s: float | None = None
    token_gaps_s: list[float] = dataclasses.field(default_factory=list)  # one per token after the first delta
    total_s: float = 0.0
    error: str | None = None  # the gRPC status code's name


@dataclasses.dataclass
class LoadReport:
    sessions: int
    requests: int
    errors: dict[str, int]
    wall_s: float
    tokens: int
    tokens_per_second: float
    requests_per_second: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    checked: int = 0  # turns compared with target-only decoding (--check)
    differed: int = 0

    def lines(self) -> list[str]:
        errors = ", ".join(f"{code} {n}" for code, n in sorted(self.errors.items())) or "none"
        check = [f"outputs        {self.checked} turns checked against target-only decoding, "
                 f"{self.differed} differed"] if self.checked else []
        return [*check,
            f"sessions       {self.sessions} concurrent, {self.requests} requests in {self.wall_s:.1f} s "
            f"({self.requests_per_second:.2f} requests/s)",
            f"throughput     {self.tokens_per_second:.1f} tokens/s ({self.tokens} tokens)",
            f"first token    p50 {self.ttft_p50_s * 1e3:.0f} ms, p99 {self.ttft_p99_s * 1e3:.0f} ms",
            f"inter-token    p50 {self.itl_p50_s * 1e3:.1f} ms, p99 {self.itl_p99_s * 1e3:.1f} ms",
            f"errors         {errors}",
        ]


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def one_request(client, prompt: str | list[int], request: dict) -> RequestRecord:
    """Stream one completion, timing each delta."""
    from specdec.serving.client import Delta
    from specdec.serving.errors import SpecdecError

    record, start = RequestRecord(), time.perf_counter()
    last = None
    prompt_args = {"prompt_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
    try:
        for event in client.generate(**prompt_args, **request):
            if not isinstance(event, Delta) or not event.token_ids:
                continue
            now = time.perf_counter()
            if last is None:
                record.first_token_s = now - start
            else:
                record.token_gaps_s += [(now - last) / len(event.token_ids)] * len(event.token_ids)
            last = now
            record.tokens += len(event.token_ids)
            record.token_ids += event.token_ids
    except SpecdecError as e:
        record.error = e.code.name
    record.total_s = time.perf_counter() - start
    return record


@dataclasses.dataclass
class Turn:
    """One request of a conversation, kept for ``--check``."""

    session_id: str
    history: list[int]  # the conversation's tokens before this turn's prompt
    prompt: list[int]
    record: RequestRecord


def run_load(address: str, prompts: list, *, sessions: int, requests: int, duration_s: float | None,
             request: dict, turns: int = 1, progress: bool = False) -> tuple[LoadReport, list[Turn]]:
    """``sessions`` threads sending ``requests`` in all (or until ``duration_s``),
    as conversations of ``turns`` requests each; the report, and the turns of
    prompt-id conversations (for :func:`check_turns`)."""
    from tqdm import tqdm

    from specdec.serving.client import Client

    lock, records, done = threading.Lock(), [], []
    conversations = iter(range(math.ceil(requests / turns)))
    bar = tqdm(total=requests, unit="req", disable=not progress, file=sys.stderr)
    addresses = address.split(",")
    start = time.perf_counter()
    deadline = start + duration_s if duration_s else float("inf")
    run_id = f"load-{time.time_ns():x}"

    def worker(n: int):
        # Each session starts at another coordinator (when given several), going
        # on through the next if its own fails.
        with Client(addresses[n % len(addresses):] + addresses[:n % len(addresses)], timeout=600) as client:
            while time.perf_counter() < deadline:
                with lock:
                    c = next(conversations, None)
                if c is None:
                    return
                session = f"{run_id}-{c}" if turns > 1 else ""
                history: list = []
                for k in range(min(turns, requests - c * turns)):
                    prompt = follow_up(prompts, c * turns + k, first=k == 0)
                    record = one_request(client, prompt, {**request, "session_id": session})
                    with lock:
                        records.append(record)
                        if isinstance(prompt, list):
                            done.append(Turn(session, list(history), prompt, record))
                        bar.update()
                    if record.error is not None:
                        break
                    history += list(prompt) + record.token_ids
                if session:
                    close_quietly(client, session)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(sessions)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    bar.close()
    return summarise(records, sessions, wall), done


def close_quietly(client, session_id: str) -> None:
    """Free a finished conversation's state in the services (its history stays
    in the directory until closed: closing forgets both)."""
    from specdec.serving.errors import SpecdecError

    try:
        client.close_session(session_id)
    except SpecdecError:
        pass  # forgotten already, or the coordinator is gone: the services' TTL frees it


def follow_up(prompts: list, i: int, first: bool):
    """The ``i``-th request's prompt: a whole prompt to start a conversation,
    its first 16 tokens (a prompt of ids) to go on with one."""
    prompt = prompts[i % len(prompts)]
    return prompt if first or not isinstance(prompt, list) else prompt[:16]


def check_turns(address: str, turns: list[Turn], request: dict) -> int:
    """How many successful greedy ``turns`` differ from target-only decoding of
    the same history and prompt, one-shot, through the coordinator."""
    from specdec.serving.client import Client

    differed = 0
    with Client(address.split(","), timeout=600) as client:
        for turn in turns:
            if turn.record.error is not None:
                continue
            want = client.complete(prompt_ids=turn.history + turn.prompt, gamma_policy="static:0",
                                   max_new_tokens=request["max_new_tokens"]).token_ids
            got = turn.record.token_ids
            if want != got:
                differed += 1
                at = next((i for i, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), len(got))
                print(f"session {turn.session_id or '(one-shot)'}: the turn after {len(turn.history)} history "
                      f"tokens differs from target-only decoding from token {at} on", file=sys.stderr)
    return differed


def summarise(records: list[RequestRecord], sessions: int, wall_s: float) -> LoadReport:
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    first = [r.first_token_s for r in ok if r.first_token_s is not None]
    gaps = [g for r in ok for g in r.token_gaps_s]
    return LoadReport(
        sessions=sessions, requests=len(records),
        errors=dict(collections.Counter(r.error for r in records if r.error is not None)),
        wall_s=wall_s, tokens=tokens,
        tokens_per_second=tokens / wall_s if wall_s else 0.0,
        requests_per_second=len(records) / wall_s if wall_s else 0.0,
        ttft_p50_s=percentile(first, 50), ttft_p99_s=percentile(first, 99),
        itl_p50_s=percentile(gaps, 50), itl_p99_s=percentile(gaps, 99),
    )


def held_out_prompts(n: int, prompt_tokens: int = 128, new_tokens: int = 96) -> list[list[int]]:
    """The benchmark's prompts: ``n`` windows of held-out files, as bundled-tokenizer ids."""
    from specdec.models import bundled
    from specdec.models.tokenizer import load_tokenizer
    from specdec.tools.eval_pair import held_out_streams, make_prompts

    tokenizer = load_tokenizer(bundled.target_path())
    return make_prompts(held_out_streams(tokenizer), n, prompt_tokens, new_tokens, seed=0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default="localhost:50051", metavar="HOST:PORT[,HOST:PORT...]",
                   help="coordinator address (default localhost:50051); several, comma-separated: each "
                   "session goes on through the next when its stream breaks (they share --redis)")
    p.add_argument("--sessions", type=int, default=DEFAULT_SESSIONS,
                   help=f"concurrent streaming sessions (default {DEFAULT_SESSIONS})")
    p.add_argument("--requests", type=int, default=None, help="requests in all (default 4 per session)")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="stop sending new requests after this long (default: no limit)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a prompt (text; repeatable). Default: 16 held-out code windows of 128 tokens, sent as "
                        "token ids of the bundled tokenizer (for a coordinator serving the bundled pair)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens per request (default 96)")
    p.add_argument("--gamma-policy", default="", metavar="POLICY",
                   help="static:N | heuristic | adaptive (default: the coordinator's)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--turns", type=int, default=1,
                   help="turns per conversation, each conversation a named session (default 1: one-shot requests)")
    p.add_argument("--check", action="store_true",
                   help="after the run, compare every turn with target-only decoding of the same history "
                   "(greedy, prompt ids only); exit 1 if any differs")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH ('-': stdout)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_arguments(args: argparse.Namespace) -> None:
    for name in ("sessions", "max_new_tokens", "turns"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.requests is not None and args.requests <= 0:
        raise ValueError(f"--requests must be > 0, got {args.requests}")
    if args.duration is not None and args.duration <= 0:
        raise ValueError(f"--duration must be > 0, got {args.duration}")
    if args.sessions > 1024:
        raise ValueError(f"--sessions {args.sessions}: at most 1024 client threads")
    if args.check and (args.temperature > 0 or args.prompt):
        raise ValueError("--check compares greedy outputs of token-id prompts: drop --temperature and --prompt")


def run(args: argparse.Namespace) -> int:
    check_arguments(args)
    prompts = args.prompt or held_out_prompts(16)
    request = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
               "gamma_policy": args.gamma_policy}
    if args.temperature > 0:
        request["seed"] = args.seed
    report, turns = run_load(args.coordinator, prompts, sessions=args.sessions,
                             requests=args.requests or 4 * args.sessions, duration_s=args.duration,
                             request=request, turns=args.turns, progress=not args.no_progress)
    if args.check:
        report.checked = sum(t.record.error is None for t in turns)
        report.differed = check_turns(args.coordinator, turns, request)
    print("\n".join(report.lines()))
    if args.json:
        text = json.dumps(dataclasses.asdict(report), indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0 if report.requests and not report.errors and not report.differed else 1
