"""``specdec draft-service``: serve the draft model over gRPC (default port 50052).

Every flag falls back to an environment variable (``SPECDEC_DRAFT_PORT``,
``SPECDEC_MAX_SESSIONS`` ...; see ``--help``), then to a default.
"""

from __future__ import annotations

import argparse

from specdec.serving.config import DraftConfig, add_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, DraftConfig)


def run(args: argparse.Namespace) -> int:
    from specdec.draft_service.servicer import DRAFT
    from specdec.serving.model_host import run_service

    return run_service(args, DRAFT)
