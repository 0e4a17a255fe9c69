"""``specdec target-service``: serve the target model over gRPC (default port 50053).

Every flag falls back to an environment variable (``SPECDEC_TARGET_PORT``,
``SPECDEC_MAX_SESSIONS`` ...; see ``--help``), then to a default.
"""

from __future__ import annotations

import argparse

from specdec.serving.config import TargetConfig, add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, TargetConfig)


def run(args: argparse.Namespace) -> int:
    from specdec.serving.model_host import run_service
    from specdec.target_service.servicer import TARGET

    return run_service(args, TARGET)
