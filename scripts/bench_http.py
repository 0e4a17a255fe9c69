"""The OpenAI-compatible HTTP API against gRPC: the same concurrent streaming
requests through one coordinator, in aggregate tokens/s, side by side.

    python scripts/bench_http.py [--streams 16] [--tokens 64] [--reps 4] [--policy adaptive]

Draft, target and a coordinator serving both APIs run as processes (``specdec
serve``'s :class:`Stack`, the bundled pair; on the CPU the draft on half the
cores, the target, the coordinator and this client on the rest, as ``specdec
demo`` and ``specdec bench`` lay them out). Each run sends ``--streams``
greedy requests at once, one per held-out prompt (token ids), and streams
them: over gRPC (``Generate``, one channel) or over HTTP (``POST
/v1/completions`` with ``"stream": true``, one httpx client -- the openai SDK's
transport -- each event's JSON parsed). After an untimed warm-up of each, the protocols take turns in ABBA
order over ``--reps`` repetitions, so a slow spell of the machine lands on
both. Prints tokens/s per protocol and repetition, HTTP ÷ gRPC over all of
them, the coordinator's and this client's CPU per token, and whether every
output is token-identical to the gRPC warm-up's (gRPC: the token ids; HTTP:
the text and the completion's token count). Exit 1 if any differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ one stream each way


async def grpc_stream(stub, pb, prompt: list[int], tokens: int, policy: str) -> tuple[str, list[int]]:
    """A Generate's (text, token ids)."""
    request = pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=tokens, gamma_policy=policy,
                                 sampling=pb.SamplingParams(temperature=0.0))
    text, ids = [], []
    async for reply in stub.Generate(request, timeout=600):
        if reply.HasField("delta"):
            text.append(reply.delta.text)
            ids.extend(reply.delta.token_ids)
    return "".join(text), ids


async def http_stream(client, prompt: list[int], tokens: int, policy: str) -> tuple[str, int]:
    """A streamed completion's (text, completion_tokens), every event parsed as a client would."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **({"gamma_policy": policy} if policy else {})}
    text, count = [], 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"]:
                text.append(chunk["choices"][0]["text"])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
    return "".join(text), count


# ------------------------------------------------------------------ a run: every prompt at once


class Protocols:
    """Both clients, open for the whole benchmark."""

    def __init__(self, grpc_address: str, http_url: str, tokens: int, policy: str):
        import grpc

        try:
            import httpx
        except ImportError:  # the openai SDK's own HTTP client, in its 3.x releases
            import httpx2 as httpx
        from specdec.proto import specdec_pb2 as pb
        from specdec.proto import specdec_pb2_grpc as pb_grpc

        self.pb, self.tokens, self.policy = pb, tokens, policy
        self.channel = grpc.aio.insecure_channel(grpc_address)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.http = httpx.AsyncClient(base_url=http_url, timeout=600,
                                      limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))

    async def run(self, protocol: str, prompts: list[list[int]]) -> tuple[list, float]:
        """Every prompt streamed at once: (outputs, wall seconds)."""
        if protocol == "grpc":
            calls = [grpc_stream(self.stub, self.pb, p, self.tokens, self.policy) for p in prompts]
        else:
            calls = [http_stream(self.http, p, self.tokens, self.policy) for p in prompts]
        started = time.perf_counter()
        outputs = await asyncio.gather(*calls)
        return outputs, time.perf_counter() - started

    async def close(self) -> None:
        await self.http.aclose()
        await self.channel.close()


def tokens_of(protocol: str, output) -> int:
    return len(output[1]) if protocol == "grpc" else output[1]


def same(protocol: str, output, reference: tuple[str, list[int]]) -> bool:
    """Token-identical to the reference: its ids (gRPC), or its text and token count (HTTP)."""
    if protocol == "grpc":
        return output[1] == reference[1]
    return output == (reference[0], len(reference[1]))


# ------------------------------------------------------------------ the benchmark


async def measure(protocols: Protocols, prompts: list[list[int]], reps: int, coordinator_pid: int) -> dict:
    """ABBA over ``reps`` repetitions after a warm-up of each: per protocol, the
    runs' (tokens, wall) and CPU seconds (coordinator, this process), and the
    outputs that differ from the gRPC warm-up's."""
    reference, _ = await protocols.run("grpc", prompts)
    await protocols.run("http", prompts)  # (warm-up)
    result = {p: {"runs": [], "coordinator_cpu": 0.0, "client_cpu": 0.0, "differ": 0} for p in ("grpc", "http")}
    for rep in range(reps):
        for protocol in ("grpc", "http") if rep % 2 == 0 else ("http", "grpc"):
            cpu0, own0 = cpu_seconds(coordinator_pid), time.process_time()
            outputs, wall = await protocols.run(protocol, prompts)
            r = result[protocol]
            r["coordinator_cpu"] += cpu_seconds(coordinator_pid) - cpu0
            r["client_cpu"] += time.process_time() - own0
            r["runs"].append((sum(tokens_of(protocol, o) for o in outputs), wall))
            r["differ"] += sum(not same(protocol, o, ref) for o, ref in zip(outputs, reference, strict=True))
    return result


async def bench(stack, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """:func:`measure` with both clients open (made on this loop)."""
    protocols = Protocols(stack.address("coordinator"), stack.http_url().removesuffix("/v1"), args.tokens,
                          args.policy)
    try:
        return await measure(protocols, prompts, args.reps, stack.procs["coordinator"].pid)
    finally:
        await protocols.close()


def report(result: dict, args: argparse.Namespace) -> str:
    g, h = result["grpc"], result["http"]
    rate = lambda runs: sum(t for t, _ in runs) / sum(w for _, w in runs)  # noqa: E731
    per_token = lambda r, key: 1000 * r[key] / sum(t for t, _ in r["runs"])  # noqa: E731
    lines = [f"{args.streams} concurrent streams x {args.tokens} tokens, greedy, gamma policy "
             f"{args.policy or 'the coordinator default'}, {args.reps} repetitions in ABBA order",
             "rep   gRPC tok/s   HTTP tok/s   HTTP / gRPC"]
    for i, (a, b) in enumerate(zip(g["runs"], h["runs"], strict=True), 1):
        lines.append(f"{i:<5} {a[0] / a[1]:10.1f}   {b[0] / b[1]:10.1f}   {(b[0] / b[1]) / (a[0] / a[1]):10.3f}")
    lines.append(f"all   {rate(g['runs']):10.1f}   {rate(h['runs']):10.1f}   {rate(h['runs']) / rate(g['runs']):10.3f}")
    lines.append(f"coordinator CPU ms per token: gRPC {per_token(g, 'coordinator_cpu'):.3f}, HTTP "
                 f"{per_token(h, 'coordinator_cpu'):.3f}; this client's: gRPC {per_token(g, 'client_cpu'):.3f}, "
                 f"HTTP {per_token(h, 'client_cpu'):.3f}")
    runs = args.reps * args.streams
    lines.append(f"outputs differing from the gRPC warm-up's: gRPC {g['differ']} of {runs}, HTTP {h['differ']} "
                 f"of {runs}")
    return "\n".join(lines)


def commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + (" (with uncommitted changes)" if dirty else "")


def start_stack(log: pathlib.Path):
    """The bundled pair's services and a coordinator with its HTTP API, on free loopback ports."""
    from specdec.cli.serve import Stack, split_cores
    from specdec.models.bundled import draft_path, target_path
    from specdec.serving.server import free_port

    devices = {"draft": "cpu", "target": "cpu"}
    cpus = split_cores(devices)
    if cpus is not None:  # this client works beside the coordinator, as specdec bench's does
        os.sched_setaffinity(0, cpus["coordinator"])
    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    return Stack(target=target_path(), draft=draft_path(), ports=ports, devices=devices, log=log, cpus=cpus,
                 http_port=free_port())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=16, help="concurrent streams per run (default 16)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per stream (default 64)")
    p.add_argument("--reps", type=int, default=4, help="timed runs per protocol, in ABBA order (default 4)")
    p.add_argument("--policy", default="", help="gamma policy (default: the coordinator's, adaptive)")
    args = p.parse_args()

    from specdec.tools.loadtest import held_out_prompts

    prompts = held_out_prompts(args.streams, new_tokens=args.tokens)
    log = pathlib.Path(tempfile.mkdtemp(prefix="specdec-bench-http-")) / "services.log"
    stack = start_stack(log)
    try:
        stack.wait_serving()
        result = asyncio.run(bench(stack, prompts, args))
    finally:
        stack.stop()
    print(f"commit {commit()}, {len(os.sched_getaffinity(0))} cores for this client ({os.cpu_count()} in all); "
          f"services' log {log}")
    print(report(result, args))
    return 0 if result["grpc"]["differ"] == result["http"]["differ"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
