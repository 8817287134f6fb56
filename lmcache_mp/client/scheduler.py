"""The scheduler's side: lookups that never block a scheduler step, and the holds they take."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future

from ..errors import LMCacheMPError
from ..protocol import EndSessionRequest, LeaseRef, LookupItem, LookupRequest, ReleaseRequest
from .api import CacheClient
from .hashing import chunk_hashes
from .parallel import ParallelStrategy

logger = logging.getLogger(__name__)


class SchedulerAdapter:
    """Called by the engine's scheduler process, from its step loop; no method blocks.

    A request's first lookup() sends a LOOKUP that holds the hit chunks on the server
    (for every kv rank) until the workers' RETRIEVE, release() or end_session(). If the
    server cannot be reached, lookups answer a miss: the engine computes instead.

    Holds belong to the engine: the CacheClient must carry the engine's secret
    (`CacheClient(engine=...)`), the same as every worker's, or the workers' RETRIEVEs
    cannot consume them (they would only time out). Another engine's release() or
    end_session() of the same request id never drops them.
    """

    def __init__(self, client: CacheClient, model: str, parallel: ParallelStrategy,
                 chunk_size: int = 256):
        self.client = client
        self.model = model
        self.parallel = parallel
        self.chunk_size = chunk_size
        self._lookups: dict[str, Future] = {}

    def lookup(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None
               ) -> int | None:
        """Tokens of the longest stored prefix (whole chunks), or None while the answer is
        on its way: call again next step. Called once per step for each waiting request."""
        future = self._lookups.get(request_id)
        if future is None:
            hashes = chunk_hashes(token_ids, self.chunk_size)
            if not hashes:
                return 0
            request = LookupRequest(self.model, self.parallel.kv_world_size, [
                LookupItem.build(request_id, hashes, cache_salt or "", hold=True)])
            try:
                future = self.client.rpc.submit(request)
            except LMCacheMPError as exc:
                logger.warning("lookup for %s not sent: %s", request_id, exc)
                return 0
            self._lookups[request_id] = future
        if not future.done():
            return None
        del self._lookups[request_id]
        try:
            (hit,) = future.result().hits
        except LMCacheMPError as exc:
            logger.warning("lookup for %s failed, treating it as a miss: %s", request_id, exc)
            return 0
        return hit * self.chunk_size

    def release(self, request_id: str, cache_salt: str | None) -> None:
        """Drop the request's holds: it was aborted, or the engine will not load after all."""
        self._lookups.pop(request_id, None)
        self._send(ReleaseRequest([LeaseRef(request_id, cache_salt or "")]), request_id)

    def end_session(self, request_id: str, cache_salt: str | None) -> None:
        """The request finished: the server forgets its holds."""
        self._lookups.pop(request_id, None)
        self._send(EndSessionRequest(request_id, cache_salt or ""), request_id)

    def _send(self, request: object, request_id: str) -> None:
        # Fire and forget: a lost release only costs a lease that times out on the server.
        try:
            self.client.rpc.submit(request).add_done_callback(
                lambda f: f.exception() and logger.warning(
                    "releasing %s failed: %s", request_id, f.exception()))
        except LMCacheMPError as exc:
            logger.warning("releasing %s failed: %s", request_id, exc)
