"""Transitional: the names below moved to specdec.telemetry.setup."""

from __future__ import annotations

from specdec.telemetry.setup import ServiceTelemetry, start_telemetry  # noqa: F401

