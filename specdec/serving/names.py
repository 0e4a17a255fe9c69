"""Client-given names (session ids, turn ids) as every service accepts them:
bounded in length and printable, so one can neither bloat a service's memory
nor forge a log line. The same check on the coordinator and the model
services; in logs, names are shown with :func:`shown`."""

from __future__ import annotations

from specdec.serving.errors import InvalidRequest

MAX_NAME_LEN = 256
# A model service holds sessions under the coordinator's name for them: the
# client's id plus a "~" and 12 hex digits.
MAX_SERVICE_NAME_LEN = MAX_NAME_LEN + 13


def check_name(value: str, field: str, limit: int = MAX_NAME_LEN) -> None:
    """InvalidRequest unless ``value`` is at most ``limit`` printable characters."""
    if len(value) > limit:
        raise InvalidRequest(f"{field} is longer than {limit} characters")
    if not value.isprintable():
        raise InvalidRequest(f"{field} has control or other unprintable characters: use printable ones")


def shown(service_name: str) -> str:
    """A model service's session name for a log line: the client's id, without
    the random suffix that makes it the coordinator's own."""
    head, sep, _ = service_name.rpartition("~")
    return f"{head}~…" if sep else service_name
