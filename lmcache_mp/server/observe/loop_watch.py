"""The loop's heartbeat: when it last turned (for /healthz) and how late it woke (loop lag)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .metrics import ServerMetrics

BEAT_S = 0.1


class LoopWatch:
    """A task on the loop stamps the time every BEAT_S; any thread may read the stamp."""

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic):
        self.metrics = metrics
        self.clock = clock
        self.last_turn = clock()

    async def run(self) -> None:
        self.last_turn = self.clock()  # start-up (CUDA, the pool) may have taken a while
        while True:
            due = self.clock() + BEAT_S
            await asyncio.sleep(BEAT_S)
            now = self.clock()
            self.metrics.loop_lag = max(0.0, now - due)
            self.last_turn = now  # one float store: safe to read from the HTTP thread

    def stalled_for(self) -> float:
        """Seconds since the loop last turned (about BEAT_S while it is well)."""
        return self.clock() - self.last_turn
