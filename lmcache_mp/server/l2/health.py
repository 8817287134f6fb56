"""Whether L2 answers: every operation runs under a timeout, and a failure backs off.

While backing off, the tier does not ask L2 at all (LOOKUPs answer from L1 alone and
write-behind drops); the first operation after the back-off tries again, and its
failure doubles the wait, up to a limit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from .base import L2Counters, L2Error, L2Refused

T = TypeVar("T")

logger = logging.getLogger("lmcache_mp.server.l2")

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0


class Health:
    def __init__(self, counters: L2Counters, where: str, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.counters = counters
        self.where = where
        self.timeout_s = timeout_s
        self.clock = clock
        self._backoff_s = 0.0
        self._retry_at = 0.0

    def available(self) -> bool:
        """Whether to ask L2 now (not while backing off from a failure)."""
        return self.clock() >= self._retry_at

    async def call(self, what: str, operation: Awaitable[T]) -> T:
        """Await one L2 operation within the timeout; raise L2Error (counted, logged,
        backed off) if it fails in any way."""
        try:
            result = await asyncio.wait_for(operation, self.timeout_s)
        except L2Refused:
            raise  # the store answered: up, and the caller counts what it refused
        except L2Error as exc:
            self._failed(what, str(exc))
            raise
        except asyncio.TimeoutError:
            self._failed(what, f"no answer in {self.timeout_s:g} s")
            raise L2Error(f"{what}: timed out") from None
        except Exception as exc:  # a client library bug must not reach an engine either
            logger.exception("L2 %s on %s raised unexpectedly", what, self.where)
            self._failed(what, f"{type(exc).__name__}: {exc}")
            raise L2Error(f"{what}: {type(exc).__name__}: {exc}") from exc
        if not self.counters.up:
            logger.warning("L2 %s answers again", self.where)
        self.counters.up = True
        self._backoff_s = 0.0
        return result

    async def call_on_pool(self, what: str, transfer: asyncio.Future[T],
                           if_abandoned: Callable[[], None]) -> T:
        """call() of a DirectL2 transfer under way on the backend's thread. If it fails, or
        the caller stops waiting (timeout, cancel), `if_abandoned()` runs on the loop once
        the thread is done with the pool extents, never before: until then they stay the
        transfer's, and no one else's bytes can land in them."""
        try:
            return await self.call(what, asyncio.shield(transfer))
        except BaseException:
            transfer.add_done_callback(lambda _: if_abandoned())
            raise

    def _failed(self, what: str, why: str) -> None:
        self.counters.errors += 1
        self._backoff_s = min(max(self._backoff_s * 2, BACKOFF_MIN_S), BACKOFF_MAX_S)
        self._retry_at = self.clock() + self._backoff_s
        log = logger.warning if self.counters.up else logger.debug
        log("L2 %s on %s failed (%s): serving from L1 alone, next try in %.1f s", what,
            self.where, why, self._backoff_s)
        self.counters.up = False
