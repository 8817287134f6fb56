"""The workers' side: register each rank's KV cache, send batched stores and loads, report them."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from ..errors import LMCacheMPError, UnknownInstance
from ..protocol import (
    CHUNK_HASH_BYTES, SKIP_BLOCK, RetrieveRequest, StoreRequest, TransferItem, unpack_block_ids,
)
from .api import CacheClient, Registration
from .parallel import ParallelStrategy
from .shm import SharedKVCache

logger = logging.getLogger(__name__)


@dataclass
class _Load:
    item: TransferItem
    future: Future | None  # the batch's RETRIEVE; None if it was never sent, or on a follower
    index: int  # this item's place in the batch's reply
    deadline: float


class WorkerAdapter:
    """Called by each worker process (one per rank) around its forward passes; no method
    blocks on the server, and a server that cannot be reached never hangs a forward pass:
    stores are skipped, loads report their blocks as failed so the engine recomputes them.

    Every rank registers its cache. Under MLA only the TP leader sends STORE and RETRIEVE;
    the server writes a leader's loads into every rank of its TP group and tells each
    follower (a CacheClient made with mla_follower=True) when its own blocks hold the data.

    The CacheClient must carry the engine's secret (`CacheClient(engine=...)`), the same as
    the SchedulerAdapter's client and every other rank's: a RETRIEVE consumes the lookup
    holds of its own engine only, and an MLA group is made of ranks of one engine only (a
    follower whose client has another secret never gets its leader's loads).
    """

    def __init__(self, client: CacheClient, model: str, parallel: ParallelStrategy,
                 load_timeout: float = 30.0, tp_group: str = ""):
        """`tp_group`: a name the ranks of this engine share and other engine replicas on
        the node do not (under MLA the server fills the ranks of a leader's group)."""
        self.tp_group = tp_group
        self.client = client
        self.model = model
        self.parallel = parallel
        self.load_timeout = load_timeout
        self.registration: Registration | None = None
        # Every STORE still open per request: a chunked prefill sends one per step.
        self._stores: dict[str, list[Future | None]] = {}
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()

    def register_kv_cache(self, cache: SharedKVCache) -> Registration:
        """Once, at start-up, on every rank: the client passes the cache's memfd to the
        server (the fd channel) and registers its layers."""
        self.registration = self.client.register_kv_cache(
            cache.handles(), model=self.model, layout=cache.layout, block_size=cache.block_size,
            kv_world_size=self.parallel.kv_world_size, kv_worker_id=self.parallel.kv_worker_id,
            tp_rank=self.parallel.tp_rank, tp_group=self.tp_group)
        return self.registration

    def start_store(self, items: list[TransferItem]) -> None:
        """After a forward pass that computed these requests' chunks: one item per request,
        one STORE for the batch. An MLA follower sends nothing; its stores finish at once."""
        future = self._submit(StoreRequest, items) if self.parallel.sends_transfers and items else None
        for item in items:
            self._stores.setdefault(item.request_id, []).append(future)

    def start_load(self, items: list[TransferItem]) -> None:
        """Before a forward pass that reads these blocks: one item per request, one
        RETRIEVE for the batch (on an MLA follower, none: it waits for LOAD_DONE)."""
        deadline = time.monotonic() + self.load_timeout
        future = self._submit(RetrieveRequest, items) if self.parallel.sends_transfers and items else None
        for index, item in enumerate(items):
            self._loads[item.request_id] = _Load(item, future, index, deadline)

    def _submit(self, request_type: type, items: list[TransferItem]) -> Future | None:
        if self.registration is None:
            raise RuntimeError("register_kv_cache() first")
        try:
            return self.client.rpc.submit(request_type(self.registration.instance_id, items),
                                          timeout=self.load_timeout)
        except LMCacheMPError as exc:
            logger.warning("%s not sent: %s", request_type.__name__, exc)
            return None

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(requests whose stores finished, requests whose loads finished) since the last
        call; called after every forward pass. A failed store is logged and finished."""
        stores = {rid for rid, futures in self._stores.items()
                  if all(f is None or f.done() for f in futures)}
        for rid in stores:
            for future in self._stores.pop(rid):
                if future is not None and future.exception() is not None:
                    logger.warning("store for %s skipped: %s", rid, future.exception())
                    self._recover(future.exception())
        loads = set()
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            landed = self._landed(load, now)
            if landed is None:
                continue
            del self._loads[rid]
            loads.add(rid)
            block_ids = unpack_block_ids(load.item.block_ids, "block_ids")
            chunks = len(load.item.chunk_hashes) // CHUNK_HASH_BYTES
            blocks_per_chunk = len(block_ids) // chunks if chunks else 0
            self._load_errors.update(b for b in block_ids[landed * blocks_per_chunk:]
                                     if b != SKIP_BLOCK)
        return stores, loads

    def _landed(self, load: _Load, now: float) -> int | None:
        """Chunks that landed in this rank's blocks, or None while the load is on its way."""
        if not self.parallel.sends_transfers:
            landed = self.client.poll_load(load.item.request_id, load.item.cache_salt)
            if landed is None and now < load.deadline:
                return None
            return landed or 0
        if load.future is None:
            return 0  # never sent: the server was unreachable
        if not load.future.done():
            return None
        try:
            return load.future.result().retrieved[load.index]
        except LMCacheMPError as exc:
            logger.warning("load for %s failed: %s", load.item.request_id, exc)
            self._recover(exc)
            return 0

    def _recover(self, error: BaseException) -> None:
        """The server restarted and forgot this rank: register again (bounded by the
        client's timeout), so that the next stores and loads work."""
        if not isinstance(error, UnknownInstance) or self.registration is None:
            return
        try:
            self.client.register_again(self.registration, self.registration.instance_id)
        except LMCacheMPError as exc:
            logger.warning("could not register again: %s", exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (server down, chunk gone): the
        engine must recompute them rather than read them."""
        errors, self._load_errors = self._load_errors, set()
        return errors
