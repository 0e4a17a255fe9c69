"""The floor under the coordinator's CPU per round: what a bare grpc.aio round
costs the process in the middle, with no work in it, side by side for two
ways of making the round's calls.

A round through the coordinator is two calls to other processes (ProposeAll
to the draft, Verify to the target) and one message streamed out to the
client. Here a "back" process echoes bytes and a "front" process serves a
server stream whose every message costs two calls to the back, made either as
two unary calls (as the coordinator makes them) or as one message each way on
two bidirectional streams the stream keeps open. ``--streams`` clients at
once, ``--rounds`` messages each, ``--bytes`` per message. Prints the front
process's CPU per round for each, to set against
``scripts/many_streams.py --streams 16 --tokens 128 --policy static:4``.

    python scripts/grpc_round_floor.py [--streams 16] [--rounds 128] [--bytes 64]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pathlib
import time

SERVICE = "floor.Back"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def back(port: int) -> None:
    """Echoes: a unary method and a bidirectional one, bytes in and out."""
    import grpc

    async def call(request: bytes, context) -> bytes:
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
            "Call": grpc.unary_unary_rpc_method_handler(call),
            "Stream": grpc.stream_stream_rpc_method_handler(stream)})])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def front(port: int, back_port: int) -> None:
    """Streams one message per round to its client; the round's two calls to
    the back are unary calls or messages on two streams, as the client asks."""
    import grpc

    async def rounds(request: bytes, context):
        mode, payload = request[:1], request[1:]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{back_port}") as channel:
            if mode == b"u":
                call = channel.unary_unary(f"/{SERVICE}/Call")
                while True:
                    await call(payload, timeout=10)
                    await call(payload, timeout=10)
                    yield payload
            streams = [channel.stream_stream(f"/{SERVICE}/Stream")() for _ in range(2)]
            while True:
                for s in streams:
                    await s.write(payload)
                    await s.read()
                yield payload

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("floor.Front", {
            "Rounds": grpc.unary_stream_rpc_method_handler(rounds)})])
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def clients(port: int, mode: bytes, streams: int, rounds: int, size: int) -> None:
    import grpc

    async def one(method) -> None:
        got = 0
        async for _ in method(mode + b"x" * size, timeout=600):
            got += 1
            if got == rounds:
                return

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.unary_stream("/floor.Front/Rounds")
        await asyncio.gather(*(one(method) for _ in range(streams)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=128)
    parser.add_argument("--bytes", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from specdec.serving.server import free_port

    back_port, front_port = free_port(), free_port()
    procs = [multiprocessing.Process(target=back, args=(back_port,), daemon=True),
             multiprocessing.Process(target=front, args=(front_port, back_port), daemon=True)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # both listening
    per_round = {"two unary calls": [], "two open streams": []}
    try:
        for mode in (b"u", b"s"):  # warm up both paths
            asyncio.run(clients(front_port, mode, 2, 16, args.bytes))
        for _ in range(args.repeats):  # interleaved: the machine's load drifts over both alike
            for name, mode in (("two unary calls", b"u"), ("two open streams", b"s")):
                before = cpu_seconds(procs[1].pid)
                asyncio.run(clients(front_port, mode, args.streams, args.rounds, args.bytes))
                per_round[name].append((cpu_seconds(procs[1].pid) - before) / (args.streams * args.rounds))
    finally:
        for p in procs:
            p.terminate()
    print(f"{args.streams} streams x {args.rounds} rounds, {args.bytes}-byte messages; the front process's CPU "
          f"per round (median of {args.repeats}):")
    for name, samples in per_round.items():
        print(f"  {name:<18} {1000 * sorted(samples)[len(samples) // 2]:.3f} ms")


if __name__ == "__main__":
    main()
