"""The command-line flags of ``specdec draft-service`` and ``specdec
target-service``, apart from the service itself so that ``--help`` does not
load torch and transformers."""

from __future__ import annotations

import argparse
import dataclasses

from specdec.serving.config import ServiceConfig, env_names, role_prefixes
from specdec.telemetry.observe import add_arguments as add_telemetry_arguments


def add_service_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    """The flags of ``specdec draft-service`` / ``specdec target-service``. Each
    defaults to its environment variable, then to :class:`ServiceConfig`'s default."""
    defaults = ServiceConfig(role=role)

    def env(field: str) -> str:
        return " or ".join(env_names(ServiceConfig, field, role_prefixes(role)))

    def add(flag: str, field: str, help: str, **kw):
        parser.add_argument(flag, dest=field, default=None,
                            help=f"{help} [env {env(field)}; default {getattr(defaults, field)}]", **kw)

    add("--model", "model", f"{role} model directory (default: the bundled {role} model)", metavar="DIR")
    add("--device", "device", "torch device, e.g. cpu, cuda:0")
    add("--dtype", "dtype", "model dtype", choices=["float32", "bfloat16", "float16"])
    add("--host", "host", "address to listen on")
    add("--port", "port", "port to listen on (0: any free port)", type=int)
    add("--max-sessions", "max_sessions", "sessions held before LRU eviction", type=int)
    add("--max-cached-tokens", "max_cached_tokens", "tokens held over all sessions before LRU eviction", type=int)
    add("--session-ttl", "session_ttl_s", "seconds an idle session is kept", type=float, metavar="SECONDS")
    add("--gamma-max", "gamma_max", "largest gamma / number of drafts accepted per call", type=int)
    add("--max-message-bytes", "max_message_bytes", "gRPC message size limit", type=int)
    add("--drain-grace", "drain_grace_s", "on SIGTERM, seconds the generations in flight may take to finish",
        type=float, metavar="SECONDS")
    add("--log-level", "log_level", "logging level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    if role == "draft":
        add("--draft-ahead", "draft_ahead", "while the target verifies, draft the next round as if all drafts "
            "are accepted (reused when they are; the output never changes)", action=argparse.BooleanOptionalAction)
        add("--lean-forward", "lean_forward", "run a Llama-architecture draft through specdec's lean forward pass "
            "instead of Hugging Face's (same weights, less Python per token; the output's distribution never changes, "
            "though one seed's sampled tokens follow q to the last bit)",
            action=argparse.BooleanOptionalAction)
    add_telemetry_arguments(parser, role)


def config_from_args(args: argparse.Namespace, role: str) -> ServiceConfig:
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(ServiceConfig) if f.name != "role"}
    return ServiceConfig.load(role, overrides)
