"""The scheduler's side: lookups that never block a scheduler step, and the holds they take."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future

import msgspec

from ..errors import LMCacheMPError
from ..protocol import LeaseRef, LookupItem, LookupReply
from .cache_client import CacheClient
from .hashing import chunk_hashes
from .parallel import ParallelStrategy

logger = logging.getLogger(__name__)


class SchedulerAdapter:
    """Called by the engine's scheduler process, from its step loop; no method blocks
    longer than the bounded wait a lookup asks for.

    A request's first lookup() sends a LOOKUP that holds the hit chunks on the server
    (for every kv rank) until the workers' RETRIEVE, release() or end_session(). If the
    server cannot be reached, lookups answer a miss: the engine computes instead.

    Holds belong to the engine: the CacheClient must carry the engine's secret
    (`CacheClient(engine=...)`), the same as every worker's, or the workers' RETRIEVEs
    cannot consume them (they would only time out). Another engine's release() or
    end_session() of the same request id never drops them.
    """

    def __init__(self, client: CacheClient, model: str, parallel: ParallelStrategy,
                 chunk_size: int = 256, snapshot_workers: Sequence[int] = ()):
        """`snapshot_workers`: the kv workers whose chunks are snapshots of the prefix at
        their chunk's end (LookupRequest.snapshot_workers), sent with every LOOKUP."""
        self.client = client
        self.model = model
        self.parallel = parallel
        self.chunk_size = chunk_size
        self.snapshot_workers = tuple(snapshot_workers)
        # each request's LOOKUP: in flight (its Future) or answered (its hit, in chunks),
        # kept until forget(), release() or end_session()
        self._lookups: dict[str, Future[LookupReply] | int] = {}
        # each answered LOOKUP's hits by tier (LookupReply.hit_tiers), while its answer is
        # kept; absent where the server did not count them
        self._tiers: dict[str, tuple[int, int, int]] = {}
        # lookups dropped while in flight: their hold is released once the reply arrives
        self._release_on_reply: dict[str, tuple[Future[LookupReply], str]] = {}
        # a wait for a reply ran out (the server is slow or gone): lookups wait no more
        # until a reply comes, so that an outage costs one wait, not one per request
        self._replies_late = False

    def lookup(self, request_id: str, token_ids: Sequence[int], cache_salt: str | None,
               wait_s: float = 0.0) -> int | None:
        """lookup_chunks for the chunks of `token_ids`, in tokens."""
        hit = self.lookup_chunks(request_id, chunk_hashes(token_ids, self.chunk_size),
                                 cache_salt, wait_s)
        return None if hit is None else hit * self.chunk_size

    def lookup_chunks(self, request_id: str, hashes: Sequence[bytes], cache_salt: str | None,
                      wait_s: float = 0.0) -> int | None:
        """Leading chunks of `hashes` stored, or None while the answer is on its way: call
        again next step. The first call sends one LOOKUP, which holds what it finds, and
        waits up to `wait_s` seconds for its reply; every later call returns the same
        answer, sending nothing, until forget(), release() or end_session() (vLLM may ask
        many times for a request it cannot admit yet: the answer and its hold stay until
        its blocks are allocated). After a wait that ran out, lookups do not wait until a
        reply has come in."""
        self.poll()
        state = self._lookups.get(request_id)
        if isinstance(state, int):
            return state
        if state is None:
            if request_id in self._release_on_reply:
                return None  # an earlier hold of this request is released first
            if not hashes:
                return 0
            item = LookupItem.build(request_id, list(hashes), cache_salt or "", hold=True)
            wait = wait_s if not self._replies_late else 0.0
            try:
                state = self.client.lookup_async(self.model, self.parallel.kv_world_size,
                                                 [item], wait=wait, tiers=True,
                                                 snapshot_workers=self.snapshot_workers)
            except LMCacheMPError as exc:
                logger.warning("lookup for %s not sent: %s", request_id, exc)
                return 0
            self._lookups[request_id] = state
            if wait > 0:
                self._replies_late = not state.done()
        if not state.done():
            return None
        try:
            reply = state.result()
            (hit,) = reply.hits
            self._replies_late = False
        except LMCacheMPError as exc:
            logger.warning("lookup for %s failed, treating it as a miss: %s", request_id, exc)
            hit = 0
        else:
            tiers = reply.hit_tiers
            if not isinstance(tiers, msgspec.UnsetType) and len(tiers) == 1 \
                    and len(tiers[0]) == 3 and sum(tiers[0]) == hit:
                memory, disk, l2 = tiers[0]
                self._tiers[request_id] = (memory, disk, l2)
        self._lookups[request_id] = hit
        return hit

    def hit_tiers(self, request_id: str) -> tuple[int, int, int] | None:
        """The kept answer's hit chunks by where the server found them: (in its memory,
        read back from disk, pulled from L2), in that order along the prompt; None where
        the server did not count them (an older server) or no answer is kept."""
        return self._tiers.get(request_id)

    def asked(self, request_id: str) -> bool:
        """Whether the request has a LOOKUP in flight or an answer kept."""
        return request_id in self._lookups

    def in_flight(self, request_id: str) -> bool:
        """Whether the request's LOOKUP was sent and has not been answered yet."""
        state = self._lookups.get(request_id)
        return state is not None and not isinstance(state, int) and not state.done()

    def forget(self, request_id: str) -> None:
        """Drop the request's kept answer, not its hold (a RETRIEVE consumes that): its next
        lookup() sends a new LOOKUP."""
        self._lookups.pop(request_id, None)
        self._tiers.pop(request_id, None)

    def release(self, request_id: str, cache_salt: str | None) -> None:
        """Drop the request's answer and holds: it was aborted, or the engine will not load
        after all. A LOOKUP still in flight is released once its reply arrives (poll())."""
        if self._drop(request_id, cache_salt):
            return
        self._send(lambda: self.client.release_async([LeaseRef(request_id, cache_salt or "")]),
                   request_id)

    def end_session(self, request_id: str, cache_salt: str | None) -> None:
        """The request finished: the server forgets its holds (also one taken by a LOOKUP
        still in flight, released once its reply arrives)."""
        self._drop(request_id, cache_salt)
        self._send(lambda: self.client.end_session_async(request_id, cache_salt or ""),
                   request_id)

    def poll(self) -> None:
        """Release the holds of dropped lookups whose replies have arrived; never blocks.
        Call it once per step (lookup() does too)."""
        for request_id, (future, salt) in list(self._release_on_reply.items()):
            if not future.done():
                continue
            del self._release_on_reply[request_id]
            if (not future.cancelled() and future.exception() is None
                    and any(future.result().hits)):
                # _send calls it at once; bound all the same, as the loop moves on
                self._send(lambda request_id=request_id, salt=salt:
                           self.client.release_async([LeaseRef(request_id, salt)]), request_id)

    def _drop(self, request_id: str, cache_salt: str | None) -> bool:
        """Forget the request's lookup; True if it is still in flight (its hold, if any,
        is released when the reply comes)."""
        state = self._lookups.pop(request_id, None)
        self._tiers.pop(request_id, None)
        if state is not None and not isinstance(state, int) and not state.done():
            self._release_on_reply[request_id] = (state, cache_salt or "")
            return True
        return False

    def _send(self, submit, request_id: str) -> None:
        # Fire and forget: a lost release only costs a lease that times out on the server.
        def log_failure(future) -> None:
            if future.exception():
                logger.warning("releasing %s failed: %s", request_id, future.exception())
        try:
            submit().add_done_callback(log_failure)
        except LMCacheMPError as exc:
            logger.warning("releasing %s failed: %s", request_id, exc)
