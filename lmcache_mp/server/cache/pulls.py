"""Pulls from a lower tier that LOOKUPs wait for: one per run of a prompt, shared, bounded.

A LOOKUP that misses in memory starts a pull of the rest of each prompt from a lower tier
(the disk tier's read-back, L2's prefetch); two LOOKUPs of the same run share one pull,
at most `limit` run at once (a LOOKUP beyond it answers from memory alone), and a LOOKUP
waits for its pulls at most `wait_s` before it answers with what has landed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from functools import partial
from typing import Any


class Pulls:
    def __init__(self, limit: int, wait_s: float, on_timeout: Callable[[], None]):
        """`on_timeout()`: a LOOKUP stopped waiting before its pulls were done."""
        self.limit = limit
        self.wait_s = wait_s
        self.on_timeout = on_timeout
        self._running: dict[tuple, asyncio.Task] = {}

    def running(self, ident: tuple) -> asyncio.Task | None:
        """The pull of the run `ident` names, if one is under way."""
        return self._running.get(ident)

    def start(self, ident: tuple, pull: Coroutine[Any, Any, None]) -> asyncio.Task | None:
        """Run `pull` for the run `ident` names; None (and `pull` never run) at the limit."""
        if len(self._running) >= self.limit:
            pull.close()
            return None
        task = self._running[ident] = asyncio.ensure_future(pull)
        task.add_done_callback(partial(self._forget, ident))
        return task

    def _forget(self, ident: tuple, _done: asyncio.Future) -> None:
        self._running.pop(ident, None)

    def wait(self, pulls: Sequence[asyncio.Future]) -> Awaitable[None] | None:
        """What a LOOKUP awaits for `pulls` (None: nothing to wait for)."""
        return self._wait(pulls) if pulls and self.wait_s > 0 else None

    async def _wait(self, pulls: Sequence[asyncio.Future]) -> None:
        _, pending = await asyncio.wait(pulls, timeout=self.wait_s)
        if pending:
            self.on_timeout()

    async def close(self) -> None:
        """Cancel every pull and wait until each has let go of what it holds."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
