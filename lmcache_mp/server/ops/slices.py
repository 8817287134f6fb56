"""Long requests a slice at a time: one slice per turn of the event loop, round-robin.

Every slice in the queue waits behind at most one slice of each other request, and the
loop polls its sockets between turns, so a request's work can delay another client's
reply by one slice, never by the whole request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class SliceRunner:
    """Runs `step()` callables on the loop thread, one call per turn, in turn."""

    def __init__(self) -> None:
        self._queue: deque[tuple[Callable[[], bool], asyncio.Future]] = deque()
        self._scheduled = False

    async def run(self, step: Callable[[], bool]) -> None:
        """Call `step()` once per turn until it returns True (done); raises what it raises.
        Cancelling the awaiting task stops the calls."""
        future = asyncio.get_running_loop().create_future()
        self._queue.append((step, future))
        self._schedule()
        await future

    def _schedule(self) -> None:
        if not self._scheduled and self._queue:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        self._scheduled = False
        step, future = self._queue.popleft()
        if not future.done():  # a cancelled waiter wants no more slices
            try:
                done = step()
            except Exception as exc:
                future.set_exception(exc)
            else:
                if done:
                    future.set_result(None)
                else:
                    self._queue.append((step, future))
        self._schedule()
