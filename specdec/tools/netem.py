"""``specdec netem``: a loopback TCP proxy that adds latency and caps bandwidth.

The kernel's netem is not available on these machines, so tests and benchmarks
put this proxy between the coordinator and a service to emulate the network
between devices. Each direction is modelled as a link: a chunk occupies the link
for ``bytes·8 / bandwidth`` seconds (serialisation), then arrives ``delay``
(± jitter) later; order is preserved. Like netem on a loopback interface, the
delay applies in each direction, so the added round-trip time is twice
``--delay-ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import random
import time

log = logging.getLogger("specdec.tools.netem")

CHUNK = 64 * 1024


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class Link:
    """One direction of the emulated network."""

    def __init__(self, delay_s: float, jitter_s: float, bandwidth_bps: float | None, rng: random.Random):
        self.delay_s, self.jitter_s, self.bandwidth_bps, self.rng = delay_s, jitter_s, bandwidth_bps, rng
        self._free_at = 0.0  # when the link finishes sending what it already has
        self._last_arrival = 0.0

    def arrival_time(self, now: float, size: int) -> float:
        """When a chunk of ``size`` bytes handed over at ``now`` reaches the far end."""
        sent = max(now, self._free_at)
        if self.bandwidth_bps:
            sent += size * 8 / self.bandwidth_bps
        self._free_at = sent
        jitter = self.rng.uniform(-self.jitter_s, self.jitter_s) if self.jitter_s else 0.0
        arrival = max(sent + max(0.0, self.delay_s + jitter), self._last_arrival)  # no reordering
        self._last_arrival = arrival
        return arrival


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: Link) -> None:
    """Copy reader -> writer through ``link``: a reader task stamps chunks with
    their arrival time, a writer task releases them when due."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                break
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    delivering = asyncio.create_task(deliver())
    try:
        while data := await reader.read(CHUNK):
            queue.put_nowait((link.arrival_time(time.monotonic(), len(data)), data))
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        queue.put_nowait((0.0, b""))
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            await delivering
        with contextlib.suppress(Exception):
            writer.close()


async def start_proxy(
    listen: tuple[str, int],
    upstream: tuple[str, int],
    *,
    delay_ms: float = 0.0,
    jitter_ms: float = 0.0,
    bandwidth_mbps: float | None = None,
    seed: int = 0,
) -> asyncio.AbstractServer:
    """Start the proxy on the running loop; returns the server (port 0 picks one)."""
    if delay_ms < 0 or jitter_ms < 0:
        raise ValueError("--delay-ms and --jitter-ms must be >= 0")
    if bandwidth_mbps is not None and bandwidth_mbps <= 0:
        raise ValueError("--bandwidth-mbps must be > 0")
    rng = random.Random(seed)
    bps = bandwidth_mbps * 1e6 if bandwidth_mbps else None

    async def handle(client_reader, client_writer):
        try:
            up_reader, up_writer = await asyncio.open_connection(*upstream)
        except OSError as e:
            log.warning("upstream %s:%d unreachable: %s", *upstream, e)
            client_writer.close()
            return
        new_link = lambda: Link(delay_ms / 1e3, jitter_ms / 1e3, bps, rng)  # noqa: E731
        await asyncio.gather(
            _pump(client_reader, up_writer, new_link()),
            _pump(up_reader, client_writer, new_link()),
        )

    return await asyncio.start_server(handle, *listen)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where clients connect")
    p.add_argument("--upstream", required=True, metavar="HOST:PORT", help="the real service")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay per direction (RTT grows by twice this)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform ± jitter on the delay")
    p.add_argument("--bandwidth-mbps", type=float, default=None, help="link rate per direction (default: unlimited)")
    p.add_argument("--seed", type=int, default=0, help="seed for the jitter")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    listen, upstream = parse_address(args.listen), parse_address(args.upstream)

    async def main() -> None:
        server = await start_proxy(
            listen, upstream, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms,
            bandwidth_mbps=args.bandwidth_mbps, seed=args.seed,
        )
        port = server.sockets[0].getsockname()[1]
        log.info("netem proxy %s:%d -> %s:%d, delay %.1f ms ± %.1f ms per direction, bandwidth %s",
                 listen[0], port, *upstream, args.delay_ms, args.jitter_ms,
                 f"{args.bandwidth_mbps} Mbit/s" if args.bandwidth_mbps else "unlimited")
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    return 0
