"""The floor under the coordinator's CPU per round: what a bare grpc.aio round
costs the process in the middle, with no work in it.

A round through the coordinator is two unary calls to other processes
(ProposeAll to the draft, Verify to the target) and one message streamed out
to the client. Here a "back" process answers unary calls (gRPC health Check:
no work) and a "front" process serves a server stream whose every message
costs two unary calls to the back: ``--streams`` clients at once, ``--rounds``
messages each. Prints the front process's CPU per round, to set against
``scripts/many_streams.py --streams 16 --tokens 128 --policy static:4``.

    python scripts/grpc_round_floor.py [--streams 16] [--rounds 128]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pathlib
import time


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def back(port: int) -> None:
    """A server answering health Checks: the services' unary calls, without their work."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    async def serve() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def front(port: int, back_port: int) -> None:
    """A server streaming health responses, each after two unary calls to the back."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    class Front(health_pb2_grpc.HealthServicer):
        def __init__(self, stub):
            self.stub = stub

        async def Watch(self, request, context):
            while True:  # one round: two calls out, one message back
                await self.stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                await self.stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
                yield health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    async def serve() -> None:
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{back_port}")
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(Front(health_pb2_grpc.HealthStub(channel)), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


async def clients(port: int, streams: int, rounds: int) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def one(stub) -> None:
        got = 0
        async for _ in stub.Watch(health_pb2.HealthCheckRequest(), timeout=600):
            got += 1
            if got == rounds:
                return

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        await one(stub)  # warm up: connections made, code paths run once
        await asyncio.gather(*(one(stub) for _ in range(streams)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=128)
    args = parser.parse_args()
    from specdec.serving.server import free_port

    back_port, front_port = free_port(), free_port()
    procs = [multiprocessing.Process(target=back, args=(back_port,), daemon=True),
             multiprocessing.Process(target=front, args=(front_port, back_port), daemon=True)]
    for p in procs:
        p.start()
    time.sleep(2.0)  # both listening
    try:
        asyncio.run(clients(front_port, 1, 32))  # the processes warmed up
        before = cpu_seconds(procs[1].pid)
        started = time.perf_counter()
        asyncio.run(clients(front_port, args.streams, args.rounds))
        wall = time.perf_counter() - started
        cpu = cpu_seconds(procs[1].pid) - before
    finally:
        for p in procs:
            p.terminate()
    rounds = args.streams * args.rounds + args.rounds  # the warm-up stream of each run too
    print(f"{args.streams} streams x {args.rounds} rounds of two unary calls and one streamed message: "
          f"front process CPU {cpu:.2f} s in {wall:.1f} s, {1000 * cpu / rounds:.3f} ms per round")


if __name__ == "__main__":
    main()
