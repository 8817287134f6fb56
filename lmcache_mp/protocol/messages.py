"""The messages: a typed class per request and reply, the op table, and every field's bounds.

Every op has a request and a reply class; bytes fields hold packed arrays (packed.py). A
field's range or length is declared once, on the field, by its type (Name, RequestId,
KvWorldSize, ...: msgspec.Meta in typing.Annotated), and both decoders of codec.py check
it: msgspec in C on the fast path, the general decoder with the field's path in its error.

Rules for evolving them: new fields get defaults, existing fields never change type, and
HELLO carries PROTOCOL_VERSION.
"""

# No `from __future__ import annotations`: the field types are objects at class creation,
# which the decoders read, and which typing.get_type_hints() returns from any namespace.
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from ..errors import BadRequest
from .limits import (
    MAX_BUDGET_MS,
    MAX_INSTANCE_ID,
    MAX_ITEMS_PER_MESSAGE,
    MAX_KV_WORLD_SIZE,
    MAX_LAYERS,
    MAX_MODEL_CHARS,
    MAX_NAME_CHARS,
    MAX_REQUEST_ID_CHARS,
    MAX_SALT_CHARS,
)
from .packed import pack_block_ids, pack_hashes

PROTOCOL_VERSION = 2

# Ops that need the admin role (HELLO with the admin token); every other op needs only a
# session. STATS answers both, with per-tenant detail for admins only.
ADMIN_OPS = frozenset({"CLEAR", "QUOTA_SET", "QUOTA_GET", "QUOTA_DELETE", "QUOTA_LIST"})
ROLE_ENGINE = "engine"
ROLE_ADMIN = "admin"


# ---------------------------------------------------------------------------
# Field bounds: declared on a field by its type, checked by both decoders (codec.py).

def length_in(lo: int, hi: int, unit: str = "characters",
              refusal: Callable[[str], str] | None = None) -> msgspec.Meta:
    """A str's or an array's length, lo to hi; `unit` is what errors say it counts, and
    `refusal`, if given, writes the whole error for a value out of bounds instead."""
    return msgspec.Meta(min_length=lo, max_length=hi, extra={"unit": unit, "refusal": refusal})


def value_in(lo: int, hi: int) -> msgspec.Meta:
    """An int's range, lo and hi included."""
    return msgspec.Meta(ge=lo, le=hi)


T = TypeVar("T")
Name = Annotated[str, length_in(0, MAX_NAME_CHARS)]  # client_name, token, engine, tp_group, labels
RequestId = Annotated[str, length_in(0, MAX_REQUEST_ID_CHARS)]
Model = Annotated[str, length_in(1, MAX_MODEL_CHARS)]
KvWorldSize = Annotated[int, value_in(1, MAX_KV_WORLD_SIZE)]
TpRank = Annotated[int, value_in(0, MAX_KV_WORLD_SIZE - 1)]
BudgetMs = Annotated[int, value_in(0, MAX_BUDGET_MS)]  # 0: no deadline
# A number of the client's that the server echoes (load_seq, progress_tag).
ClientNumber = Annotated[int, value_in(0, MAX_INSTANCE_ID)]
Items = Annotated[list[T], length_in(0, MAX_ITEMS_PER_MESSAGE, "items")]  # of one message

_CACHE_SALT = re.compile(rf"[\x21-\x7e]{{0,{MAX_SALT_CHARS}}}")  # printable ASCII, no spaces


def is_valid_salt(salt: str) -> bool:
    """A cache_salt names a tenant: at most MAX_SALT_CHARS printable ASCII characters
    without spaces. Clients check with this; the server refuses with validate_salt."""
    return _CACHE_SALT.fullmatch(salt) is not None


def salt_refusal(salt: str) -> str:
    """Why a salt is refused, quoting its first 40 characters (what the sender sent)."""
    return (f"cache_salt must be at most {MAX_SALT_CHARS} printable ASCII characters without "
            f"spaces, got {salt[:40]!r}")


def validate_salt(salt: str, path: str = "cache_salt") -> str:
    """The salt, or BadRequest (the server's refusal) naming the field."""
    if not is_valid_salt(salt):
        raise BadRequest(f"`{path}`: {salt_refusal(salt)}")
    return salt


# A cache_salt's length, refused as validate_salt() refuses the rest. Its characters are
# is_valid_salt()'s, which the server checks: a regular expression per item would cost
# LOOKUP's fast path more than the rest of it.
Salt = Annotated[str, length_in(0, MAX_SALT_CHARS, refusal=salt_refusal)]


# ---------------------------------------------------------------------------
# Chunk store results carried in STORE replies, one byte per chunk.

class StoreStatus:
    STORED = 0
    ALREADY_STORED = 1  # committed earlier, or being stored by another request right now
    NO_SPACE = 2  # the pool is full of chunks that are held or inside reservations
    FAILED = 3  # the copy failed
    OVER_QUOTA = 4  # the salt is at its cap with chunks that are held
    EXPIRED = 5  # its copy had not started when the STORE's budget_ms ran out
    NO_PREFIX = 6  # the prompt's chunk before it is not stored: no LOOKUP could reach it


# ---------------------------------------------------------------------------
# Requests and replies.

@dataclass
class HelloRequest:
    """Opens the connection's session; every op but HELLO and PING needs one."""

    protocol_version: int
    client_name: Name = ""
    # The server's engine token (tcp:// endpoints) or admin token (admin ops); "" on an
    # ipc:// endpoint, whose file permissions already say who may connect.
    token: Name = ""
    # A secret the processes of one engine share (its scheduler and every rank): lookup
    # holds and MLA groups belong to it. "": this connection alone.
    engine: Name = ""


@dataclass
class HelloReply:
    protocol_version: int
    server_version: str
    chunk_size: int
    max_message_bytes: int
    max_chunks_per_message: int
    lease_timeout_s: float
    worker_timeout_s: float
    role: str = ROLE_ENGINE  # what this session may do: "engine" or "admin"
    fd_socket: str = ""  # the unix socket that takes memfd descriptors (see MemfdHandle)
    max_items_per_message: int = MAX_ITEMS_PER_MESSAGE
    # This session's secret for the fd channel (an lmcache-mp-fds/2 request): the tickets
    # it issues then serve only this session's engine and uid. Empty from older servers.
    fd_binding: bytes = b""


@dataclass
class PingRequest:
    pass


@dataclass
class PingReply:
    server_time: float


@dataclass
class MemfdHandle:
    """A tensor inside a sealed memfd that the worker handed over the fd channel.

    The server never opens memory by name: the worker sends the descriptor (SCM_RIGHTS)
    to HELLO's `fd_socket` and gets a ticket for it, which this handle names. The memfd
    must carry F_SEAL_SHRINK, so that nothing the worker does later can pull pages out
    from under the server's mapping."""

    KIND: ClassVar[str] = "memfd"
    ticket: bytes  # TICKET_BYTES from the fd channel; b"" before the client has sent the fd
    offset: int  # bytes from the segment start to element [0, 0, ...]
    shape: list[int]
    strides: list[int]  # in elements, like torch.Tensor.stride()
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float16"
    name: Name = ""  # the worker's label for its segment, used in messages only
    kind: str = "memfd"


@dataclass
class CudaIpcHandle:
    """A tensor inside a worker's CUDA allocation, shared by CUDA IPC (no bytes on the socket)."""

    KIND: ClassVar[str] = "cuda_ipc"
    ipc_handle: bytes  # the allocation's cudaIpcMemHandle_t, CUDA_IPC_HANDLE_BYTES long
    offset: int  # bytes from the allocation's start to element [0, 0, ...]
    device_uuid: str  # the GPU's UUID (lmcache_mp.cuda.normalize_uuid); not CUDA_VISIBLE_DEVICES
    shape: list[int]
    strides: list[int]  # in elements, like torch.Tensor.stride()
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float16"
    kind: str = "cuda_ipc"


def span_bytes(shape: list[int], strides: list[int], itemsize: int) -> int:
    """Bytes a handle's tensor spans, from its first element to one past its last one."""
    return (sum((dim - 1) * stride for dim, stride in zip(shape, strides)) + 1) * itemsize


# A tagged union: the map's `kind` picks the class; a map without `kind` is a MemfdHandle.
TensorHandle = MemfdHandle | CudaIpcHandle
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) and sizeof(cudaIpcEventHandle_t)


@dataclass
class RegisterKVCacheRequest:
    model: Model
    kv_world_size: KvWorldSize
    kv_worker_id: int
    # "mha": layers of [2, num_blocks, block_size, heads, head_dim]; "mla": [num_blocks,
    # block_size, dim]; "state": [num_blocks, state_size], block_size the chunk size
    layout: str
    block_size: int
    layers: Annotated[list[TensorHandle], length_in(1, MAX_LAYERS, "handles")]
    tp_rank: TpRank = 0
    tp_group: Name = ""  # names one engine's TP group, so that MLA replicas stay apart
    # cuda_ipc only: the cudaIpcEventHandle_t of an interprocess event the worker records on
    # its stream before each STORE; the server's copies wait on it. Empty: nothing to wait on.
    store_event: bytes = b""
    # A watch from the fd channel (TICKET_BYTES), held open by the worker: when it hangs up,
    # the registration ends at once. Empty: it ends at UNREGISTER or worker_timeout_s.
    watch: bytes = b""


@dataclass
class RegisterKVCacheReply:
    instance_id: int
    num_blocks: int
    blocks_per_chunk: int
    chunk_bytes: int


@dataclass
class UnregisterKVCacheRequest:
    instance_id: int


@dataclass
class UnregisterKVCacheReply:
    pass


@dataclass
class LookupItem:
    request_id: RequestId
    chunk_hashes: bytes
    cache_salt: Salt = ""
    hold: bool = False

    @classmethod
    def build(cls, request_id: str, hashes: list[bytes], cache_salt: str = "",
              hold: bool = False) -> "LookupItem":
        return cls(request_id, pack_hashes(hashes), cache_salt, hold)


@dataclass
class LookupRequest:
    model: Model
    kv_world_size: KvWorldSize
    items: Items[LookupItem]
    tiers: bool = False  # ask for LookupReply.hit_tiers (a server that predates it ignores it)
    # packed kv worker ids (pack_worker_ids) whose chunks are snapshots of the prefix at
    # their chunk's end (a recurrent state): a hit needs theirs at its last chunk only
    # (docs/protocol.md, LOOKUP); empty: none
    snapshot_workers: bytes = b""


@dataclass
class LookupReply:
    hits: list[int]  # per item: leading chunks stored for every kv worker
    # Asked for (LookupRequest.tiers): per item, where its hits were when the LOOKUP came,
    # [in the server's memory, read back from disk, pulled from L2], summing to its hits.
    # Left out (UNSET) when not asked for or not counted (a sliced LOOKUP that read back).
    hit_tiers: list[list[int]] | msgspec.UnsetType = msgspec.UNSET


@dataclass
class TransferItem:
    """One request's chunks and the engine blocks they come from (STORE) or go to (RETRIEVE)."""

    request_id: RequestId
    chunk_hashes: bytes
    block_ids: bytes
    cache_salt: Salt = ""
    # RETRIEVE: the worker's number for this load, echoed in LOAD_DONE, so that an MLA
    # follower tells a late notice of an earlier load of the request from this one's
    load_seq: ClientNumber = 0
    # STORE: the hash of the prompt's chunk before chunk_hashes[0]; empty when that is the
    # prompt's first chunk. The server keeps what remains of a prompt a prefix with it.
    parent_hash: bytes = b""

    @classmethod
    def build(cls, request_id: str, hashes: list[bytes], block_ids: list[int],
              cache_salt: str = "", parent_hash: bytes = b"") -> "TransferItem":
        return cls(request_id, pack_hashes(hashes), pack_block_ids(block_ids), cache_salt,
                   parent_hash=parent_hash)


@dataclass
class StoreRequest:
    instance_id: int
    items: Items[TransferItem]
    # Milliseconds from the server's receipt after which it starts no more copies out of
    # the blocks (they are EXPIRED); 0: no deadline. See docs/protocol.md, "deadlines".
    budget_ms: BudgetMs = 0


@dataclass
class StoreReply:
    results: list[bytes]  # per item, one StoreStatus byte per chunk


@dataclass
class RetrieveRequest:
    instance_id: int
    items: Items[TransferItem]
    budget_ms: BudgetMs = 0  # as StoreRequest's: no copy into the blocks starts after it
    # Non-zero: the server may copy layer by layer and push LoadProgress(progress_tag, n)
    # to the sender as the first n layers settle, so that a forward pass can start on
    # them before the reply. See docs/protocol.md, "Loads layer by layer".
    progress_tag: ClientNumber = 0


@dataclass
class RetrieveReply:
    retrieved: list[int]  # per item: leading chunks written into the blocks


@dataclass
class LeaseRef:
    request_id: RequestId
    cache_salt: Salt = ""


@dataclass
class ReleaseRequest:
    items: Items[LeaseRef]


@dataclass
class ReleaseReply:
    released: int  # chunk holds dropped


@dataclass
class EndSessionRequest:
    request_id: RequestId
    cache_salt: Salt = ""


@dataclass
class EndSessionReply:
    released: int


@dataclass
class ClearRequest:
    cache_salt: Salt | None = None  # None clears every tenant


@dataclass
class ClearReply:
    removed: int


@dataclass
class StatsRequest:
    pass


@dataclass
class TenantStats:
    """One cache_salt's share; cap None means no cap."""

    bytes_used: int
    chunks: int
    cap: int | None
    reserve: int
    hits: int
    misses: int
    evictions: int
    refused: int  # chunks a STORE could not place
    disk_bytes: int = 0  # its chunks' bytes in the disk tier (--disk-dir), under the same cap
    disk_chunks: int = 0


@dataclass
class InstanceStats:
    """One registered KV cache, and the transfers it asked for or received."""

    instance_id: int
    model: str
    kv_world_size: int
    kv_worker_id: int
    tp_rank: int
    stores: int  # STORE requests it sent
    retrieves: int  # RETRIEVE requests it sent
    loads_pushed: int  # LOAD_DONE notices it was sent as an MLA follower


@dataclass
class Histogram:
    """Observations in seconds: counts[i] fell in (bounds[i-1], bounds[i]]; the last count,
    above every bound."""

    bounds: list[float]
    counts: list[int]
    total: float  # the sum of the observations


@dataclass
class StatsReply:
    chunks: int
    bytes_used: int
    capacity_bytes: int
    hits: int
    misses: int
    evictions: int
    leases_held: int
    pending_stores: int
    registrations: int
    requests: dict[str, int] = field(default_factory=dict)  # op name -> requests served
    prefault_done: bool = True
    tenants: dict[str, TenantStats] = field(default_factory=dict)  # by cache_salt
    instances: list[InstanceStats] = field(default_factory=list)
    gpu_capacity_bytes: int = 0  # the GPU tier's share of capacity_bytes (--gpu-size)
    gpu_bytes_used: int = 0  # the GPU tier's share of bytes_used
    cpu_seconds: float = 0.0  # the server process's user + system CPU time since start
    peak_rss_bytes: int = 0  # the server process's peak resident set size
    pinned_bytes: int = 0  # bytes of the CPU pool pinned for GPU copies so far
    # op name -> outcome ("ok", or the error code replied) -> requests answered
    outcomes: dict[str, dict[str, int]] = field(default_factory=dict)
    latency: dict[str, Histogram] = field(default_factory=dict)  # op name -> seconds to reply
    copy_time: dict[str, Histogram] = field(default_factory=dict)  # "store"/"retrieve" copies
    bytes_stored: int = 0  # bytes of chunks STORE placed in the cache
    bytes_retrieved: int = 0  # bytes RETRIEVE copied into KV caches
    evictions_by_cause: dict[str, int] = field(default_factory=dict)  # see docs/operations.md
    clients: int = 0  # connections with a session (said HELLO, not yet expired)
    holds_refused: int = 0  # LOOKUP holds not taken: the server-wide lease limits were met
    loop_lag_seconds: float = 0.0  # how late the event loop last woke for a timer
    # The L2 tier (--l2; all 0 without one): lmcache_mp.server.l2.base.L2Counters, by name.
    l2_enabled: bool = False
    l2_up: bool = False
    l2_hits: int = 0
    l2_misses: int = 0
    l2_corrupt: int = 0
    l2_bytes_read: int = 0
    l2_bytes_written: int = 0
    l2_zero_copy_bytes: int = 0
    l2_chunks_written: int = 0
    l2_chunks_skipped: int = 0
    l2_dropped: int = 0
    l2_queue_bytes: int = 0
    l2_queue_chunks: int = 0
    l2_bytes_held: int = 0
    l2_errors: int = 0
    l2_prefetch_timeouts: int = 0
    # The disk tier (--disk-dir; all 0 without one): server.disk.space.DiskCounters, by name,
    # and the seconds each read-back window's reads took.
    disk_enabled: bool = False
    disk_capacity_bytes: int = 0
    disk_bytes_used: int = 0
    disk_chunks: int = 0
    disk_hits: int = 0
    disk_misses: int = 0
    disk_corrupt: int = 0
    disk_bytes_read: int = 0
    disk_bytes_written: int = 0
    disk_chunks_written: int = 0
    disk_chunks_skipped: int = 0
    disk_dropped: int = 0
    disk_over_budget: int = 0
    disk_evictions: int = 0
    disk_queue_bytes: int = 0
    disk_queue_chunks: int = 0
    disk_write_busy_seconds: float = 0.0
    disk_read_errors: int = 0
    disk_write_errors: int = 0
    disk_prefetch_timeouts: int = 0
    disk_writing: bool = False
    disk_loaded: bool = False
    disk_loaded_chunks: int = 0
    disk_index_bytes: int = 0
    disk_salts: int = 0
    disk_salts_reclaimed: int = 0
    disk_salts_examined: int = 0
    disk_read_time: Histogram | None = None


@dataclass
class QuotaInfo:
    """The quota that applies to a salt; `own` is false when it is the default."""

    cache_salt: str
    cap: int | None
    reserve: int
    own: bool
    bytes_used: int


@dataclass
class QuotaSetRequest:
    cache_salt: Salt
    cap: int | None  # bytes; None for no cap
    reserve: int = 0


@dataclass
class QuotaGetRequest:
    cache_salt: Salt


@dataclass
class QuotaDeleteRequest:
    cache_salt: Salt


@dataclass
class QuotaListRequest:
    pass


@dataclass
class QuotaListReply:
    default_cap: int | None
    quotas: list[QuotaInfo]  # every salt with a quota of its own


# ---------------------------------------------------------------------------
# Push messages: sent by the server with request id 0, status ok, unasked.

@dataclass
class LoadDoneItem:
    request_id: str
    cache_salt: str
    retrieved: int  # leading chunks now in this rank's blocks
    load_seq: int = 0  # the RETRIEVE item's load_seq


@dataclass
class LoadDone:
    """To an MLA follower: the leader's RETRIEVE has landed in this rank's blocks too."""

    instance_id: int  # the follower's own registration
    items: list[LoadDoneItem]
    event: str = "LOAD_DONE"


@dataclass
class LoadProgress:
    """To a RETRIEVE's sender that set progress_tag: the server writes no more into the
    first `layers` layers (in registration order) of that RETRIEVE's blocks. Which chunks
    landed is in the reply; a layer that settled may hold a failed chunk."""

    tag: int  # the RETRIEVE's progress_tag
    layers: int
    event: str = "LOAD_PROGRESS"


PUSH_MESSAGES: dict[str, type] = {"LOAD_DONE": LoadDone, "LOAD_PROGRESS": LoadProgress}


@dataclass(frozen=True)
class OpSpec:
    request: type
    reply: type


OPS: dict[str, OpSpec] = {
    "HELLO": OpSpec(HelloRequest, HelloReply),
    "PING": OpSpec(PingRequest, PingReply),
    "REGISTER_KV_CACHE": OpSpec(RegisterKVCacheRequest, RegisterKVCacheReply),
    "UNREGISTER_KV_CACHE": OpSpec(UnregisterKVCacheRequest, UnregisterKVCacheReply),
    "LOOKUP": OpSpec(LookupRequest, LookupReply),
    "STORE": OpSpec(StoreRequest, StoreReply),
    "RETRIEVE": OpSpec(RetrieveRequest, RetrieveReply),
    "RELEASE": OpSpec(ReleaseRequest, ReleaseReply),
    "END_SESSION": OpSpec(EndSessionRequest, EndSessionReply),
    "CLEAR": OpSpec(ClearRequest, ClearReply),
    "STATS": OpSpec(StatsRequest, StatsReply),
    "QUOTA_SET": OpSpec(QuotaSetRequest, QuotaInfo),
    "QUOTA_GET": OpSpec(QuotaGetRequest, QuotaInfo),
    "QUOTA_DELETE": OpSpec(QuotaDeleteRequest, QuotaInfo),
    "QUOTA_LIST": OpSpec(QuotaListRequest, QuotaListReply),
}

_OP_BY_REQUEST_TYPE = {spec.request: name for name, spec in OPS.items()}


def op_name(request: Any) -> str:
    return _OP_BY_REQUEST_TYPE[type(request)]


@dataclass
class ErrorReply:
    code: str
    message: str
