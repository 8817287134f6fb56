"""Full garbage collections kept short as the store grows: what a long one found alive is frozen.

Every stored chunk is a few objects the collector tracks (the chunk, its key, the set of
stored chunks after it), and a full collection walks every tracked object with the event
loop stopped (from whichever thread it runs in, it holds the GIL): on a 2-core machine
~40 ms at 50,000 stored chunks, ~210 ms at 200,000, and it grows with the pool. One is
due after ten collections of the middle generation (~70,000 container allocations with
Python's default thresholds) once the long-lived objects have grown by a quarter. Once a
full collection has taken longer than `freeze_after_s`, everything it found alive moves
to the permanent generation (gc.freeze()), which collections skip: each one after it
walks only what came since. A server storing 576,000 chunks (9,000 STOREs of 64, one
client): its full collections grew from 15 to 438 ms without, stayed at 11-21 ms with.

The price: an object frozen while alive that later dies in a reference cycle is never
reclaimed. The store breaks its own cycles (a chunk and the chunks after it) when it
drops a chunk, and an unregistered cache's mappings are closed explicitly, so what could
stay this way is what was in flight at a freeze that then died in a cycle: a few objects
of a request, at most, per freeze.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

FREEZE_AFTER_S = 0.005
_OLDEST = 2  # the generation a full collection collects


class CollectorGuard:
    """Freezes what a full collection longer than `freeze_after_s` found alive."""

    def __init__(self, freeze_after_s: float = FREEZE_AFTER_S,
                 clock: Callable[[], float] = time.perf_counter):
        self.freeze_after_s = freeze_after_s
        self.clock = clock
        self.freezes = 0
        self._started: float | None = None

    def install(self) -> None:
        gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != _OLDEST:
            return
        if phase == "start":
            self._started = self.clock()
            return
        if self._started is None:  # installed during a collection
            return
        took, self._started = self.clock() - self._started, None
        if took <= self.freeze_after_s:
            return
        gc.freeze()
        self.freezes += 1
        (logger.info if self.freezes == 1 else logger.debug)(
            "a full garbage collection took %.1f ms with the loop stopped: the %d objects "
            "alive now are frozen out of later collections (freeze %d)", took * 1000,
            gc.get_freeze_count(), self.freezes)
