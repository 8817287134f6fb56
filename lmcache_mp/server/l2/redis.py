"""The L2 backend on Redis or Valkey, standalone or cluster, through redis-py's asyncio client.

URLs: `redis://[user:password@]host:port[/db]`, `rediss://...` for TLS, and
`redis+cluster://[user:password@]host:port,host:port,...` (or `rediss+cluster://`) for a
cluster, named by any of its nodes (seed nodes; the client learns the rest).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from .base import L2, L2Error
from .urls import check_url, parse_cluster_url


class RedisL2(L2):
    """One client (a connection pool, or a cluster client) shared by every L2 operation."""

    def __init__(self, url: str, password: str | None, timeout_s: float):
        """`password` (from --l2-password-file) overrides the URL's; `timeout_s` bounds
        connecting and each reply; redis-py does not retry: the tier backs off instead."""
        check_url(url)
        options: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                       retry=Retry(NoBackoff(), 0))
        if password is not None:
            options["password"] = password
        self._cluster = "+cluster://" in url
        if self._cluster:
            nodes, username, url_password, tls = parse_cluster_url(url)
            options.setdefault("password", url_password)
            self._client: Any = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in nodes],
                username=username, ssl=tls, **options)
            self._where = f"{url.partition('://')[0]}://{','.join(f'{h}:{p}' for h, p in nodes)}"
        else:
            self._client = aioredis.Redis.from_url(url, **options)
            parts = urlsplit(url)
            self._where = f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path}"

    def describe(self) -> str:
        return self._where

    async def _pipelined(self, build) -> list[Any]:
        pipe = self._client.pipeline() if self._cluster else self._client.pipeline(
            transaction=False)
        try:
            async with pipe:
                build(pipe)
                return await pipe.execute()
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise L2Error(f"{type(exc).__name__}: {exc}") from exc

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        def build(pipe) -> None:
            for key in keys:
                pipe.exists(key)
        return [bool(n) for n in await self._pipelined(build)]

    async def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        def build(pipe) -> None:
            for key in keys:
                pipe.get(key)
        return await self._pipelined(build)

    async def put(self, items: Sequence[tuple[bytes, bytes | memoryview]], ttl_s: int) -> None:
        if not items:
            return
        def build(pipe) -> None:
            for key, value in items:
                pipe.set(key, value, ex=ttl_s)
        await self._pipelined(build)

    async def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        def build(pipe) -> None:
            for key in keys:
                # Not pipe.unlink(): redis-py's async cluster pipeline takes it for its
                # multi-key coroutine, which is never awaited there (nothing is deleted).
                pipe.execute_command("UNLINK", key)
        await self._pipelined(build)

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except (RedisError, OSError) as exc:
            raise L2Error(f"{type(exc).__name__}: {exc}") from exc
