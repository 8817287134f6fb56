"""Registered worker caches: their handles mapped, bounded per connection and uid, liveness."""

from __future__ import annotations

import logging
import mmap
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

import torch

from ...errors import BadRequest, UnknownInstance
from ...protocol import (
    MAX_REGISTERED_BYTES_PER_CONNECTION,
    MAX_REGISTERED_BYTES_PER_UID,
    MAX_REGISTRATIONS,
    MAX_REGISTRATIONS_PER_CONNECTION,
    TICKET_BYTES,
    CudaIpcHandle,
    MemfdHandle,
    RegisterKVCacheRequest,
    TensorHandle,
    span_bytes,
)
from ...protocol.fd_channel import FD_CHANNEL_MAGIC
from .cuda_ipc import Allocation, CudaIpcSupport, CudaMapping, open_allocations
from .geometry import DTYPES, Geometry
from .handles import Window, check, memory_of, stack_layers, validate_handles
from .host_rows import HostRows
from .instance import KVCacheInstance

logger = logging.getLogger(__name__)

# A memfd may hold at most this much beyond twice its layers' extent: the server maps only
# the extent, and a registration keeps no more than that of a worker's memory alive.
SEGMENT_SLACK_BYTES = 1024**2
# fd_channel.FdChannel.watch: (token, on_hangup) -> how to stop watching, or None
Watch = Callable[[bytes, Callable[[], None]], Callable[[], None] | None]


def _release(counter: Counter, key: Any, amount: int) -> None:
    counter[key] -= amount
    if not counter[key]:
        del counter[key]


@dataclass
class _Memory:
    """A registration's memory while it is set up: what a failure must close, and what the
    instance keeps once it succeeds."""

    mappings: dict[bytes, mmap.mmap] = field(default_factory=dict)  # memfd windows, by ticket
    allocations: dict[bytes, Allocation] = field(default_factory=dict)  # cuda_ipc's
    prefault: list[tuple[mmap.mmap, int, int]] = field(default_factory=list)
    registered: Counter[int] = field(default_factory=Counter)  # memfd bytes, by sending uid

    def views(self, handles: list[TensorHandle], dtype: torch.dtype
              ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Each layer's tensor over the mapped memory, and the layers stacked where they
        lie at one stride (handles.stack_layers)."""
        buffers = ({name: torch.frombuffer(m, dtype=torch.uint8)
                    for name, m in self.mappings.items()}
                   if self.mappings else {key: a.data for key, a in self.allocations.items()})
        typed = {key: raw[:raw.numel() - raw.numel() % dtype.itemsize].view(dtype)
                 for key, raw in buffers.items()}
        layers = [typed[memory_of(h)].as_strided(h.shape, h.strides, h.offset // dtype.itemsize)
                  for h in handles]
        return layers, stack_layers(handles, typed[memory_of(handles[0])])


def _layer_ends(req: RegisterKVCacheRequest, dtype: torch.dtype, sizes: dict[bytes, int]
                ) -> list[int]:
    """Where each layer's tensor ends in its memory, refused (BadRequest) past the memory's
    `sizes` (by memfd ticket or cuda_ipc key)."""
    ends = []
    for i, handle in enumerate(req.layers):
        size = sizes[memory_of(handle)]
        end = handle.offset + span_bytes(handle.shape, handle.strides, dtype.itemsize)
        where = (f"memfd {handle.name[:64]!r}" if isinstance(handle, MemfdHandle)
                 else "its CUDA allocation")
        check(end <= size, f"`layers[{i}]`: tensor ends at byte {end} but {where} "
              f"holds {size} bytes")
        ends.append(end)
    return ends


class Tickets(Protocol):
    """The fd channel's tickets, as the registry uses them (fd_channel.FdChannel)."""

    def peek(self, ticket: bytes) -> Any: ...  # its PassedFd, or None
    def spend(self, ticket: bytes) -> None: ...


class Registry:
    """Every registered KV cache by instance id, and the clients that own them."""

    def __init__(self, chunk_size: int, clock: Callable[[], float],
                 tickets: Tickets, cuda_ipc: CudaIpcSupport | None = None,
                 watch: Watch | None = None):
        """`tickets`: the fd channel's, which memfd handles name;
        `cuda_ipc`: how to map cuda_ipc handles; None on a server without CUDA;
        `watch`: the fd channel's watches, which end a registration when its worker hangs up."""
        self.chunk_size = chunk_size
        self.clock = clock
        self.tickets = tickets
        self.cuda_ipc = cuda_ipc
        self.watch = watch
        self._instances: dict[int, KVCacheInstance] = {}
        # The same by the connection that owns them, and by engine: every request refreshes
        # its connection's registrations, and an MLA RETRIEVE finds its leader's TP group,
        # neither by a walk over everyone's (up to MAX_REGISTRATIONS).
        self._by_owner: dict[bytes, dict[int, KVCacheInstance]] = {}
        self._by_engine: dict[bytes, dict[int, KVCacheInstance]] = {}
        # Bytes of memfd extents registered, by connection and by the uid that sent them.
        self._bytes_of_owner: Counter[bytes] = Counter()
        self._bytes_of_uid: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._instances)

    def check_room(self, owner: bytes) -> None:
        """Refuse a registration past the server's or the connection's count (BadRequest)."""
        # Each mapping holds a descriptor in this process: bounded, so no client can use up
        # the server's descriptors (and with them every other client's connections).
        check(len(self._instances) < MAX_REGISTRATIONS,
              f"the server holds {MAX_REGISTRATIONS} registrations already (MAX_REGISTRATIONS)")
        mine = len(self._by_owner.get(owner, ()))
        check(mine < MAX_REGISTRATIONS_PER_CONNECTION,
              f"this connection holds {mine} registrations already; the limit is "
              f"{MAX_REGISTRATIONS_PER_CONNECTION} (MAX_REGISTRATIONS_PER_CONNECTION): "
              f"unregister one first")

    def map_cuda_ipc(self, req: RegisterKVCacheRequest, geometry: Geometry) -> CudaMapping:
        """Open a cuda_ipc registration's allocations and set up its lane: the slow part of
        registering it, which touches nothing of the registry's, so that it can run off the
        loop (ops/session.py: on the MappingThread). Raises BadRequest, closing what it
        opened."""
        if self.cuda_ipc is None:
            raise BadRequest("`layers[0].kind`: this server has no CUDA, so it cannot "
                             "map cuda_ipc handles; register memfd handles")
        allocations = open_allocations(cast(list[CudaIpcHandle], req.layers), self.cuda_ipc)
        try:
            device = next(iter(allocations.values())).data.device
            try:
                lane = self.cuda_ipc.new_lane(device, geometry, req.store_event)
            except RuntimeError as exc:  # the event handle does not open, or no memory
                raise BadRequest(f"`store_event`: cannot set up GPU copies for this cache "
                                 f"({exc})") from None
        except BaseException:
            CudaMapping(allocations, None).close()
            raise
        return CudaMapping(allocations, lane)

    def register(self, owner: bytes, engine: bytes, req: RegisterKVCacheRequest,
                 uid: int | None = None, mapped: CudaMapping | None = None) -> KVCacheInstance:
        """Map a worker's cache for connection `owner` of `engine`, whose peer is `uid` (None:
        unknown) (access.Session); `mapped`: its map_cuda_ipc(), done already (None: done
        here). A refusal leaves every ticket it names unspent, and closes `mapped`."""
        try:
            self.check_room(owner)
            geometry, num_blocks = validate_handles(req, self.chunk_size)
        except BaseException:
            if mapped is not None:
                mapped.close()
            raise
        dtype = DTYPES[geometry.dtype]
        memfd = req.layers[0].kind == MemfdHandle.KIND
        # validate_handles: every layer is of layers[0]'s kind
        memfds = cast(list[MemfdHandle], req.layers) if memfd else []
        passed = self._usable_tickets(memfds, engine, uid) if memfd else {}
        memory = _Memory()
        stop_watching = None
        try:
            if memfd:
                sizes = {ticket: p.size for ticket, p in passed.items()}
            else:
                if mapped is None:
                    mapped = self.map_cuda_ipc(req, geometry)
                memory.allocations = mapped.allocations
                sizes = {key: a.data.numel() for key, a in memory.allocations.items()}
            ends = _layer_ends(req, dtype, sizes)
            handles = (self._map_windows(owner, memfds, ends, passed, memory) if memfd
                       else req.layers)
            instance_id = self._new_id()
            stop_watching = self._watch(req.watch, instance_id) if req.watch else None
            # Views only once nothing can fail: a segment with views cannot be closed.
            layers, stacked = memory.views(handles, dtype)
            lane = mapped.lane if mapped is not None else None
        except BaseException:  # only cuda_ipc can fail after the views exist: they hold no mmap
            if stop_watching is not None:
                stop_watching()
            for mapping in memory.mappings.values():
                mapping.close()
            if mapped is not None:
                mapped.close()
            raise
        for ticket in passed:  # registered: only now are the tickets used up
            self.tickets.spend(ticket)
        instance = KVCacheInstance(
            instance_id=instance_id, owner=owner, engine=engine, model=req.model,
            kv_world_size=req.kv_world_size, kv_worker_id=req.kv_worker_id, tp_rank=req.tp_rank,
            tp_group=req.tp_group,
            num_blocks=num_blocks, geometry=geometry, layers=layers, stacked=stacked,
            mappings=list(memory.mappings.values()), last_seen=self.clock(),
            allocations=list(memory.allocations.values()), lane=lane,
            stop_watching=stop_watching, host_rows=HostRows.of(layers, stacked, geometry.block_dim),
            prefault=memory.prefault, registered=memory.registered)
        self._add(instance)
        return instance

    def _map_windows(self, owner: bytes, memfds: list[MemfdHandle], ends: list[int],
                     passed: dict[bytes, Any], memory: _Memory) -> list[TensorHandle]:
        """Map each memfd's window (the extent its layers span) into `memory`, one at a
        time (what is mapped is there to close if the next fails); the layers' handles
        with their offsets counted from their window's start."""
        windows = self._windows(owner, memfds, ends, passed)
        for ticket, window in windows.items():
            memory.mappings[ticket], runs = window.map(passed[ticket])
            memory.prefault += [(memory.mappings[ticket], offset, length)
                                for offset, length in runs]
            memory.registered[passed[ticket].uid] += window.end - window.start
        return [replace(h, offset=h.offset - windows[h.ticket].start) for h in memfds]

    def _add(self, instance: KVCacheInstance) -> None:
        """A registered instance into the registry's indexes and counts, populating."""
        self._instances[instance.instance_id] = instance
        self._bytes_of_owner[instance.owner] += instance.registered.total()
        self._bytes_of_uid.update(instance.registered)
        for index, key in ((self._by_owner, instance.owner), (self._by_engine, instance.engine)):
            index.setdefault(key, {})[instance.instance_id] = instance
        instance.start_populating()
        geometry, layers = instance.geometry, instance.layers
        logger.info("registered instance %d: model %s, kv worker %d/%d, %d layers on %s, "
                    "%d blocks, %d bytes per chunk%s", instance.instance_id, instance.model,
                    instance.kv_worker_id, instance.kv_world_size, geometry.num_layers,
                    layers[0].device, instance.num_blocks, geometry.chunk_bytes,
                    "" if instance.stacked is not None else " (per-layer copies)")

    def _usable_tickets(self, handles: list[MemfdHandle], engine: bytes, uid: int | None
                        ) -> dict[bytes, Any]:
        """The fd channel's PassedFd for each ticket the layers name, once each is known to
        serve this session: sent by its uid and, if a binding asked for it, for its engine.
        Nothing is spent, so a refusal leaves the ticket to its rightful user."""
        passed = {}
        for i, handle in enumerate(handles):
            if handle.ticket in passed:
                continue
            path = f"`layers[{i}].ticket`"
            check(len(handle.ticket) == TICKET_BYTES, f"{path}: expected {TICKET_BYTES} bytes "
                  f"from the fd channel, got {len(handle.ticket)}")
            found = self.tickets.peek(handle.ticket)
            check(found is not None, f"{path}: unknown or expired ticket (for segment "
                  f"{handle.name[:64]!r}): send the memfd to the fd channel (HELLO's "
                  f"fd_socket) and register within a minute")
            kept = "refused, and the ticket kept for the session it serves"
            check(uid is None or found.uid == uid, f"{path}: another uid sent its memfd; a "
                  f"ticket serves only sessions of the uid that sent the descriptor ({kept})")
            check(found.engine is None or found.engine == engine, f"{path}: it was issued "
                  f"to a session of another engine; a ticket serves only the engine whose "
                  f"fd_binding asked for it ({kept})")
            check(found.engine is not None or uid is not None, f"{path}: it is bound to no "
                  f"engine (a version 1 request, {FD_CHANNEL_MAGIC!r}) and this session's uid is "
                  f"unknown (tcp://): ask for tickets with HELLO's fd_binding ({kept})")
            passed[handle.ticket] = found
        return passed

    def _windows(self, owner: bytes, handles: list[MemfdHandle], ends: list[int],
                 passed: dict[bytes, Any]) -> dict[bytes, Window]:
        """Per ticket, the window of its memfd that the layers span (`ends`: where each
        layer's bytes end). Refused for a memfd much larger than its window, or past the
        registered bytes a connection or a uid may have."""
        windows: dict[bytes, Window] = {}
        for i, (h, end) in enumerate(zip(handles, ends)):
            start = h.offset - h.offset % mmap.ALLOCATIONGRANULARITY
            window = windows.setdefault(h.ticket, Window(f"layers[{i}]", h.name, start, end))
            window.start, window.end = min(window.start, start), max(window.end, end)
        adding: Counter[int] = Counter()
        for ticket, window in windows.items():
            size, extent = passed[ticket].size, window.end - window.start
            check(size <= 2 * extent + SEGMENT_SLACK_BYTES, f"`{window.path}`: memfd "
                  f"{window.name[:64]!r} holds {size} bytes, but its layers span {extent} "
                  f"(bytes {window.start} to {window.end}); a segment may hold at most twice "
                  f"its layers' extent and {SEGMENT_SLACK_BYTES} bytes more: size it to the "
                  f"cache")
            adding[passed[ticket].uid] += extent
        mine = self._bytes_of_owner[owner]
        check(mine + adding.total() <= MAX_REGISTERED_BYTES_PER_CONNECTION,
              f"`layers`: this connection has {mine} bytes of worker memory registered; "
              f"{adding.total()} more would pass MAX_REGISTERED_BYTES_PER_CONNECTION "
              f"({MAX_REGISTERED_BYTES_PER_CONNECTION}): unregister a cache first")
        for sender, nbytes in adding.items():
            theirs = self._bytes_of_uid[sender]
            check(theirs + nbytes <= MAX_REGISTERED_BYTES_PER_UID,
                  f"`layers`: uid {sender}'s memfds are registered for {theirs} bytes; "
                  f"{nbytes} more would pass MAX_REGISTERED_BYTES_PER_UID "
                  f"({MAX_REGISTERED_BYTES_PER_UID}): unregister caches of that uid first")
        return windows

    def _watch(self, token: bytes, instance_id: int) -> Callable[[], None]:
        """Drop the registration as soon as the worker's watch connection hangs up."""
        if self.watch is None:
            raise BadRequest("`watch`: this server takes no watches")
        check(len(token) == TICKET_BYTES, f"`watch`: expected {TICKET_BYTES} bytes from the "
              f"fd channel, got {len(token)}")

        def hung_up() -> None:
            if instance_id in self._instances:
                logger.info("instance %d: its worker hung up its watch (it exited); "
                               "dropping its registration", instance_id)
                self.unregister(instance_id)
        stop = self.watch(token, hung_up)
        if stop is None:
            raise BadRequest("`watch`: unknown, expired or closed watch: open one on the fd "
                             "channel (HELLO's fd_socket) and register within a minute, keeping "
                             "it open")
        return stop

    def _new_id(self) -> int:
        # Random, so that an id a client kept from before a server restart names nothing.
        while True:
            instance_id = secrets.randbits(53) or 1  # exact in every msgpack implementation
            if instance_id not in self._instances:
                return instance_id

    def get(self, instance_id: int, owner: bytes) -> KVCacheInstance:
        """The instance, if this connection registered it."""
        instance = self._instances.get(instance_id)
        if instance is None or instance.owner != owner:
            raise UnknownInstance(f"no KV cache with instance_id {instance_id} is registered "
                                  f"by this connection; register it (again) first")
        return instance

    def owns_any(self, owner: bytes) -> bool:
        return owner in self._by_owner

    def seen(self, owner: bytes) -> None:
        mine = self._by_owner.get(owner)
        if mine:
            now = self.clock()
            for instance in mine.values():
                instance.last_seen = now

    def unregister(self, instance_id: int) -> None:
        instance = self._instances.pop(instance_id)
        _release(self._bytes_of_owner, instance.owner, instance.registered.total())
        for sender, nbytes in instance.registered.items():
            _release(self._bytes_of_uid, sender, nbytes)
        for index, key in ((self._by_owner, instance.owner), (self._by_engine, instance.engine)):
            group = index[key]
            del group[instance_id]
            if not group:
                del index[key]
        instance.closed = True
        if instance.stop_watching is not None:
            instance.stop_watching()
        if instance.copies_in_flight == 0:
            instance.unmap()
        logger.info("unregistered instance %d", instance_id)

    def copy_finished(self, instance: KVCacheInstance) -> None:
        instance.copies_in_flight -= 1
        if instance.closed and instance.copies_in_flight == 0:
            instance.unmap()

    def expired(self, timeout: float) -> list[int]:
        deadline = self.clock() - timeout
        return [i.instance_id for i in self._instances.values() if i.last_seen < deadline]

    def instance_ids(self) -> list[int]:
        return list(self._instances)

    def instances(self) -> list[KVCacheInstance]:
        return list(self._instances.values())

    def geometries(self, model: str, kv_world_size: int) -> list[Geometry] | None:
        """Each kv worker's chunk geometry, from this node's registrations; None unless every
        kv worker has registered (no one here could load a lower tier's chunks otherwise)."""
        found: dict[int, Geometry] = {}
        for instance in self._instances.values():
            if instance.model == model and instance.kv_world_size == kv_world_size:
                found[instance.kv_worker_id] = instance.geometry
        if len(found) < kv_world_size:
            return None
        return [found[worker] for worker in range(kv_world_size)]

    def tp_followers(self, leader: KVCacheInstance) -> list[KVCacheInstance]:
        """Under MLA, the other ranks of the leader's TP group: the same engine (the secret
        its sessions share) and tp_group, model, kv rank, cache shape and handle kind, so
        they take the same chunks into the same blocks. Nobody outside the engine can join."""
        if leader.geometry.layout != "mla":
            return []
        return [i for i in self._by_engine[leader.engine].values()
                if i is not leader and i.tp_rank != leader.tp_rank
                and i.tp_group == leader.tp_group and i.model == leader.model
                and i.kv_world_size == leader.kv_world_size
                and i.kv_worker_id == leader.kv_worker_id and i.geometry == leader.geometry
                and i.num_blocks == leader.num_blocks
                and (i.lane is None) == (leader.lane is None)]  # both on GPUs, or both not
