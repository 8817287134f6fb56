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
        # each request's lookup: in flight (a Future) or answered (its hit, in tokens), kept
        # until forget(), release() or end_session()
        self._lookups: dict[str, Future | int] = {}
        # lookups dropped while in flight: their hold is released once the reply arrives
        self._release_on_reply: dict[str, tuple[Future, str]] = {}

    def lookup(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None
               ) -> int | None:
        """Tokens of the longest stored prefix (whole chunks), or None while the answer is
        on its way: call again next step. The first call sends one LOOKUP, which holds what
        it finds; every later call returns the same answer, sending nothing, until forget(),
        release() or end_session() (vLLM may ask many times for a request it cannot admit
        yet: the answer and its hold stay until its blocks are allocated)."""
        self.poll()
        state = self._lookups.get(request_id)
        if isinstance(state, int):
            return state
        if state is None:
            if request_id in self._release_on_reply:
                return None  # an earlier hold of this request is released first
            hashes = chunk_hashes(token_ids, self.chunk_size)
            if not hashes:
                return 0
            request = LookupRequest(self.model, self.parallel.kv_world_size, [
                LookupItem.build(request_id, hashes, cache_salt or "", hold=True)])
            try:
                state = self.client.rpc.submit(request)
            except LMCacheMPError as exc:
                logger.warning("lookup for %s not sent: %s", request_id, exc)
                return 0
            self._lookups[request_id] = state
        if not state.done():
            return None
        try:
            (hit,) = state.result().hits
        except LMCacheMPError as exc:
            logger.warning("lookup for %s failed, treating it as a miss: %s", request_id, exc)
            hit = 0
        self._lookups[request_id] = hit * self.chunk_size
        return hit * self.chunk_size

    def in_flight(self, request_id: str) -> bool:
        """Whether the request's LOOKUP was sent and has not been answered yet."""
        state = self._lookups.get(request_id)
        return state is not None and not isinstance(state, int) and not state.done()

    def forget(self, request_id: str) -> None:
        """Drop the request's kept answer, not its hold (a RETRIEVE consumes that): its next
        lookup() sends a new LOOKUP."""
        self._lookups.pop(request_id, None)

    def release(self, request_id: str, cache_salt: str | None) -> None:
        """Drop the request's answer and holds: it was aborted, or the engine will not load
        after all. A LOOKUP still in flight is released once its reply arrives (poll())."""
        state = self._lookups.pop(request_id, None)
        if state is not None and not isinstance(state, int) and not state.done():
            self._release_on_reply[request_id] = (state, cache_salt or "")
            return
        self._send(ReleaseRequest([LeaseRef(request_id, cache_salt or "")]), request_id)

    def end_session(self, request_id: str, cache_salt: str | None) -> None:
        """The request finished: the server forgets its holds (also one taken by a LOOKUP
        still in flight, released once its reply arrives)."""
        state = self._lookups.pop(request_id, None)
        if state is not None and not isinstance(state, int) and not state.done():
            self._release_on_reply[request_id] = (state, cache_salt or "")
        self._send(EndSessionRequest(request_id, cache_salt or ""), request_id)

    def poll(self) -> None:
        """Release the holds of dropped lookups whose replies have arrived; never blocks.
        Call it once per step (lookup() does too)."""
        for request_id, (future, salt) in list(self._release_on_reply.items()):
            if not future.done():
                continue
            del self._release_on_reply[request_id]
            if (not future.cancelled() and future.exception() is None
                    and any(future.result().hits)):
                self._send(ReleaseRequest([LeaseRef(request_id, salt)]), request_id)

    def _send(self, request: object, request_id: str) -> None:
        # Fire and forget: a lost release only costs a lease that times out on the server.
        try:
            self.client.rpc.submit(request).add_done_callback(
                lambda f: f.exception() and logger.warning(
                    "releasing %s failed: %s", request_id, f.exception()))
        except LMCacheMPError as exc:
            logger.warning("releasing %s failed: %s", request_id, exc)
