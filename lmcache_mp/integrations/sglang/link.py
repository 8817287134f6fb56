"""The backend's talk with lmcache-mp-server: one staging segment, LOOKUP, STORE, RETRIEVE."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import replace
from typing import TypeVar

from ...client import CacheClient, LeaseRef, LookupItem, Registration, StoreStatus, TransferItem
from ...client.cache_client import DEADLINE_MARGIN_S
from ...client.memfd import SharedSegment
from ...errors import BadRequest
from ...protocol import CHUNK_HASH_BYTES, LookupRequest, MemfdHandle, pack_block_ids
from .config import BackendConfig, Namespace
from .keys import chunk_hash, packed_hashes
from .layers import part_handles, splits
from .pages import PageCodec
from .staging import Half, Staging, settle

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STORED = (StoreStatus.STORED, StoreStatus.ALREADY_STORED)


class ServerLink:
    """Moves whole SGLang pages between the host pool and the server, one page per chunk:
    the KV bytes never cross the socket. Where the host pool itself lies in memory the
    server maps (host_pool.moved_pool) and its pages split into parts (layers.splits), the
    server copies pages straight into and out of it: one copy each way. Otherwise through
    a staging segment the server maps (a sealed memfd registered like a vLLM worker's
    cache): the backend's copy of a slice (one memcpy per run of consecutive host pages)
    overlaps the server's copy of the slice before (STORE) or after (RETRIEVE), through
    the segment's two halves.

    Never raises on the data path: a server that is down, restarting or slower than
    `timeout_s` makes a miss (LOOKUP, RETRIEVE) or a failed store, and the next call
    tries again. Calls from SGLang's prefetch and backup threads share the staging
    segment (Staging.halves)."""

    def __init__(self, settings: BackendConfig, space: Namespace, codec: PageCodec,
                 pool: SharedSegment | None = None):
        self.settings = settings
        self.space = space
        self.codec = codec
        self._named = space.model
        self._pool = pool
        self._in_place = False  # pages move straight between the server and the host pool
        self.client = CacheClient(settings.url or None, timeout=settings.timeout_s,
                                  client_name="sglang")
        self._tp_group = f"sglang-{uuid.uuid4().hex}"  # one group per rank: each loads itself
        self._staging: Staging | None = None
        self._registration: Registration | None = None
        self._connect_lock = threading.Lock()

    def connect(self) -> bool:
        """Register the staging segment (at start-up, and again after a failure); False
        while the server cannot be reached."""
        with self._connect_lock:
            return self._registration is not None or self._register()

    def _register(self) -> bool:
        try:
            chunk_size = self.client.hello().chunk_size
            handles = self._handles(chunk_size)
            # A page registered as its parts is a chunk of another geometry than one padded
            # block: never the same name, so that neither is taken for the other.
            parts = ":parts" if splits(self.codec, chunk_size) else ""
            self.space = replace(self.space, model=self._named + parts)
            try:
                self._registration = self._register_pages(handles, chunk_size)
            except BadRequest as exc:
                if not self._in_place:
                    raise
                # e.g. this uid's registered memory would pass MAX_REGISTERED_BYTES_PER_UID
                logger.warning("lmcache-mp: the server refused the host pool, pages go through "
                               "the staging segment: %s", exc)
                self._pool = None
                self._registration = self._register_pages(self._handles(chunk_size),
                                                          chunk_size)
        except Exception as exc:  # noqa: BLE001 (a server not there yet: pages miss)
            logger.warning("lmcache-mp server not reachable, pages miss until it is: %s", exc)
            return False
        return True

    def _register_pages(self, handles: list[MemfdHandle], chunk_size: int) -> Registration:
        return self.client.register_kv_cache(
            handles, model=self.space.model, layout="mla", block_size=chunk_size,
            kv_world_size=self.space.kv_world_size, kv_worker_id=self.space.kv_worker_id,
            tp_group=self._tp_group)

    def _handles(self, chunk_size: int) -> list[MemfdHandle]:
        """The host pool's pages, where it lies in a segment and they split; else the
        staging segment's blocks (made now, or again for a new chunk size)."""
        pool = self._pool if splits(self.codec, chunk_size) else None
        self._in_place = pool is not None
        if pool is not None:
            pool_pages, part = self.codec.pool_pages, self.codec.part_bytes
            return part_handles(self.codec, pool.name, chunk_size, pool_pages,
                                pool_pages * part, part)
        if self._staging is None or self._staging.chunk_size != chunk_size:
            pages = self.settings.staging_pages_for(self.codec.page_bytes)
            self._staging = Staging(self.codec, pages, chunk_size)
        return self._staging.handles()

    def close(self) -> None:
        self.client.close()
        if self._staging is not None:
            self._staging.close()

    def lookup(self, keys: list[str]) -> int:
        """The leading run of `keys` stored for every kv worker of this namespace, held for
        the RETRIEVE that follows (the server drops unused holds after its lease timeout)."""
        if not keys or not self.connect():
            return 0
        request = self.lookup_request(keys)
        try:  # a call reads its reply on this thread, with no future to settle by another
            hits = self.client.lookup(request.model, request.kv_world_size, request.items,
                                      self.settings.timeout_s)
            return min(int(hits[0]), len(keys))
        except Exception as exc:  # noqa: BLE001
            logger.warning("lookup of %d pages missed: %s", len(keys), exc)
            return 0

    def lookup_request(self, keys: list[str]) -> LookupRequest:
        """The LOOKUP lookup() sends for `keys`, holding the hits for this batch's request id
        (the bench's echo carries the same bytes)."""
        item = LookupItem(_request_id(keys), packed_hashes(keys), self.settings.cache_salt,
                          hold=True)
        return LookupRequest(self.space.model, self.space.kv_world_size, [item])

    def store(self, keys: list[str], pages: list[int], parent: str | None) -> list[bool]:
        """Per page: stored now or before. In place, one STORE of the host pages; through
        staging, pages go in slices of a staging half, each copied in while the server
        stores the slice before. A page that fails ends the batch (SGLang stops at the
        first failure): the pages after it are False, even those the server stored (a
        later set finds them stored)."""
        if not keys or not self.space.writes or not self.connect():
            return [not self.space.writes] * len(keys)
        stored: list[bool] = []
        try:
            if self._in_place:
                self._store_in_place(keys, pages, parent, stored)
            else:
                with self.staging.halves(self._patience()) as halves:
                    self._store_slices(_request_id(keys), packed_hashes(keys), pages, parent,
                                       halves, stored)
        except Exception as exc:  # noqa: BLE001 (the data path never raises)
            logger.warning("lmcache-mp store of %d pages failed: %s", len(keys), exc)
        return stored + [False] * (len(keys) - len(stored))

    def _store_slices(self, rid: str, hashes: bytes, pages: list[int],
                      parent: str | None, halves: list[Half], stored: list[bool]) -> None:
        """Appends each slice's outcome to `stored`, in order; stops at a failure. A slice
        is sent as soon as it is copied in: the server's copy of one slice runs while the
        backend copies the next, and a half is filled again once its STORE is answered."""
        sent: deque[tuple[Half, int, int]] = deque()  # in flight, oldest first
        for number, (start, end) in enumerate(_slices(len(pages), halves)):
            half = halves[number % len(halves)]
            if half.in_flight is not None and not self._stored(sent.popleft(), stored):
                return  # a failed slice ends the batch; Staging.halves settles the rest
            half.fill(self.codec, pages[start:end])
            item = TransferItem(rid, _part(hashes, start, end),
                                pack_block_ids(half.blocks(end - start)),
                                self.settings.cache_salt,
                                parent_hash=_parent_hash(hashes, start, parent))
            half.in_flight = self.client.store_async(self.registration, [item],
                                                     self.settings.timeout_s)
            sent.append((half, start, end))
        while sent and self._stored(sent.popleft(), stored):
            pass

    def _stored(self, sent: tuple[Half, int, int], stored: list[bool]) -> bool:
        """Wait for a slice's STORE; True if every page of it is stored."""
        half, start, end = sent
        future, half.in_flight = half.in_flight, None
        assert future is not None
        try:
            statuses = self._reply(future).results[0]
            outcome = [status in _STORED for status in statuses[:end - start]]
        except Exception as exc:  # noqa: BLE001 (a failed slice: its pages are False)
            logger.warning("lmcache-mp STORE of %d pages failed: %s", end - start, exc)
            outcome = []
        outcome += [False] * (end - start - len(outcome))
        stored += outcome
        return all(outcome)

    def _store_in_place(self, keys: list[str], pages: list[int], parent: str | None,
                        stored: list[bool]) -> None:
        """One STORE naming the host pages themselves; appends to `stored` the leading run
        of pages stored now or before (a failed page ends the batch, as through staging)."""
        hashes = packed_hashes(keys)
        item = TransferItem(_request_id(keys), hashes, pack_block_ids(pages),
                            self.settings.cache_salt, parent_hash=_parent_hash(hashes, 0, parent))
        future = self.client.store_async(self.registration, [item], self.settings.timeout_s)
        try:
            statuses = self._reply(future).results[0][:len(keys)]
        finally:
            self._settle(future)
        stored += itertools.takewhile(bool, (status in _STORED for status in statuses))

    def _retrieve_in_place(self, rid: str, hashes: bytes, pages: list[int]) -> int:
        """One RETRIEVE into the host pages themselves: how many leading pages landed."""
        item = TransferItem(rid, hashes, pack_block_ids(pages), self.settings.cache_salt)
        future = self.client.retrieve_async(self.registration, [item], self.settings.timeout_s)
        try:
            return min(int(self._reply(future).retrieved[0]), len(pages))
        except Exception as exc:  # noqa: BLE001 (a miss)
            logger.warning("lmcache-mp RETRIEVE of %d pages failed: %s", len(pages), exc)
            return 0
        finally:
            self._settle(future)

    def _settle(self, future: Future) -> None:
        """Return only once the server touches the host pages no more."""
        settle(future, self._patience())

    def retrieve(self, keys: list[str], pages: list[int]) -> list[bool]:
        """Per page: its bytes are in the host pool now. Only a leading run is True. The
        server fills one staging half while the backend copies the other out; a batch
        that ends early releases what its LOOKUP still holds."""
        landed = 0
        if keys and self.connect():
            rid = _request_id(keys)
            try:
                if self._in_place:
                    landed = self._retrieve_in_place(rid, packed_hashes(keys), pages)
                else:
                    with self.staging.halves(self._patience()) as halves:
                        landed = self._retrieve_slices(rid, packed_hashes(keys), pages, halves)
            except Exception as exc:  # noqa: BLE001 (the data path never raises)
                logger.warning("lmcache-mp retrieve of %d pages failed: %s", len(keys), exc)
            if landed < len(keys):
                self._release(rid)
        return [True] * landed + [False] * (len(keys) - landed)

    def _retrieve_slices(self, rid: str, hashes: bytes, pages: list[int],
                         halves: list[Half]) -> int:
        """How many leading pages landed in the host pool; a slice that misses ends it.
        Each half has a RETRIEVE in flight: the server fills one while the backend copies
        the other out, and a half is sent again once it is copied out."""
        slices = _slices(len(pages), halves)
        for half, bounds in zip(halves, slices):
            self._send_retrieve(rid, hashes, bounds, half)
        landed = 0
        for number, (start, end) in enumerate(slices):
            half = halves[number % len(halves)]
            got = self._retrieved(half, end - start)
            half.drain(self.codec, pages[start:start + got])
            landed += got
            if got < end - start:
                return landed  # Staging.halves settles what is still in flight
            if number + len(halves) < len(slices):
                self._send_retrieve(rid, hashes, slices[number + len(halves)], half)
        return landed

    def _send_retrieve(self, rid: str, hashes: bytes, bounds: tuple[int, int],
                       half: Half) -> None:
        start, end = bounds
        item = TransferItem(rid, _part(hashes, start, end),
                            pack_block_ids(half.blocks(end - start)), self.settings.cache_salt)
        half.in_flight = self.client.retrieve_async(self.registration, [item],
                                                    self.settings.timeout_s)

    def _retrieved(self, half: Half, count: int) -> int:
        """Wait for a half's RETRIEVE: how many leading pages of it landed in staging."""
        future, half.in_flight = half.in_flight, None
        assert future is not None
        try:
            return min(int(self._reply(future).retrieved[0]), count)
        except Exception as exc:  # noqa: BLE001 (a miss)
            logger.warning("lmcache-mp RETRIEVE of %d pages failed: %s", count, exc)
            return 0

    def _reply(self, future: Future[T]) -> T:
        """A transfer's reply, read off the socket on this thread (CacheClient.wait): no
        hand-off from the client's reader thread on the way back."""
        self.client.wait([future], self._patience())
        return future.result(0)

    def _release(self, rid: str) -> None:
        """Drop what this batch's LOOKUP still holds (none, if there was none); no wait."""
        with contextlib.suppress(Exception):
            self.client.release_async([LeaseRef(rid, self.settings.cache_salt)])

    @property
    def staging(self) -> Staging:
        assert self._staging is not None  # connect()
        return self._staging

    @property
    def registration(self) -> Registration:
        assert self._registration is not None  # connect()
        return self._registration

    def _patience(self) -> float:
        """How long to wait for a reply: a transfer's future settles by its budget plus
        DEADLINE_MARGIN_S by itself (after which the server touches the staging segment no
        more); this only ends a hang."""
        return self.settings.timeout_s + DEADLINE_MARGIN_S + 1.0


def _slices(total: int, halves: list[Half]) -> list[tuple[int, int]]:
    """A batch of `total` pages as (start, end) slices, each as large as the half it goes
    through (the halves taken in turn)."""
    slices: list[tuple[int, int]] = []
    start = 0
    while start < total:
        end = min(total, start + halves[len(slices) % len(halves)].capacity)
        slices.append((start, end))
        start = end
    return slices


def _part(hashes: bytes, start: int, end: int) -> bytes:
    """Pages start .. end - 1 of a batch's packed chunk hashes."""
    return hashes[start * CHUNK_HASH_BYTES:end * CHUNK_HASH_BYTES]


def _parent_hash(hashes: bytes, start: int, parent: str | None) -> bytes:
    """The chunk hash a slice names as its parent: the page before it, or the batch's."""
    if start:
        return _part(hashes, start - 1, start)
    return chunk_hash(parent) if parent else b""


def _request_id(keys: list[str]) -> str:
    """The batch's name on the server: its first page key, so that the RETRIEVE that
    follows a LOOKUP of the same pages consumes that LOOKUP's holds."""
    return f"sglang-{keys[0][:128]}"
