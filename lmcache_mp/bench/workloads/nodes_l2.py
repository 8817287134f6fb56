"""The L2 stores of a `--nodes` run: each started here in turn (or the one --l2 names), and
each store's GB/s writing and reading back W1 and W2 values through the server's own L2
backend, against a single-thread copy of the same values."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from ...server.l2.base import L2, DirectL2, PoolRegion, PoolValue
from ...server.l2.codec import CrcFormat
from ...server.l2.tier import open_backend
from ...sizes import parse_size
from ..harness.bounds import CopyBound
from ..harness.l2_stores import BACKENDS, MooncakeStore, unavailable
from ..harness.redis_peer import RedisServer
from ..harness.stats import GB, rate
from ..options import BenchOptions, backend_names
from ..shapes import SHAPES
from .nodes_report import L2Rate

T = TypeVar("T")

RATE_SHAPES = ("W1", "W2")
WINDOW_BYTES = 64 << 20  # values per put or get: a write-behind batch, a prefetch window
RATE_TTL_S = 600  # what a run that dies leaves in a Redis goes away by itself
NODE_SEGMENT = "1GiB"  # what each node lends a Mooncake Store of our own: the run's chunks
MOONCAKE_BUFFER = "96MiB"  # a node's staging buffer: a window of values and their headers


@dataclass
class L2Store:
    """One store the nodes share: `url` is their --l2; `kill_master` kills a Mooncake
    master of our own (None for the others)."""

    name: str  # redis, valkey, mooncake, or "given" (--l2)
    url: str
    spawned: bool
    rate_url: str  # the bench's own client's, for the GB/s (a Mooncake one lends room)
    kill_master: Callable[[], None] | None = None


def chosen_stores(options: BenchOptions) -> tuple[list[str], dict[str, str]]:
    """The stores to run on, in order, and those skipped with the reason: --l2-backends'
    (resolve() checked they can run), else every one whose programs are installed."""
    if options.l2 is not None:
        return ["given"], {}
    if options.l2_backends is not None:
        return list(backend_names(options.l2_backends)), {}
    skipped = {name: reason for name in BACKENDS if (reason := unavailable(name)) is not None}
    return [name for name in BACKENDS if name not in skipped], skipped


def start_store(stack: contextlib.ExitStack, name: str, options: BenchOptions,
                log: Callable[[str], None]) -> L2Store:
    """Store `name` started here (or --l2's), stopped by `stack`."""
    if options.l2 is not None:
        return L2Store(name, options.l2, False, options.l2)
    if name != "mooncake":
        server = RedisServer(f"{name}-server")
        stack.callback(server.stop)
        server.start()
        log(f"{name}-server {server.version()} on {server.url}")
        return L2Store(name, server.url, True, server.url)
    # Every client of it (this process's, the nodes') advertises loopback, not eth0.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    directory = stack.enter_context(tempfile.TemporaryDirectory(
        prefix="lmcache-mp-bench-mooncake-"))
    store = MooncakeStore(directory)
    stack.callback(store.stop)
    store.start()
    log(f"mooncake_master on 127.0.0.1:{store.master_port}")
    rate_segment = max(2 * parse_size(options.l2_rate_size), 64 << 20)
    return L2Store(name, store.url(NODE_SEGMENT, MOONCAKE_BUFFER), True,
                   store.url(str(rate_segment), MOONCAKE_BUFFER), store.kill_master)


def measure_rates(store: L2Store, options: BenchOptions, run_id: str,
                  log: Callable[[str], None]) -> list[L2Rate]:
    """The store's write and read GB/s for each of RATE_SHAPES' values (header and chunk),
    --l2-rate-size of them each way, through the server's own backend, a window at a time;
    each value read back is compared byte for byte, and the keys are removed after."""
    rates = []
    for shape in RATE_SHAPES:
        value_bytes = SHAPES[shape].chunk_bytes + CrcFormat.header.size
        count = max(1, parse_size(options.l2_rate_size) // value_bytes)
        keys = [f"lmcache-mp-bench:{run_id}:rate:{shape}:{i}".encode() for i in range(count)]
        source = secrets.token_bytes(value_bytes + 8 * count)
        values = [source[8 * i:8 * i + value_bytes] for i in range(count)]  # each different
        figures = asyncio.run(_timed(store.rate_url, keys, values, options.timeout))
        copy = CopyBound(value_bytes)
        rates.append(L2Rate(store.name, shape, value_bytes, count, *figures, copy.gbs))
        log(f"{store.name} {shape}: write {rates[-1].write_gb_per_s:.2f} GB/s, read "
            f"{rates[-1].read_gb_per_s:.2f} GB/s ({count} values of {value_bytes} B)")
    return rates


async def _timed(url: str, keys: Sequence[bytes], values: Sequence[bytes], timeout: float
                 ) -> tuple[float, float, int, int]:
    """(write GB/s, read GB/s, values read back whole, values read back with other bytes).
    A direct backend (Mooncake) moves them as the server does: each value's payload from and
    into a pool of the bench's own (registered once), its header beside it."""
    pool = _Pool(values)
    backend = open_backend(url, None, timeout, pool.region)
    per_window = max(1, WINDOW_BYTES // len(values[0]))
    windows = [slice(first, first + per_window) for first in range(0, len(keys), per_window)]
    total = sum(len(value) for value in values)
    try:
        started = time.perf_counter()
        for window in windows:
            await _bounded(pool.put(backend, keys, values, window), timeout)
        write_s = time.perf_counter() - started
        read_back = mismatched = 0
        started = time.perf_counter()
        for window in windows:
            same = await _bounded(pool.get(backend, keys, values, window), timeout)
            read_back += same.count(True)
            mismatched += same.count(False)
        read_s = time.perf_counter() - started
        await _bounded(_delete(backend, keys, per_window), timeout)
    finally:
        await backend.close()
    return rate(total, write_s) / GB, rate(total, read_s) / GB, read_back, mismatched


class _Pool:
    """The values' payloads side by side, as a server's pool holds chunks (filled before the
    clock starts), then room as large for what a direct get reads back."""

    def __init__(self, values: Sequence[bytes]):
        self.header = CrcFormat.header.size
        self.size = len(values[0]) - self.header
        self.array = np.zeros(2 * self.size * len(values), dtype=np.uint8)
        for i, value in enumerate(values):
            self.array[i * self.size:(i + 1) * self.size] = np.frombuffer(
                value, dtype=np.uint8, offset=self.header)
        self.array[self.array.nbytes // 2:] = 1  # its pages in memory, as a server's pool
        self.region = PoolRegion(self.array.ctypes.data, self.array.nbytes)

    def _values(self, keys: Sequence[bytes], values: Sequence[bytes], window: slice,
                base: int) -> list[PoolValue]:
        return [PoolValue(keys[i], bytearray(values[i][:self.header]),
                          self.region.address + base + i * self.size, self.size)
                for i in range(*window.indices(len(keys)))]

    async def put(self, backend: L2, keys: Sequence[bytes], values: Sequence[bytes],
                  window: slice) -> None:
        if not isinstance(backend, DirectL2):
            return await backend.put(list(zip(keys[window], values[window])), RATE_TTL_S)
        await backend.put_from(self._values(keys, values, window, 0))

    async def get(self, backend: L2, keys: Sequence[bytes], values: Sequence[bytes],
                  window: slice) -> list[bool | None]:
        """Per value of the window: None (not read back), True (read back whole, byte for
        byte), False (read back with other bytes)."""
        if not isinstance(backend, DirectL2):
            got = await backend.get(keys[window])
            return [None if value is None else value == expected
                    for value, expected in zip(got, values[window])]
        into = self._values(keys, values, window, self.array.nbytes // 2)
        for value in into:
            value.header[:] = bytes(self.header)
        whole = await backend.get_into(into)
        return [self._same(value, expected) if ok else None
                for value, expected, ok in zip(into, values[window], whole)]

    def _same(self, value: PoolValue, expected: bytes) -> bool:
        start = value.address - self.region.address
        return value.header == expected[:self.header] and np.array_equal(
            self.array[start:start + self.size],
            np.frombuffer(expected, dtype=np.uint8, offset=self.header))


async def _delete(backend: L2, keys: Sequence[bytes], per_window: int) -> None:
    for first in range(0, len(keys), per_window):
        await backend.delete(keys[first:first + per_window])


async def _bounded(operation: Awaitable[T], timeout: float) -> T:
    """`operation`, or TimeoutError after `timeout` seconds: a store that hangs ends the run."""
    return await asyncio.wait_for(operation, timeout)
