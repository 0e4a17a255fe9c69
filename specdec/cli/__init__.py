"""The ``specdec`` command line: one sub-command per job, each in its own module
exposing ``add_arguments(parser)`` and ``run(args) -> int``.

This package is the only place that knows the draft, target and coordinator
services together; modules are imported lazily so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from specdec import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("specdec.cli.demo", "start the three services on loopback and stream a completion"),
    "serve": ("specdec.cli.serve", "run draft, target and coordinator on loopback in one command"),
    "generate": ("specdec.cli.generate", "generate a completion (in-process with --local, or from a coordinator)"),
    "draft-service": ("specdec.draft_service.server", "run the draft model gRPC service"),
    "target-service": ("specdec.target_service.server", "run the target model gRPC service"),
    "coordinator": ("specdec.coordinator.server", "run the coordinator gRPC service"),
    "train-models": ("specdec.tools.train_models", "train the bundled target/draft model pair"),
    "eval-pair": ("specdec.tools.eval_pair", "measure a model pair: latency, held-out loss, acceptance"),
    "netem": ("specdec.tools.netem", "TCP proxy adding latency and a bandwidth cap (network emulation)"),
    "bench": ("specdec.tools.bench",
              "benchmark against target-only and HF assisted generation, in-process and distributed"),
    "bench-overhead": ("specdec.tools.bench_overhead", "measure the decoder's per-round overhead"),
    "trace-report": ("specdec.tools.trace_report", "per-round time breakdown (and PNG) from --trace-file traces"),
    "bench-tracing": ("specdec.tools.bench_tracing", "tokens/s with tracing exporting vs off, side by side"),
    "loadtest": ("specdec.tools.loadtest", "many concurrent streaming sessions against a coordinator"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specdec", description="Distributed, lossless speculative decoding."
    )
    parser.add_argument("--version", action="version", version=f"specdec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        # No abbreviations: `--prompt` must not silently mean `--prompt-ids`.
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        if name == only:  # import just the module that will run (none for the top-level --help)
            importlib.import_module(module).add_arguments(p)
            parser.set_defaults(**{f"_parser_{name}": p})
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if a in COMMANDS), None)
    parser = build_parser(only=command)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # with the sub-command's own usage, not the top level's
        getattr(args, f"_parser_{args.command}", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad input: a message, not a traceback
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a port in use, a file that cannot be written
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
