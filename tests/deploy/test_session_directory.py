"""The bundled Redis, the coordinators' session directory: what its manifest
promises (an append-only file on a claimed volume, idle sessions evicted
before writes are refused), checked on the rendered objects and then kept by a
local redis-server started with the container's own arguments, written to by
the coordinator's own directory code with the coordinator's own settings."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib

import pytest
import redis
from redis_server import RedisServer

from specdec.coordinator.directory import SessionRecord, TurnRecord
from specdec.coordinator.redis_directory import RedisDirectory, session_keys
from specdec.serving import errors

import kube
from service_harness import on_a_loop


def test_redis_appends_every_write_to_a_file_on_a_volume_of_its_own(objects):
    workload, container = kube.redis_pod(objects)
    opts = kube.redis_options(container)
    assert opts["appendonly"] == "yes" and opts["appendfsync"] == "everysec", opts
    (claim,) = workload["spec"]["volumeClaimTemplates"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == claim["metadata"]["name"]]
    assert mount["mountPath"] == opts["dir"] and not mount.get("readOnly")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and workload["spec"]["replicas"] == 1
    # the file: the last rewrite, the writes since (a rewrite at twice its size) and a rewrite in progress
    size = kube.quantity(claim["spec"]["resources"]["requests"]["storage"]) / 2**20
    assert size >= 3 * kube.redis_megabytes(opts["maxmemory"]), f"{size} MiB for {opts['maxmemory']} of data"
    # the coordinators reach it through its Service
    coordinator = kube.by_role(objects)["coordinator"].config()
    (address,) = kube.addresses(coordinator.redis)
    reached, _, port = kube.service_backend(objects, kube.service_host(objects, address["host"]), int(address["port"]))
    assert reached is workload and port == kube.container_port(container, "redis")


def test_redis_evicts_idle_sessions_within_its_memory_limit(objects):
    _, container = kube.redis_pod(objects)
    opts = kube.redis_options(container)
    # every key the coordinator writes has a TTL (below): evict the least recently used
    # of them, never refuse writes (noeviction), never the leases first (volatile-ttl)
    assert opts["maxmemory-policy"] == "volatile-lru", opts
    limit = kube.quantity(container["resources"]["limits"]["memory"]) / 2**20
    # room beside the data for the AOF rewrite's copy-on-write pages and the buffers
    assert kube.redis_megabytes(opts["maxmemory"]) <= 0.7 * limit, f"maxmemory {opts['maxmemory']} in {limit:.0f} MiB"


# ---------------------------------------------------------------- a local redis-server as the manifest runs it



@pytest.fixture(scope="module")
def cpu():
    return kube.render(kube.OVERLAYS["cpu"])


@contextlib.contextmanager
def manifest_redis(objects, tmp_path: pathlib.Path, **changed: str):
    """redis-server with the container's arguments, its data in ``tmp_path/data``."""
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    server = RedisServer(tmp_path / "redis", args=kube.redis_args(objects, data, **changed)).start()
    try:
        yield server
    finally:
        server.stop()


def directory(objects, server: RedisServer, refusals_fail_at_once: bool = False) -> RedisDirectory:
    """The directory a coordinator of ``objects`` keeps in ``server``, with its
    settings; ``refusals_fail_at_once``: a write Redis refuses fails within a
    second instead of riding it out for the lease and --directory-outage."""
    config = kube.by_role(objects)["coordinator"].config()
    if refusals_fail_at_once:
        return RedisDirectory(server.url, ttl_s=config.redis_ttl_s, lease_s=1.0, outage_s=0.0)
    return RedisDirectory(server.url, ttl_s=config.redis_ttl_s, lease_s=config.lease_s,
                          outage_s=config.directory_outage_s)


def record(session_id: str, tokens: int = 8) -> SessionRecord:
    made = SessionRecord(session_id, tokens=list(range(1000, 1000 + tokens)), service_session_id=f"{session_id}~x")
    made.turn = TurnRecord(1, [5], 10, {"temperature": 0.0, "seed": 7}, deltas=[[[7], "a"]], turn_id="t")
    return made


async def write(d: RedisDirectory, session_id: str, tokens: int = 8) -> None:
    async with d.hold(session_id) as lease:
        await d.put(record(session_id, tokens), lease)


@on_a_loop
async def test_every_key_the_coordinator_writes_expires_so_volatile_lru_may_evict_it(cpu, tmp_path):
    """volatile-* evicts only keys with a TTL: those the coordinator writes,
    the lease and the fencing counter included, all have one."""
    with manifest_redis(cpu, tmp_path) as server:
        d = directory(cpu, server)
        raw = redis.Redis.from_url(server.url)
        try:
            async with d.hold("chat") as lease:
                held = record("chat")
                await d.put(held, lease)
                held.turn.deltas.append([[8], "b"])
                await d.add_delta(held, lease)
                keys = raw.keys("*")
                assert {k.decode() for k in keys} == set(session_keys("chat").values())  # the lease while held
                assert all(raw.pttl(k) > 0 for k in keys), {k: raw.pttl(k) for k in keys}
        finally:
            await d.close()
        assert all(raw.pttl(k) > 0 for k in raw.keys("*"))


@on_a_loop
async def test_sessions_outlive_a_crash_of_redis(cpu, tmp_path):
    """The append-only file on the volume: Redis killed (SIGKILL) and started
    again on the same directory still holds the session."""
    with manifest_redis(cpu, tmp_path) as server:
        d = directory(cpu, server)
        try:
            async with d.hold("chat") as lease:
                held = record("chat", tokens=300)
                await d.put(held, lease)
                held.turn.deltas.append([[8, 9], "bc"])
                await d.add_delta(held, lease)
            server.stop()  # SIGKILL: no shutdown, no last write
            server.start()
            kept = await d.get("chat")
        finally:
            await d.close()
    assert kept is not None, "the session did not outlive the restart"
    assert kept.tokens == held.tokens and kept.turn.generated == [7, 8, 9]


@pytest.mark.parametrize("policy", ["manifest", "noeviction"])
@on_a_loop
async def test_at_maxmemory_idle_sessions_go_and_new_ones_are_written(cpu, tmp_path, policy):
    """Past maxmemory (8 MB here) Redis makes room: the manifest's policy evicts
    the sessions idle longest and the coordinators go on writing; noeviction
    would refuse every write with OOM, an UNAVAILABLE for each new turn."""
    changed = {"maxmemory": "8mb"} | ({"maxmemory_policy": policy} if policy != "manifest" else {})
    with manifest_redis(cpu, tmp_path, **changed) as server:
        d = directory(cpu, server, refusals_fail_at_once=policy == "noeviction")
        try:
            for i in range(350):  # about 6 MB of histories, then left idle
                await write(d, f"idle-{i}", tokens=3000)
            await asyncio.sleep(1.5)  # Redis's LRU clock counts seconds
            if policy == "noeviction":
                with pytest.raises(errors.Unavailable, match="OOM"):
                    for i in range(150):
                        await write(d, f"active-{i}", tokens=3000)
                return
            for i in range(150):  # every write goes through, each under its lease
                await write(d, f"active-{i}", tokens=3000)
            active = [await d.get(f"active-{i}") for i in range(150)]
            idle = [await d.get(f"idle-{i}") for i in range(350)]
        finally:
            await d.close()
    assert all(r is not None and r.turn is not None and r.turn.generated == [7] for r in active)
    forgotten = sum(r is None for r in idle)
    assert 0 < forgotten < 350, f"{forgotten} idle sessions evicted"
