"""Client-given names (session ids, turn ids) as every service accepts them:
bounded in length and printable, so one can neither bloat a service's memory
nor forge a log line. The same check on the coordinator and the model
services; in logs, names are shown with :func:`shown`, or not at all
(:func:`hidden_in`)."""

from __future__ import annotations

import hashlib

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


def hidden_in(text: str, session_id: str) -> str:
    """``text`` with ``session_id`` replaced by a short hash of it (``session#1a2b3c4d``):
    refusals are logged at INFO, and a log line must not hand one client's
    session name to whoever reads the logs (another client's flood of refusals
    would repeat it thousands of times). The hash still ties the lines of one
    session together."""
    if not session_id:
        return text
    return text.replace(session_id, "session#" + hashlib.sha256(session_id.encode()).hexdigest()[:8])
