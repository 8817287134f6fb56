"""The L2 backend on a Mooncake Store, through its Python client, on threads of its own.

URL: `mooncake://MASTER_HOST:PORT?local=HOST&metadata=URL&...` (urls.py, docs/l2.md). The
client's calls block (a master that is down holds each one about 4.3 s before it fails),
so they run on this backend's threads, never on the event loop: the tier's timeout
(--l2-timeout) ends the caller's wait, and a call still blocked on a thread holds that
thread alone. The client connects on the first call, and again after a failed connect;
its setup() holds the GIL while it retries a master it cannot reach (20 tries, about 90 s,
the whole server stalled), so it is called only once the master accepts a connection.

Zero-copy: the setup registers the server's CPU pool with the transfer engine, once, and
a direct put or get (put_from, get_into) moves each value as two buffers, its header (a
small registered area of the call's own) and its payload (the pool extent), in one
batch_put_from_multi_buffers / batch_get_into_multi_buffers: the value in the store is
the header and the chunk, byte for byte what a copy put writes. put / get (the sealed
value as bytes, put_batch / get_batch) serve chunks outside the CPU pool (the GPU tier).
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from .base import DirectL2, L2Error, L2Refused, PoolRegion, PoolValue
from .urls import MooncakeUrl, parse_mooncake_url

T = TypeVar("T")

THREADS = 4  # prefetch and write-behind at once, with room for calls stalled on a master
PROBE_TIMEOUT_S = 1.0
NO_ROOM = -200  # NO_AVAILABLE_HANDLE: the pool is full of values it may not evict yet
NOT_FOUND = -704  # OBJECT_NOT_FOUND: removing a key that is gone is no error


class MooncakeL2(DirectL2):
    """One MooncakeDistributedStore client, set up on first use, shared by every call; its
    direct puts and gets move payloads straight from and into `pool`."""

    def __init__(self, url: str, pool: PoolRegion):
        self.url: MooncakeUrl = parse_mooncake_url(url)
        self.pool = pool
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
                status = store.register_buffer(self.pool.address, self.pool.size)
                if status != 0:
                    store.close()
                    raise L2Error(f"registering the pool failed ({status})")
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

    def _start(self, work: Callable[[Any], T]) -> asyncio.Future[T]:
        """`work` on a backend thread, started now, whether or not anyone awaits it."""
        return asyncio.wrap_future(self._executor.submit(lambda: work(self._client())),
                                   loop=asyncio.get_running_loop())

    def put_from(self, values: Sequence[PoolValue]) -> asyncio.Future[None]:
        def put(store: Any) -> None:
            with _HeaderArea(store, values) as area:
                area.fill()
                statuses = store.batch_put_from_multi_buffers(names, area.buffers(),
                                                              area.sizes())
            area.check_answered(statuses, "batch_put_from_multi_buffers", "statuses")
            if NO_ROOM in statuses:
                raise L2Refused("the pool has no room: values not kept")
            failed = [status for status in statuses if status != 0]
            if failed:
                raise L2Error(f"batch_put_from_multi_buffers failed ({failed[0]})")
        names = _names([value.key for value in values])
        return self._start(put)

    def get_into(self, values: Sequence[PoolValue]) -> asyncio.Future[list[bool]]:
        def get(store: Any) -> list[bool]:
            with _HeaderArea(store, values) as area:
                # Per key, the bytes read, or an error: no value (-704), a value of another
                # size (-600, -800), a failed transfer. Each is that key's miss alone.
                got = store.batch_get_into_multi_buffers(names, area.buffers(), area.sizes())
                area.check_answered(got, "batch_get_into_multi_buffers", "sizes")
                area.empty()
            return [size == len(value.header) + value.size for size, value in zip(got, values)]
        names = _names([value.key for value in values])
        return self._start(get)

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


class _HeaderArea:
    """The headers of one direct call's values, side by side in memory registered with
    the transfer engine for that call (RDMA moves only registered memory); a backend
    thread's, for the call's length."""

    def __init__(self, store: Any, values: Sequence[PoolValue]):
        self.store = store
        self.values = values
        self.slot = len(values[0].header) if values else 0
        self.array = np.zeros(max(1, self.slot * len(values)), dtype=np.uint8)
        self.address = self.array.ctypes.data

    def __enter__(self) -> _HeaderArea:
        status = self.store.register_buffer(self.address, self.array.nbytes)
        if status != 0:
            raise L2Error(f"registering the headers' buffer failed ({status})")
        return self

    def __exit__(self, *_: object) -> None:
        self.store.unregister_buffer(self.address)

    def buffers(self) -> list[list[int]]:
        """Each value's two buffers: its header slot here, its payload in the pool."""
        return [[self.address + i * self.slot, value.address]
                for i, value in enumerate(self.values)]

    def sizes(self) -> list[list[int]]:
        """Each value's two buffers' sizes, as buffers() names them."""
        return [[len(value.header), value.size] for value in self.values]

    def check_answered(self, answers: Sequence[object], call: str, what: str) -> None:
        """L2Error unless the transfer engine's `call` answered one of `what` a value."""
        if len(answers) != len(self.values):
            raise L2Error(f"{call} answered {len(answers)} {what} for {len(self.values)} "
                          f"values")

    def fill(self) -> None:
        """The values' headers into their slots (before a put)."""
        for i, value in enumerate(self.values):
            self.array[i * self.slot:(i + 1) * self.slot] = np.frombuffer(value.header,
                                                                         dtype=np.uint8)

    def empty(self) -> None:
        """The slots into the values' headers (after a get)."""
        for i, value in enumerate(self.values):
            value.header[:] = self.array[i * self.slot:(i + 1) * self.slot].tobytes()


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
