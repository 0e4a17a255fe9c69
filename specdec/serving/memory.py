"""Memory back to the system after a large request was refused.

Parsing a request of megabytes (a huge prompt, a flood of token ids) grows the
heap; refused, its objects are freed but the allocator keeps the pages, so a
service attacked with large requests would grow without bound. After a refused
request above :data:`LARGE_REQUEST_BYTES`, once gRPC has let go of it, a
collection and glibc's ``malloc_trim`` return them.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging

log = logging.getLogger(__name__)

LARGE_REQUEST_BYTES = 1 << 20
_AFTER_S = 0.5  # gRPC drops the request once the handler has returned: after that

_libc = None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _trim = _libc.malloc_trim
except (OSError, AttributeError):  # not glibc: the collection alone
    _trim = None


def release_memory() -> None:
    gc.collect()
    if _trim is not None:
        _trim(0)


def after_refused(request) -> None:
    """Call from a handler that refused ``request``: if it was large, give its
    memory back shortly after the handler has returned."""
    try:
        large = request is not None and request.ByteSize() > LARGE_REQUEST_BYTES
    except AttributeError:  # not a message (a malformed body never parsed)
        return
    if large:
        try:
            asyncio.get_running_loop().call_later(_AFTER_S, release_memory)
        except RuntimeError:  # no loop (a test calling a handler directly)
            release_memory()
