"""A lower tier's CPU and I/O work (copies, checksums, disk reads and writes) on its own
threads, never on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class Offload:
    def __init__(self, name: str = "l2", threads: int = 2) -> None:
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)

    async def run(self, work: Callable[[], T], if_abandoned: Callable[[], None]) -> T:
        """`work()` on a thread. If the caller is cancelled meanwhile, `if_abandoned()` runs
        on the loop once the thread is done with it: the work may be using pool memory
        that the caller would otherwise give back too early."""
        future = asyncio.get_running_loop().run_in_executor(self._executor, work)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda _: if_abandoned())
            raise

    async def close(self) -> None:
        """Wait for running work (its if_abandoned callbacks run before this returns)."""
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
        await asyncio.sleep(0)  # the done callbacks are scheduled by then: let them run
        await asyncio.sleep(0)
