"""The copy engine: block copies on a thread pool, so the event loop never waits on memory."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from ...errors import ServerCondition

CopyJob = Callable[[], object]  # what it returns is dropped


class DeadlinePassed(ServerCondition):
    """A copy that was not started: its request's deadline had passed (the client may
    already use the memory it names)."""


def expired(deadline: float | None) -> DeadlinePassed | None:
    """DeadlinePassed if `deadline` (time.monotonic(); None: none) has passed, else None."""
    if deadline is not None and time.monotonic() >= deadline:
        return DeadlinePassed("not started: the request's budget_ms ran out")
    return None


def attempt(job: CopyJob) -> BaseException | None:
    """Run the job; None, or what it raised (one bad chunk must not fail its neighbours)."""
    try:
        job()
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


class CopyEngine:
    """Runs copy jobs on `threads` threads; numpy and torch release the GIL inside each copy."""

    def __init__(self, threads: int):
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmcache-copy")

    async def run(self, jobs: Sequence[CopyJob], deadline: float | None = None,
                  threads: int | None = None) -> list[BaseException | None]:
        """Run every job, on at most `threads` of the engine's threads (None: all; one runs
        them in order); return, in order, None for a job that finished or what it raised.
        A job not started by `deadline` (time.monotonic()) is not run: DeadlinePassed."""
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        outcomes: list[BaseException | None] = [None] * len(jobs)
        # Each thread takes the next job not taken (next() on a count is atomic under the
        # GIL) rather than a fixed share: the OS may queue two copy threads on one CPU
        # while another idles, and then a fixed share waits for the thread ahead of it
        # (half of W2's requests copied one share after the other on 2 CPUs).
        taken = itertools.count()

        def take_jobs() -> None:
            for index in taken:
                if index >= len(jobs):
                    return
                outcomes[index] = expired(deadline) or attempt(jobs[index])
        await asyncio.gather(*[loop.run_in_executor(self._executor, take_jobs)
                               for _ in range(min(threads or self.threads, self.threads,
                                                  len(jobs)))])
        return outcomes

    def shutdown(self) -> None:
        """Wait for copies already running: they write into memory about to be released."""
        self._executor.shutdown(wait=True, cancel_futures=True)

