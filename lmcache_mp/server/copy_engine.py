"""The copy engine: block copies on a thread pool, so the event loop never waits on memory."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

CopyJob = Callable[[], None]


def _run_group(jobs: Sequence[CopyJob]) -> list[BaseException | None]:
    errors: list[BaseException | None] = []
    for job in jobs:
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

    async def run(self, jobs: Sequence[CopyJob]) -> list[BaseException | None]:
        """Run every job; return, in order, None for a job that finished or what it raised."""
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        groups = min(self.threads, len(jobs))
        bounds = [len(jobs) * g // groups for g in range(groups + 1)]
        futures = [loop.run_in_executor(self._executor, _run_group, jobs[lo:hi])
                   for lo, hi in zip(bounds, bounds[1:])]
        results = await asyncio.gather(*futures)
        return [error for group in results for error in group]

    def shutdown(self) -> None:
        """Wait for copies already running: they write into memory about to be released."""
        self._executor.shutdown(wait=True, cancel_futures=True)
