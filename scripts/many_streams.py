"""Many concurrent streams through one coordinator, every service at its
default settings: none may be refused or fail, and every output must equal
the same request served alone. Prints the coordinator's CPU per round, read
from its own process's CPU time and its round counter, and its memory per
stream: the rise of its resident set while the crowd is served, over the
streams (what --max-stream-memory charges a stream besides its request).

    python scripts/many_streams.py [--streams 1024] [--tokens 24] [--prompts 64] [--policy adaptive]

The same script gives the coordinator's cost per round under a steady load:

    python scripts/many_streams.py --streams 16 --tokens 128 --policy static:4

Prompts are distinct token sequences (``--prompts`` of them, each sent by
``streams / prompts`` streams); greedy decoding, so "served alone" is one
request at a time through the same services, made before the crowd.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    """A process's resident set, from /proc."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """The highest resident set of ``pid`` seen while in the with-block (sampled every 20 ms)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._stop = pid, rss_bytes(pid), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def rounds_done(metrics_url: str) -> float:
    """The coordinator's specdec_rounds_total."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("specdec_rounds_total"))


async def one(stub, pb, prompt: list[int], tokens: int, policy: str) -> tuple[list[int] | None, str]:
    """A stream's tokens, or None and why it failed."""
    import grpc

    request = pb.GenerateRequest(prompt_ids=prompt, max_new_tokens=tokens, gamma_policy=policy)
    out: list[int] = []
    try:
        async for reply in stub.Generate(request, timeout=600):
            if reply.HasField("delta"):
                out.extend(reply.delta.token_ids)
    except grpc.aio.AioRpcError as e:
        return None, f"{e.code().name}: {e.details()}"
    return out, ""


async def crowd(address: str, prompts: list[list[int]], streams: int, tokens: int, policy: str,
                alone: list | None = None):
    """Each prompt served alone (``alone`` None), or ``streams`` of them at once."""
    import grpc

    from specdec.proto import specdec_pb2 as pb
    from specdec.proto import specdec_pb2_grpc as pb_grpc

    # Several channels: one HTTP/2 connection caps concurrent streams (100 by default on many servers).
    channels = [grpc.aio.insecure_channel(address) for _ in range(max(1, streams // 64))]
    stubs = [pb_grpc.CoordinatorStub(c) for c in channels]
    if alone is None:
        return [(await one(stubs[0], pb, p, tokens, policy))[0] for p in prompts]
    started = time.perf_counter()
    results = await asyncio.gather(*(one(stubs[i % len(stubs)], pb, prompts[i % len(prompts)], tokens, policy)
                                     for i in range(streams)))
    wall = time.perf_counter() - started
    for c in channels:
        await c.close()
    return results, wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--policy", default="adaptive")
    args = p.parse_args()

    from specdec.cli.serve import Stack
    from specdec.models.bundled import draft_path, target_path
    from specdec.serving.server import free_port

    ports = {role: free_port() for role in ("coordinator", "draft", "target")}
    metrics = free_port()
    log = pathlib.Path(tempfile.mkdtemp(prefix="specdec-streams-")) / "services.log"
    stack = Stack(target=target_path(), draft=draft_path(), ports=ports,
                  devices={"draft": "cpu", "target": "cpu"}, log=log, metrics_ports={"coordinator": metrics})
    try:
        stack.wait_serving()
        prompts = [[(17 * i + 5 * j) % 500 + 3 for j in range(8 + i % 24)] for i in range(args.prompts)]
        pid, url = stack.procs["coordinator"].pid, f"http://127.0.0.1:{metrics}/metrics"
        address = stack.address("coordinator")
        alone = asyncio.run(crowd(address, prompts, args.streams, args.tokens, args.policy))
        cpu0, rounds0, rss0 = cpu_seconds(pid), rounds_done(url), rss_bytes(pid)
        with PeakRss(pid) as rss:
            results, wall = asyncio.run(crowd(address, prompts, args.streams, args.tokens, args.policy, alone))
        cpu, rounds = cpu_seconds(pid) - cpu0, rounds_done(url) - rounds0
    finally:
        stack.stop()
    failed = [why for out, why in results if out is None]
    differ = sum(1 for i, (out, _) in enumerate(results) if out is not None and out != alone[i % len(alone)])
    generated = sum(len(out) for out, _ in results if out is not None)
    print(f"{args.streams} streams of {args.tokens} tokens ({args.policy}), one coordinator: {len(failed)} refused "
          f"or failed, {differ} differ from the request served alone")
    for why in sorted(set(failed))[:5]:
        print(f"  failed: {why}")
    print(f"wall {wall:.1f} s, {generated / wall:.0f} tokens/s; coordinator CPU {cpu:.2f} s over {rounds:.0f} "
          f"rounds: {1000 * cpu / max(1.0, rounds):.3f} ms per round")
    print(f"coordinator memory: {rss0 / 2**20:.0f} MiB before, {rss.peak / 2**20:.0f} MiB at the peak: "
          f"{(rss.peak - rss0) / args.streams / 1024:.1f} kB per stream")
    return 0 if not failed and not differ else 1


if __name__ == "__main__":
    sys.exit(main())
