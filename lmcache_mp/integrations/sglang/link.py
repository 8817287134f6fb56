"""The backend's talk with lmcache-mp-server: one staging segment, LOOKUP, STORE, RETRIEVE."""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

import torch

from ...client import CacheClient, LookupItem, Registration, StoreStatus, TransferItem
from ...client.cache_client import DEADLINE_MARGIN_S
from ...client.memfd import SharedKVCache
from .config import BackendConfig, Namespace
from .pages import PageCodec

logger = logging.getLogger(__name__)

T = TypeVar("T")
_STORED = (StoreStatus.STORED, StoreStatus.ALREADY_STORED)


def chunk_hash(key: str) -> bytes:
    """The server's 16-byte chunk hash of one SGLang page key (SGLang's own SHA-256 chain
    over the page's tokens and its prefix, seeded by the request's extra key)."""
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


class ServerLink:
    """Moves whole SGLang pages between the host pool and the server through a staging
    segment the server maps (a sealed memfd registered like a vLLM worker's cache, one
    page per chunk): the KV bytes never cross the socket, and the staging copy is one
    in-process memcpy per page each way.

    Never raises on the data path: a server that is down, restarting or slower than
    `timeout_s` makes a miss (LOOKUP, RETRIEVE) or a failed store, and the next call
    tries again. Calls from SGLang's prefetch and backup threads share the staging
    segment one at a time."""

    def __init__(self, settings: BackendConfig, space: Namespace, codec: PageCodec):
        self.settings = settings
        self.space = space
        self.codec = codec
        self.client = CacheClient(settings.url or None, timeout=settings.timeout_s,
                                  client_name="sglang")
        self._tp_group = f"sglang-{uuid.uuid4().hex}"  # one group per rank: each loads itself
        self._staging: SharedKVCache | None = None
        self._registration: Registration | None = None
        self._lock = threading.Lock()  # the staging segment's, one slice at a time
        self._connect_lock = threading.Lock()

    def connect(self) -> bool:
        """Register the staging segment (at start-up, and again after a failure); False
        while the server cannot be reached."""
        with self._connect_lock:
            return self._registration is not None or self._register()

    def _register(self) -> bool:
        try:
            chunk_size = self.client.hello().chunk_size
            if self._staging is None:
                width = math.ceil(self.codec.page_bytes / chunk_size)
                self._staging = SharedKVCache("mla", 1, self.settings.staging_pages,
                                              chunk_size, 1, width, torch.uint8)
            self._registration = self.client.register_kv_cache(
                self._staging.handles(), model=self.space.model, layout="mla",
                block_size=chunk_size, kv_world_size=self.space.kv_world_size,
                kv_worker_id=self.space.kv_worker_id, tp_group=self._tp_group)
        except Exception as exc:  # noqa: BLE001 (a server not there yet: pages miss)
            logger.warning("lmcache-mp server not reachable, pages miss until it is: %s", exc)
            return False
        return True

    def close(self) -> None:
        self.client.close()
        if self._staging is not None:
            self._staging.close()

    def lookup(self, keys: list[str]) -> int:
        """The leading run of `keys` stored for every kv worker of this namespace, held for
        the RETRIEVE that follows (the server drops unused holds after its lease timeout)."""
        if not keys or not self.connect():
            return 0
        item = LookupItem.build(_request_id(keys), [chunk_hash(k) for k in keys],
                                self.settings.cache_salt, hold=True)
        try:
            future = self.client.lookup_async(self.space.model, self.space.kv_world_size,
                                              [item], self.settings.timeout_s)
            return min(int(future.result(self._patience()).hits[0]), len(keys))
        except Exception as exc:  # noqa: BLE001
            logger.warning("lookup of %d pages missed: %s", len(keys), exc)
            return 0

    def store(self, keys: list[str], pages: list[int], parent: str | None) -> list[bool]:
        """Per page: stored now or before. Pages go in slices of the staging segment's
        size; a slice that fails ends the batch (SGLang stops at the first failure)."""
        done: list[bool] = []
        rid = _request_id(keys) if keys else ""
        if not keys or not self.space.writes or not self.connect():
            return [not self.space.writes] * len(keys)
        for start in range(0, len(keys), self.settings.staging_pages):
            end = start + self.settings.staging_pages
            parent_key = keys[start - 1] if start else parent
            stored = self._guarded(self._store_slice, [False] * len(keys[start:end]),
                                   rid, keys[start:end], pages[start:end], parent_key)
            done += stored
            if not all(stored):
                break
        return done + [False] * (len(keys) - len(done))

    def retrieve(self, keys: list[str], pages: list[int]) -> list[bool]:
        """Per page: its bytes are in the host pool now. Only a leading run is True."""
        landed = 0
        rid = _request_id(keys) if keys else ""
        if keys and self.connect():
            for start in range(0, len(keys), self.settings.staging_pages):
                end = start + self.settings.staging_pages
                got = self._guarded(self._retrieve_slice, 0, rid, keys[start:end],
                                    pages[start:end])
                landed += got
                if got < len(keys[start:end]):
                    break
        return [True] * landed + [False] * (len(keys) - landed)

    def _guarded(self, move: Callable[..., T], failed: T, rid: str, keys: list[str],
                 *args: object) -> T:
        """One slice under the staging lock; a failure is `failed` (a miss), logged."""
        with self._lock:
            try:
                return move(rid, keys, *args)
            except Exception as exc:  # noqa: BLE001 (the data path never raises)
                logger.warning("lmcache-mp transfer of %d pages failed: %s", len(keys), exc)
                return failed

    def _store_slice(self, rid: str, keys: list[str], pages: list[int], parent: str | None
                     ) -> list[bool]:
        staging, registration = self._ready()
        for slot, page in enumerate(pages):
            self.codec.staged(staging.layers[0][slot]).copy_(self.codec.page(page))
        item = TransferItem.build(rid, [chunk_hash(k) for k in keys],
                                  list(range(len(keys))), self.settings.cache_salt,
                                  parent_hash=chunk_hash(parent) if parent else b"")
        future = self.client.store_async(registration, [item], self.settings.timeout_s)
        statuses = future.result(self._patience()).results[0]
        return [status in _STORED for status in statuses]

    def _retrieve_slice(self, rid: str, keys: list[str], pages: list[int]) -> int:
        staging, registration = self._ready()
        item = TransferItem.build(rid, [chunk_hash(k) for k in keys],
                                  list(range(len(keys))), self.settings.cache_salt)
        future = self.client.retrieve_async(registration, [item], self.settings.timeout_s)
        landed = min(int(future.result(self._patience()).retrieved[0]), len(keys))
        for slot, page in enumerate(pages[:landed]):
            self.codec.page(page).copy_(self.codec.staged(staging.layers[0][slot]))
        return landed

    def _ready(self) -> tuple[SharedKVCache, Registration]:
        assert self._staging is not None and self._registration is not None  # connect()
        return self._staging, self._registration

    def _patience(self) -> float:
        """How long to wait for a reply: a transfer's future settles by its budget plus
        DEADLINE_MARGIN_S by itself (after which the server touches the staging segment no
        more); this only ends a hang."""
        return self.settings.timeout_s + DEADLINE_MARGIN_S + 1.0


def _request_id(keys: list[str]) -> str:
    """The batch's name on the server: its first page key, so that the RETRIEVE that
    follows a LOOKUP of the same pages consumes that LOOKUP's holds."""
    return f"sglang-{keys[0][:128]}"
