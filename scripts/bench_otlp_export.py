"""CPU of the coordinator's tracing per round, and of OTLP encoding per span:
the SDK's encoder against ``specdec.telemetry.otlp_encode``.

Two measurements, on one core each (``--cores``: the measuring processes, then
the OTLP receiver's):

* **encoding**: the spans of simulated rounds (a round span and two CLIENT spans
  each, made by ``specdec.telemetry.observe`` as the coordinator makes them), encoded in
  batches of 512 by each encoder; µs per span. Both encodings are parsed and
  compared first.
* **per round**: a child process makes ``--rounds`` simulated rounds with a
  ``BatchSpanProcessor`` that drops the spans ("dropped"), or exports them over
  OTLP/gRPC to a receiver in another process with the SDK's exporter ("sdk") or
  specdec's ("specdec"); CPU per round of the whole process, exporter thread
  included, after a final flush. Variants interleave over ``--repeats`` runs;
  medians printed.

    python scripts/bench_otlp_export.py --rounds 5000 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

VARIANTS = ("off", "dropped", "sdk", "specdec")


def simulated_rounds(n: int) -> None:
    """``n`` rounds of the coordinator's span work, without gRPC, inside one
    generation span (as a request's rounds are)."""
    from specdec.telemetry import observe as telemetry, tracing
    from specdec.proto import specdec_pb2 as pb
    from specdec.core.interfaces import RoundResult

    draft = telemetry.ClientCalls("draft", "specdec.v1.DraftService")
    target = telemetry.ClientCalls("target", "specdec.v1.TargetService")
    timing = pb.ServerTiming(queue_s=1e-4, compute_s=0.01, copy_s=0.0, computed_tokens=4)
    result = RoundResult([1, 2, 3], 4, 2, 0.01, 0.01, None)
    with tracing.generation_span(model="m", max_tokens=n, temperature=0.0, input_tokens=8, conversation_id="c"):
        for i in range(n):
            with telemetry.TRACE_ONLY.round(i) as scope:
                with draft.call("Propose") as call:
                    call.record(telemetry.RpcRecord.of_call("draft", 0.012, timing, 120, 90))
                with target.call("Verify") as call:
                    call.record(telemetry.RpcRecord.of_call("target", 0.013, timing, 60, 40))
                scope.done(result)


def child(variant: str, endpoint: str, rounds: int) -> None:
    """One per-round measurement; prints CPU µs per round."""
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Dropped(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    if variant != "off":
        provider = TracerProvider(resource=Resource.create({"service.name": "specdec-coordinator"}))
        if variant == "dropped":
            exporter = Dropped()
        elif variant == "sdk":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        else:
            from specdec.telemetry.otlp_encode import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
    simulated_rounds(500)  # warm-up
    if variant != "off":
        trace.get_tracer_provider().force_flush()  # the warm-up's spans exported before the clock starts
    start = time.process_time()
    simulated_rounds(rounds)
    if variant != "off":
        trace.get_tracer_provider().force_flush()
    print(1e6 * (time.process_time() - start) / rounds)


def encoding(batch: int = 512, repeats: int = 20) -> dict[str, float]:
    """µs per span of each encoder over the spans of simulated rounds."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from specdec.telemetry import otlp_encode

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "specdec-coordinator"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    trace.set_tracer_provider(provider)
    simulated_rounds(batch // 3 + 1)
    spans = memory.get_finished_spans()[:batch]  # rounds' spans (the generation span ends last)
    assert ExportTraceServiceRequest.FromString(otlp_encode.encode_spans(spans)) == sdk_encode(spans)
    out = {}
    for name, encode in (("sdk", lambda: sdk_encode(spans).SerializeToString()),
                         ("specdec", lambda: otlp_encode.encode_spans(spans))):
        encode()
        start = time.process_time()
        for _ in range(repeats):
            encode()
        out[name] = 1e6 * (time.process_time() - start) / repeats / len(spans)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5000, help="simulated rounds per run (default 5000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant, interleaved (default 3)")
    parser.add_argument("--cores", default="1,0", help="measuring core, receiver core (default 1,0)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.endpoint, args.rounds)
        return

    from specdec.tools.otlp_receiver import OtlpReceiver

    work_core, receiver_core = (int(c) for c in args.cores.split(","))
    os.sched_setaffinity(0, {receiver_core})
    results: dict[str, list[float]] = {v: [] for v in VARIANTS}
    with OtlpReceiver(keep=False) as receiver:
        for _ in range(args.repeats):
            for variant in VARIANTS:
                out = subprocess.run(
                    ["taskset", "-c", str(work_core), sys.executable, __file__, "--child", variant,
                     "--endpoint", receiver.endpoint, "--rounds", str(args.rounds)],
                    check=True, capture_output=True, text=True).stdout
                results[variant].append(float(out.strip().splitlines()[-1]))
        spans = receiver.span_count
    os.sched_setaffinity(0, {work_core})
    per_span = encoding()
    print(f"OTLP encoding, spans of simulated coordinator rounds, batches of 512 (core {work_core}):")
    print(f"  SDK encode_spans + serialise   {per_span['sdk']:6.1f} µs per span")
    print(f"  specdec.telemetry.otlp_encode            {per_span['specdec']:6.1f} µs per span "
          f"({per_span['sdk'] / per_span['specdec']:.1f}x less)")
    print(f"coordinator tracing CPU per simulated round (round span + 2 CLIENT spans), {args.rounds} rounds x "
          f"{args.repeats} runs, medians; {spans} spans received:")
    floor = statistics.median(results["off"])
    labels = {"off": "tracing off", "dropped": "spans made, dropped", "sdk": "OTLP/gRPC, SDK exporter",
              "specdec": "OTLP/gRPC, specdec exporter"}
    for variant in VARIANTS:
        med = statistics.median(results[variant])
        print(f"  {labels[variant]:30s} {med:6.0f} µs  (+{med - floor:4.0f}; runs: "
              f"{' '.join(f'{r:.0f}' for r in results[variant])})")


if __name__ == "__main__":
    main()
