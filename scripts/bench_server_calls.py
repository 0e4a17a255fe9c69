"""Server CPU per traced call: what a service's tracing interceptor costs.

A service process (here: a GrpcServer with a do-nothing Verify, pinned to one
core) serves unary calls from a client on another core; the client sends W3C
``traceparent`` metadata as the coordinator does, sampled or not, and runs the
OTLP receiver the server exports to. The server's own CPU time per call is read
with ``getrusage`` (exporter thread included). Setups, interleaved over
``--repeats`` runs, medians printed:

* ``off``: nothing configured (no interceptor at all), the floor;
* ``specdec``: tracing as ``specdec serve`` installs it (``ServerObserver``);
* ``instrumentation``: OpenTelemetry's aio server interceptor in front of an
  untraced ``ServerObserver``, what the services used before (only if
  ``opentelemetry-instrumentation-grpc`` is installed).

    python scripts/bench_server_calls.py --calls 2000 --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

SERVICE, METHOD = "specdec.v1.TargetService", "Verify"


def serve(setup: str, rendezvous: pathlib.Path, core: int) -> None:
    """The server process: bind, write the port, then report CPU between the
    client's "go" and "stop" files."""
    os.sched_setaffinity(0, {core})
    from specdec.telemetry import observe as telemetry, tracing
    from specdec.proto import specdec_pb2 as pb
    from specdec.serving.server import GrpcServer

    if setup == "off":
        interceptors = []
    else:
        tracing.setup_tracing("bench-server", None, os.environ)
        if setup == "specdec":
            interceptors = telemetry.ServiceTelemetry.for_role("target").server_interceptors()
        else:
            from opentelemetry.instrumentation.grpc import aio_server_interceptor

            interceptors = [aio_server_interceptor(), telemetry.ServerObserver(None, traced=False)]

    async def verify(request, context):
        return pb.VerifyResponse(accepted=1)

    handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(
        verify, request_deserializer=pb.VerifyRequest.FromString,
        response_serializer=pb.VerifyResponse.SerializeToString)})

    def cpu() -> float:
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime

    async def main():
        server = GrpcServer([SERVICE], interceptors=interceptors)
        server.server.add_generic_rpc_handlers((handler,))
        port = server.bind("127.0.0.1", 0)
        await server.server.start()
        (rendezvous / "port").write_text(str(port))
        while not (rendezvous / "go").exists():
            await asyncio.sleep(0.005)
        start = cpu()
        while not (rendezvous / "stop").exists():
            await asyncio.sleep(0.005)
        (rendezvous / "cpu").write_text(str(cpu() - start))
        await server.server.stop(None)
        from opentelemetry import trace

        getattr(trace.get_tracer_provider(), "shutdown", lambda: None)()

    asyncio.run(main())


def wait_for(path: pathlib.Path) -> str:
    while not (path.exists() and path.read_text()):
        time.sleep(0.01)
    return path.read_text()


def measure(setup: str, sampled: bool, calls: int, endpoint: str, cores: tuple[int, int]) -> float:
    """Server CPU µs per call for one setup."""
    from specdec.proto import specdec_pb2 as pb

    with tempfile.TemporaryDirectory() as tmp:
        rendezvous = pathlib.Path(tmp)
        env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=endpoint, OTEL_EXPORTER_OTLP_INSECURE="true")
        server = subprocess.Popen([sys.executable, __file__, "--serve", setup, "--rendezvous", tmp,
                                   "--server-core", str(cores[0])], env=env)
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{wait_for(rendezvous / 'port')}")
            verify = channel.unary_unary(f"/{SERVICE}/{METHOD}", request_serializer=pb.VerifyRequest.SerializeToString,
                                         response_deserializer=pb.VerifyResponse.FromString)
            request = pb.VerifyRequest(session_id="s", draft_tokens=[1, 2, 3])
            flags = "01" if sampled else "00"

            def call():
                traceparent = f"00-{random.getrandbits(128):032x}-{random.getrandbits(64):016x}-{flags}"
                verify(request, metadata=(("traceparent", traceparent),))

            for _ in range(min(300, calls)):  # warm-up
                call()
            (rendezvous / "go").touch()
            time.sleep(0.05)
            for _ in range(calls):
                call()
            (rendezvous / "stop").touch()
            cpu_s = float(wait_for(rendezvous / "cpu"))
            channel.close()
        finally:
            server.wait(timeout=30)
    return cpu_s / calls * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="measured calls per run (default 2000)")
    parser.add_argument("--repeats", type=int, default=4, help="runs per setup, interleaved (default 4)")
    parser.add_argument("--cores", default="0,1", help="server core, client core (default 0,1)")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    parser.add_argument("--server-core", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, pathlib.Path(args.rendezvous), args.server_core)
        return

    from specdec.tools.otlp_receiver import OtlpReceiver

    server_core, client_core = (int(c) for c in args.cores.split(","))
    os.sched_setaffinity(0, {client_core})
    setups = [("off", False), ("specdec", True), ("specdec", False)]
    try:
        import opentelemetry.instrumentation.grpc  # noqa: F401

        setups += [("instrumentation", True), ("instrumentation", False)]
    except ImportError:
        print("opentelemetry-instrumentation-grpc is not installed: comparing with nothing but 'off'")
    results: dict[tuple[str, bool], list[float]] = {s: [] for s in setups}
    with OtlpReceiver(keep=False) as receiver:
        for _ in range(args.repeats):
            for setup, sampled in random.sample(setups, len(setups)):
                results[(setup, sampled)].append(
                    measure(setup, sampled, args.calls, receiver.endpoint, (server_core, client_core)))
        print(f"server CPU per unary call, {args.calls} calls x {args.repeats} runs per setup "
              f"(server on core {server_core}, client on {client_core}); {receiver.span_count} spans received")
    floor = statistics.median(results[("off", False)])
    for (setup, sampled), runs in results.items():
        label = setup if setup == "off" else f"{setup}, {'sampled' if sampled else 'unsampled'} caller"
        med = statistics.median(runs)
        print(f"  {label:36s} {med:6.0f} µs  (+{med - floor:4.0f} over off; runs: "
              f"{' '.join(f'{r:.0f}' for r in runs)})")


if __name__ == "__main__":
    main()
