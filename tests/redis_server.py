"""The tests' redis-server (see :mod:`specdec.tools.local_redis`)."""

from specdec.tools.local_redis import RedisServer, free_port, redis_server_binary

__all__ = ["RedisServer", "free_port", "redis_server_binary"]
