"""A lower tier's CPU and I/O work (copies, checksums, disk reads and writes) on its own
threads, never on the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from .. import faults

T = TypeVar("T")


class Offload:
    def __init__(self, name: str = "l2", threads: int = 2) -> None:
        self.name = name
        self._executor = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self._running: set[asyncio.Future] = set()
        self._stuck = faults.chosen(f"{name}-stuck")  # a test's fault point (faults.py)

    async def run(self, work: Callable[[], T], if_abandoned: Callable[[], None]) -> T:
        """`work()` on a thread. If the caller is cancelled meanwhile, `if_abandoned()` runs
        on the loop once the thread is done with it: the work may be using pool memory
        that the caller would otherwise give back too early."""
        if self._stuck:
            work = _blocked_for_good(work)
        future = asyncio.get_running_loop().run_in_executor(self._executor, work)
        self._running.add(future)
        future.add_done_callback(self._running.discard)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            future.add_done_callback(lambda _: if_abandoned())
            raise

    async def close(self, timeout_s: float | None = None) -> bool:
        """Take no more work, and wait (at most `timeout_s`) for what runs and waits: True
        once it is done and its if_abandoned callbacks have run; False if some is still
        running then (a disk stuck in a write), left to its thread: the process must then
        exit without joining it."""
        self._executor.shutdown(wait=False)
        running = list(self._running)
        if running:
            _, still = await asyncio.wait(running, timeout=timeout_s)
            if still:
                return False
        await asyncio.sleep(0)  # the done callbacks are scheduled by then: let them run
        await asyncio.sleep(0)
        return True


def _blocked_for_good(work: Callable[[], T]) -> Callable[[], T]:
    """`work` behind a wait that never ends: the thread that takes it is stuck."""
    def blocked() -> T:
        threading.Event().wait()
        return work()
    return blocked
