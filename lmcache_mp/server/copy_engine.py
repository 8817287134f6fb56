"""The copy engine: block copies on a thread pool, so the event loop never waits on memory."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

CopyJob = Callable[[], None]


class DeadlinePassed(Exception):
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
                  on_settled: Callable[[int], None] | None = None,
                  threads: int | None = None) -> list[BaseException | None]:
        """Run every job, on at most `threads` of the engine's threads (None: all); return,
        in order, None for a job that finished or what it raised. A job not started by
        `deadline` (time.monotonic()) is not run: DeadlinePassed. `on_settled(n)`, called on
        a copy thread each time it grows, says that the first n jobs have settled
        (finished, failed or not to be run): keep it short."""
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        outcomes: list[BaseException | None] = [None] * len(jobs)
        settle = _SettledPrefix(len(jobs), on_settled) if on_settled is not None else None
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
                if settle is not None:
                    settle.add(index)
        await asyncio.gather(*[loop.run_in_executor(self._executor, take_jobs)
                               for _ in range(min(threads or self.threads, self.threads,
                                                  len(jobs)))])
        return outcomes

    def shutdown(self) -> None:
        """Wait for copies already running: they write into memory about to be released."""
        self._executor.shutdown(wait=True, cancel_futures=True)


class _SettledPrefix:
    """How many leading jobs of a run have settled, told to `report` as it grows."""

    def __init__(self, jobs: int, report: Callable[[int], None]):
        self._settled = [False] * jobs
        self._prefix = 0
        self._report = report
        self._lock = threading.Lock()

    def add(self, index: int) -> None:
        with self._lock:  # reports go out in order, each larger than the last
            self._settled[index] = True
            prefix = self._prefix
            while prefix < len(self._settled) and self._settled[prefix]:
                prefix += 1
            if prefix > self._prefix:
                self._prefix = prefix
                self._report(prefix)
