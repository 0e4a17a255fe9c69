"""The netem proxy adds the configured delay and honours the bandwidth cap,
measured over real loopback sockets."""

import asyncio
import statistics
import time

import pytest

from specdec.tools.netem import Link, parse_address, start_proxy


async def echo_server():
    async def handle(reader, writer):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def port_of(server):
    return server.sockets[0].getsockname()[1]


async def round_trips(port, n=15, size=64):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        writer.write(b"x" * size)
        await reader.readexactly(size)
        times.append(time.perf_counter() - start)
    writer.close()
    return times


async def measure_added_rtt(delay_ms):
    echo = await echo_server()
    proxy = await start_proxy(("127.0.0.1", 0), ("127.0.0.1", port_of(echo)), delay_ms=delay_ms)
    direct = statistics.median(await round_trips(port_of(echo)))
    proxied = statistics.median(await round_trips(port_of(proxy)))
    proxy.close()
    echo.close()
    return proxied - direct


@pytest.mark.parametrize("delay_ms", [5, 15])
def test_proxy_adds_configured_delay_each_way(delay_ms):
    added = asyncio.run(measure_added_rtt(delay_ms))
    assert 2 * delay_ms / 1e3 * 0.95 <= added <= 2 * delay_ms / 1e3 + 0.015, added


def test_bandwidth_cap_limits_throughput():
    async def go():
        echo = await echo_server()
        proxy = await start_proxy(("127.0.0.1", 0), ("127.0.0.1", port_of(echo)), bandwidth_mbps=40)
        payload = b"y" * 500_000  # 4 Mbit: 0.1 s each way at 40 Mbit/s
        reader, writer = await asyncio.open_connection("127.0.0.1", port_of(proxy))
        start = time.perf_counter()
        writer.write(payload)
        await reader.readexactly(len(payload))
        elapsed = time.perf_counter() - start
        writer.close()
        proxy.close()
        echo.close()
        return elapsed

    elapsed = asyncio.run(go())
    assert elapsed >= 0.1, elapsed  # at least one direction's worth of serialisation


def test_link_keeps_order_under_jitter():
    import random

    link = Link(delay_s=0.01, jitter_s=0.009, bandwidth_bps=None, rng=random.Random(0))
    arrivals = [link.arrival_time(now=i * 0.0001, size=100) for i in range(200)]
    assert arrivals == sorted(arrivals)


def test_bad_arguments():
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_address("localhost")
    with pytest.raises(ValueError, match="delay"):
        asyncio.run(start_proxy(("127.0.0.1", 0), ("127.0.0.1", 1), delay_ms=-1))
