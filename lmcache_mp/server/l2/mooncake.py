"""The L2 backend on a Mooncake Store, through its Python client, on threads of its own.

URL: `mooncake://MASTER_HOST:PORT?local=HOST&metadata=URL&...` (urls.py, docs/l2.md). The
client's calls block (a master that is down holds each one about 4.3 s before it fails),
so they run on this backend's threads, never on the event loop: the tier's timeout
(--l2-timeout) ends the caller's wait, and a call still blocked on a thread holds that
thread alone. The client connects on the first call, and again after a failed connect;
its setup() holds the GIL while it retries a master it cannot reach (20 tries, about 90 s,
the whole server stalled), so it is called only once the master accepts a connection.
Values go by copy (put_batch / get_batch of the sealed value, as with Redis).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from .base import L2, L2Error, L2Refused
from .urls import MooncakeUrl, parse_mooncake_url

T = TypeVar("T")

THREADS = 4  # prefetch and write-behind at once, with room for calls stalled on a master
PROBE_TIMEOUT_S = 1.0
NO_ROOM = -200  # NO_AVAILABLE_HANDLE: the pool is full of values it may not evict yet
NOT_FOUND = -704  # OBJECT_NOT_FOUND: removing a key that is gone is no error


class MooncakeL2(L2):
    """One MooncakeDistributedStore client, set up on first use, shared by every call."""

    def __init__(self, url: str):
        self.url: MooncakeUrl = parse_mooncake_url(url)
        self._executor = ThreadPoolExecutor(THREADS, thread_name_prefix="l2-mooncake")
        self._connect_lock = threading.Lock()
        self._store: Any = None

    def describe(self) -> str:
        return f"mooncake://{self.url.master} ({self.url.protocol}, lends {self.url.segment} B)"

    def _client(self) -> Any:
        """The set-up client (a worker thread); L2Error if the setup fails."""
        with self._connect_lock:
            if self._store is None:
                from mooncake.store import MooncakeDistributedStore

                url = self.url
                _probe(url.master)
                store = MooncakeDistributedStore()
                status = store.setup(url.local, url.metadata, url.segment, url.buffer,
                                     url.protocol, url.devices, url.master)
                if status != 0:
                    raise L2Error(f"setup with master {url.master} failed ({status})")
                self._store = store
            return self._store

    async def _call(self, work: Callable[[Any], T]) -> T:
        def run() -> T:
            return work(self._client())
        return await asyncio.get_running_loop().run_in_executor(self._executor, run)

    async def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        found = await self._call(lambda store: store.batch_is_exist(_names(keys)))
        if len(found) != len(keys) or any(status < 0 for status in found):
            raise L2Error(f"batch_is_exist failed ({min(found, default=None)})")
        return [status == 1 for status in found]

    async def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        # An empty value is a key the store does not hold, or one it failed to read: a miss.
        values = await self._call(lambda store: store.get_batch(_names(keys)))
        if len(values) != len(keys):
            raise L2Error(f"get_batch answered {len(values)} values for {len(keys)} keys")
        return [value or None for value in values]

    async def put(self, items: Sequence[tuple[bytes, bytes | memoryview]], ttl_s: int) -> None:
        """Mooncake has no per-key TTL (`ttl_s` is the tier's ledger's alone): the master
        evicts when its pool is full, values whose lease (10 s after a put or a read) has
        run out. A key already there keeps its first value."""
        if not items:
            return
        names = _names([key for key, _ in items])
        values = [value for _, value in items]
        status = await self._call(lambda store: store.put_batch(names, values))
        if status == NO_ROOM:
            raise L2Refused("the pool has no room: values not kept")
        if status != 0:
            raise L2Error(f"put_batch failed ({status})")

    async def delete(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        # force: a key read in the last seconds holds a lease that refuses a plain remove.
        statuses = await self._call(lambda store: store.batch_remove(_names(keys), True))
        failed = [status for status in statuses if status not in (0, NOT_FOUND)]
        if failed:
            raise L2Error(f"batch_remove failed ({failed[0]})")

    async def close(self) -> None:
        try:
            if self._store is not None:
                await asyncio.get_running_loop().run_in_executor(self._executor,
                                                                 self._store.close)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _probe(master: str) -> None:
    """Raise L2Error unless the master accepts a TCP connection (a worker thread)."""
    host, _, port = master.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise L2Error(f"master {master} is not reachable: {exc}") from None


def _names(keys: Sequence[bytes]) -> list[str]:
    """Mooncake's keys are strings; L2 keys are ASCII (codec.py)."""
    return [key.decode("ascii") for key in keys]
