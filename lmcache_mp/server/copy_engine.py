"""The copy engine: block copies on a thread pool, so the event loop never waits on memory."""

from __future__ import annotations

import asyncio
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


def _run_group(jobs: Sequence[CopyJob], deadline: float | None) -> list[BaseException | None]:
    errors: list[BaseException | None] = []
    for job in jobs:
        late = expired(deadline)
        if late is not None:
            errors.append(late)
            continue
        try:
            job()
            errors.append(None)
        except Exception as exc:  # one bad chunk must not fail its neighbours
            errors.append(exc)
    return errors


class CopyEngine:
    """Runs copy jobs on `threads` threads; torch releases the GIL inside each copy."""

    def __init__(self, threads: int):
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmcache-copy")

    async def run(self, jobs: Sequence[CopyJob], deadline: float | None = None
                  ) -> list[BaseException | None]:
        """Run every job; return, in order, None for a job that finished or what it raised.
        A job not started by `deadline` (time.monotonic()) is not run: DeadlinePassed."""
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        groups = min(self.threads, len(jobs))
        bounds = [len(jobs) * g // groups for g in range(groups + 1)]
        futures = [loop.run_in_executor(self._executor, _run_group, jobs[lo:hi], deadline)
                   for lo, hi in zip(bounds, bounds[1:])]
        results = await asyncio.gather(*futures)
        return [error for group in results for error in group]

    def shutdown(self) -> None:
        """Wait for copies already running: they write into memory about to be released."""
        self._executor.shutdown(wait=True, cancel_futures=True)
