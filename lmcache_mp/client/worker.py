"""The workers' side: register each rank's KV cache, send batched stores and loads, report them."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from ..errors import RequestTimeout
from ..protocol import CHUNK_HASH_BYTES, SKIP_BLOCK, TransferItem, unpack_block_ids
from .cache_client import DEADLINE_MARGIN_S, CacheClient, Registration
from .memfd import SharedKVCache
from .parallel import ParallelStrategy

logger = logging.getLogger(__name__)

DEFAULT_TRANSFER_BUDGET_S = 5.0  # seconds: see WorkerAdapter


@dataclass
class _Store:
    future: Future | None  # the batch's STORE; None if nothing was sent (an MLA follower)
    deadline: float  # past it the server reads the blocks no more, answer or not


@dataclass
class _Load:
    item: TransferItem
    future: Future | None  # the batch's RETRIEVE; None on a follower
    index: int  # this item's place in the batch's reply
    deadline: float  # past it the server writes the blocks no more, answer or not
    disconnects: int  # the client's count at the start: when it changes, the server is gone
    landed: int | None = None  # on a follower, what wait_for_loads got: chunks landed
    progress_tag: int = 0  # sent layer by layer: the RETRIEVE's progress_tag


class WorkerAdapter:
    """Called by each worker process (one per rank) around its forward passes; no method
    blocks on the server (but wait_for_stores and wait_for_loads, when asked to), and a
    server that cannot be reached never hangs a forward pass for longer than a transfer's
    deadline: stores are skipped, loads report their blocks as failed so the engine
    recomputes them.

    The blocks of a transfer are the engine's again once the adapter reports it finished:
    every STORE and RETRIEVE carries a budget (`load_timeout`), the server starts no copy
    from or into the blocks after it, and the adapter reports a transfer when the server
    answered, at once when the connection to the server drops (a server that is gone
    touches no memory), and at the latest DEADLINE_MARGIN_S past the budget.

    Every rank registers its cache. Under MLA only the TP leader sends STORE and RETRIEVE;
    the server writes a leader's loads into every rank of its TP group and tells each
    follower (a CacheClient made with mla_follower=True) when its own blocks hold the data.
    Every rank numbers its loads (start_load calls) alike, so a follower takes the notice
    of the load it waits for, never a late one of an earlier load of the same request. A
    follower counts its wait from its own start_load: the ranks of a TP group run their
    steps together, so the margin covers the leader's deadline too.

    The CacheClient must carry the engine's secret (`CacheClient(engine=...)`), the same as
    the SchedulerAdapter's client and every other rank's: a RETRIEVE consumes the lookup
    holds of its own engine only, and an MLA group is made of ranks of one engine only (a
    follower whose client has another secret never gets its leader's loads).
    """

    def __init__(self, client: CacheClient, model: str, parallel: ParallelStrategy,
                 load_timeout: float = DEFAULT_TRANSFER_BUDGET_S, tp_group: str = ""):
        """`load_timeout`: the budget, in seconds, of every STORE and RETRIEVE (see above);
        `tp_group`: a name the ranks of this engine share and other engine replicas on
        the node do not (under MLA the server fills the ranks of a leader's group)."""
        self.tp_group = tp_group
        self.client = client
        self.model = model
        self.parallel = parallel
        self.load_timeout = load_timeout
        self.registration: Registration | None = None
        # Every STORE still open per request: a chunked prefill sends one per step.
        self._stores: dict[str, list[_Store]] = {}
        self._loads: dict[str, _Load] = {}
        self._load_errors: set[int] = set()
        self._load_seq = 0  # start_load calls so far: the same on every rank

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
        now = time.monotonic()
        if self.parallel.sends_transfers and items:
            store = _Store(self.client.store_async(self._registered(), items, self.load_timeout),
                           now + self.load_timeout + DEADLINE_MARGIN_S)
        else:
            store = _Store(None, now)
        for item in items:
            self._stores.setdefault(item.request_id, []).append(store)

    def start_load(self, items: list[TransferItem], by_layer: bool = False) -> None:
        """Before a forward pass that reads these blocks: one item per request, one
        RETRIEVE for the batch (on an MLA follower, none: it waits for LOAD_DONE).
        `by_layer`: the server may write a cache in CPU memory layer by layer, saying as
        layers settle, so that the pass can start before the whole load has landed (see
        wait_for_layer)."""
        self._load_seq += 1
        items = [replace(item, load_seq=self._load_seq) for item in items]
        deadline = time.monotonic() + self.load_timeout + DEADLINE_MARGIN_S
        tag = self._load_seq if by_layer and self.parallel.sends_transfers else 0
        future = (self.client.retrieve_async(self._registered(), items, self.load_timeout,
                                             progress_tag=tag)
                  if self.parallel.sends_transfers and items else None)
        disconnects = self.client.disconnects
        for index, item in enumerate(items):
            self._loads[item.request_id] = _Load(item, future, index, deadline, disconnects,
                                                 progress_tag=tag)

    def _registered(self) -> Registration:
        if self.registration is None:
            raise RuntimeError("register_kv_cache() first")
        return self.registration

    def wait_for_stores(self, request_ids: Iterable[str]) -> None:
        """Worker, before a forward pass that may overwrite these requests' blocks (vLLM
        hands a preempted request's blocks to others at once): blocks until the server has
        answered their STOREs, returns at once if the server is gone, and waits at most
        until their deadline, after which the server reads the blocks no more. Their
        stores are reported by get_finished as usual."""
        for request_id in request_ids:
            for store in self._stores.get(request_id, ()):
                left = store.deadline - time.monotonic()
                if store.future is not None and left > 0:
                    self.client.wait([store.future], left)

    def wait_for_loads(self, request_ids: Iterable[str]) -> None:
        """Worker, before a forward pass that reads these requests' loads (an engine's
        synchronous loads): blocks until each has landed or failed, at most until its
        deadline, after which the server writes its blocks no more. They are reported by
        get_finished as usual."""
        for request_id in request_ids:
            load = self._loads.get(request_id)
            if load is None:
                continue
            if load.future is not None:
                # (a timed wait may end a little early: get_finished must find it settled)
                while not load.future.done() and (left := load.deadline - time.monotonic()) > 0:
                    self.client.wait([load.future], left)
                continue
            left = load.deadline - time.monotonic()
            if left > 0 and not self.parallel.sends_transfers:
                with contextlib.suppress(RequestTimeout):
                    load.landed = self.client.wait_for_load(
                        request_id, load.item.cache_salt, left, load.item.load_seq)

    def wait_for_layer(self, request_ids: Iterable[str], layer: int) -> None:
        """Worker, before a layer of a forward pass reads these requests' loads (started
        with by_layer): blocks until the server writes layers 0..`layer` of their blocks no
        more (it said so, or answered, or is gone), at most until their deadline. Loads
        sent whole, or to a server that writes them whole, wait for the whole load. What
        landed is reported by get_finished as usual."""
        for request_id in request_ids:
            load = self._loads.get(request_id)
            if load is None or load.future is None or not load.progress_tag:
                self.wait_for_loads([request_id])
                continue
            while (self.client.layers_settled(load.progress_tag) <= layer
                   and not load.future.done()
                   and (left := load.deadline - time.monotonic()) > 0):
                self.client.wait_for_layers(load.progress_tag, layer + 1, load.future, left)

    def discard_loads(self, request_ids: Iterable[str]) -> None:
        """Report these loads (settled: see wait_for_loads) as failed whatever landed: every
        block of theirs goes to the load errors, for the engine to recompute."""
        for request_id in request_ids:
            load = self._loads.get(request_id)
            if load is not None:
                load.landed = 0

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(requests whose stores finished, requests whose loads finished) since the last
        call; called after every forward pass. A failed store is logged and finished."""
        now = time.monotonic()
        stores = {rid for rid, pending in self._stores.items()
                  if all(self._settled(store, now) for store in pending)}
        for rid in stores:
            for store in self._stores.pop(rid):
                if store.future is None:
                    continue
                if not store.future.done():
                    logger.warning("store for %s unanswered by its deadline", rid)
                elif store.future.exception() is not None:
                    logger.warning("store for %s skipped: %s", rid, store.future.exception())
        loads = set()
        for rid, load in list(self._loads.items()):
            landed = self._landed(load, now)
            if landed is None:
                continue
            del self._loads[rid]
            loads.add(rid)
            if load.progress_tag:
                self.client.forget_progress(load.progress_tag)
            block_ids = unpack_block_ids(load.item.block_ids, "block_ids")
            chunks = len(load.item.chunk_hashes) // CHUNK_HASH_BYTES
            blocks_per_chunk = len(block_ids) // chunks if chunks else 0
            self._load_errors.update(b for b in block_ids[landed * blocks_per_chunk:]
                                     if b != SKIP_BLOCK)
        return stores, loads

    @staticmethod
    def _settled(store: _Store, now: float) -> bool:
        return store.future is None or store.future.done() or now >= store.deadline

    def _landed(self, load: _Load, now: float) -> int | None:
        """Chunks that landed in this rank's blocks, or None while the load is on its way."""
        if load.landed is not None:
            return load.landed
        if not self.parallel.sends_transfers:
            landed = self.client.poll_load(load.item.request_id, load.item.cache_salt,
                                           load.item.load_seq)
            if landed is not None:
                return landed
            gone = self.client.disconnects != load.disconnects
            return 0 if gone or now >= load.deadline else None
        if load.future is None:
            return 0
        if not load.future.done():
            return 0 if now >= load.deadline else None
        try:
            return load.future.result().retrieved[load.index]
        except Exception as exc:  # noqa: BLE001 (whatever failed, the engine recomputes)
            logger.warning("load for %s failed: %s", load.item.request_id, exc)
            return 0

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose load failed since the last call (server down, chunk gone): the
        engine must recompute them rather than read them."""
        errors, self._load_errors = self._load_errors, set()
        return errors
