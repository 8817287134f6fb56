"""A spawned server for a workload: its flags, ready to measure (pool faulted in, disk index
loaded), its admin client, restarts, and always stopped."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from ...client import CacheClient, Registration, SharedKVCache
from ...protocol import StatsReply
from ...server.warm.segment import segment_dir
from ...spawn import ServerProcess
from ..shapes import KVShape


def remove_segment(name: str) -> None:
    """A --pool-segment the bench named, and its snapshot, gone from the segments' directory
    (they outlive the server on purpose: a restart adopts them)."""
    for leftover in (name, f"{name}.snapshot"):
        (segment_dir() / leftover).unlink(missing_ok=True)


class BenchServer(ServerProcess):
    """`lmcache-mp-server --cpu-size POOL --log-level LEVEL [--chunk-size N] EXTRA...` on the
    ipc:// socket of a private runtime directory; `ready()` starts it and hands back an admin
    client, open until the server stops."""

    def __init__(self, pool: int | str, chunk_size: int | None = None,
                 extra: Sequence[str] = (), log_level: str = "warning"):
        args = ["--cpu-size", str(pool), "--log-level", log_level]
        if chunk_size is not None:
            args += ["--chunk-size", str(chunk_size)]
        super().__init__(None, [*args, *extra])
        self.admin: CacheClient | None = None

    def ready(self, timeout: float, client_name: str = "lmcache-mp-bench") -> CacheClient:
        """Start it; once its pool is faulted in and (with a disk tier) its disk index
        loaded, its admin client."""
        self.start(timeout)
        self.admin = self.client(admin=True, timeout=timeout, client_name=client_name)
        self.wait_prefault(self.admin, timeout)
        if "--disk-dir" in self.args:
            self.wait_stats(self.admin, lambda stats: stats.disk_loaded, "the disk index",
                            timeout)
        return self.admin

    def stats(self) -> StatsReply:
        assert self.admin is not None, "ready() first"
        return self.admin.stats()

    def restart(self, timeout: float, *args: str) -> float:
        """SIGTERM (it must exit 0), then ready() again with `args` added: the seconds from
        SIGTERM to ready."""
        started = time.monotonic()
        self.stop_cleanly(timeout)
        self.args += args
        self.ready(timeout)
        return time.monotonic() - started

    def __enter__(self) -> BenchServer:
        self.start()
        return self

    def stop(self, timeout: float = 20.0) -> int:
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        return super().stop(timeout)


def settled_stats(client: CacheClient, timeout: float) -> StatsReply:
    """STATS once write-through has written (or dropped) what was queued, or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while (stats := client.stats()).disk_queue_chunks and time.monotonic() < deadline:
        time.sleep(0.01)
    return stats


def new_cache(shape: KVShape, blocks: int) -> SharedKVCache:
    """A paged KV cache of `shape` in sealed shared memory, as an engine's rank holds one."""
    return SharedKVCache(shape.layout, shape.layers, blocks, shape.block_size, shape.heads,
                         shape.head_dim, getattr(torch, shape.dtype))


def register(client: CacheClient, cache: SharedKVCache, shape: KVShape, model: str) -> Registration:
    """Register `cache` for `model`; its registration."""
    return client.register_kv_cache(cache.handles(), model=model, layout=shape.layout,
                                    block_size=shape.block_size)
