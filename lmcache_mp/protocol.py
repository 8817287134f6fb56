"""The wire protocol, in one place: frames, op table, typed messages and their validation.

docs/protocol.md describes the same format for client writers. Rules for evolving it:
new fields get defaults, existing fields never change type, and HELLO carries
PROTOCOL_VERSION.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import struct
import sys
import types
import typing
from dataclasses import dataclass, field
from typing import Annotated, Any, Callable, ClassVar, NamedTuple, Union

import msgpack
import msgspec

from .errors import BadFrame, BadRequest, UnknownOp

PROTOCOL_VERSION = 2

REQUEST_ID_BYTES = 8
PUSH_REQUEST_ID = 0
STATUS_OK = b"ok"
STATUS_ERR = b"err"

CHUNK_HASH_BYTES = 16
BLOCK_ID_BYTES = 4  # int32, little-endian
SKIP_BLOCK = -1  # in RETRIEVE block_ids: leave this block of the chunk unwritten
TICKET_BYTES = 16  # a memfd handle's ticket, issued by the fd channel
BINDING_BYTES = 16  # HELLO's fd_binding: what binds the fd channel's tickets to the session

REQUEST_ID = struct.Struct("<Q")  # a request id frame: REQUEST_ID_BYTES, little-endian


# ---------------------------------------------------------------------------
# Limits: each one defined here, checked by the server before any work, used by the
# client, and listed in docs/protocol.md from this table (tests/test_protocol_doc.py).

@dataclass(frozen=True)
class Limit:
    value: int
    what: str  # what it bounds, as the docs say it


LIMITS: dict[str, Limit] = {
    "MAX_MESSAGE_BYTES": Limit(
        64 * 1024**2, "bytes in one request's frames; the server's --max-message-bytes "
        "(ZeroMQ drops a connection that sends more)"),
    "MAX_ITEMS_PER_MESSAGE": Limit(
        1024, "items in one LOOKUP, STORE, RETRIEVE or RELEASE, and elements of any one "
        "msgpack array in a request"),
    "MAX_CHUNKS_PER_MESSAGE": Limit(
        4096, "chunk hashes in one LOOKUP, STORE or RETRIEVE, summed over its items; the "
        "server's --max-chunks-per-message"),
    "MAX_LOOKUP_PROBES": Limit(
        262144, "index probes one LOOKUP may cost: its chunk hashes times kv_world_size"),
    "LOOKUP_SLICE_PROBES": Limit(
        2048, "index probes the server does for one LOOKUP before letting others run"),
    "TRANSFER_SLICE_CHUNKS": Limit(
        256, "chunks of one STORE or RETRIEVE the server prepares or settles before letting "
             "others run"),
    # The per-array limit alone lets arrays nested in arrays build a value per byte of a
    # MAX_MESSAGE_BYTES message (seconds of the loop, gigabytes). The largest valid request,
    # a REGISTER_KV_CACHE of MAX_LAYERS handles, holds about 18 values per layer.
    "MAX_REQUEST_VALUES": Limit(
        32768, "values (array elements and map entries) in one request's payload, nested "
               "ones included"),
    "MAX_MAP_FIELDS": Limit(64, "keys in any msgpack map of a request"),
    "MAX_STRING_BYTES": Limit(4096, "bytes of any msgpack string in a request"),
    "MAX_REQUEST_ID_CHARS": Limit(512, "characters of a request_id"),
    "MAX_SALT_CHARS": Limit(256, "characters of a cache_salt (printable ASCII, no spaces)"),
    "MAX_MODEL_CHARS": Limit(512, "characters of a model name"),
    "MAX_NAME_CHARS": Limit(256, "characters of client_name, engine, tp_group, token and a "
                            "memfd handle's name"),
    "MAX_LAYERS": Limit(1024, "layer handles in one REGISTER_KV_CACHE"),
    "MAX_KV_WORLD_SIZE": Limit(1024, "kv_world_size"),
    "MAX_INSTANCE_ID": Limit(2**53 - 1, "instance ids (exact in every msgpack implementation, "
                             "float64 included)"),
    "MAX_BUDGET_MS": Limit(3_600_000, "budget_ms of a STORE or RETRIEVE (0: no deadline)"),
    "MAX_FDS_PER_MESSAGE": Limit(64, "descriptors in one message on the fd channel"),
    "MAX_PENDING_TICKETS": Limit(4096, "fd channel tickets issued and not yet used by a "
                                 "REGISTER_KV_CACHE, server-wide"),
    # A quarter of the server's room for each: one uid cannot take it all from the others.
    "MAX_PENDING_TICKETS_PER_UID": Limit(1024, "fd channel tickets pending at once for the "
                                         "descriptors of one uid (the sender's)"),
    "TICKET_TTL_S": Limit(60, "seconds a ticket stays valid"),
    "MAX_SESSIONS": Limit(65536, "connections that said HELLO and are remembered"),
    "MAX_REGISTRATIONS_PER_CONNECTION": Limit(
        64, "KV caches one connection may have registered at once"),
    "MAX_REGISTRATIONS": Limit(4096, "KV caches registered at once, server-wide"),
    "MAX_WATCHES_PER_UID": Limit(1024, "fd channel watches open at once from one uid"),
    # Worker memory the server maps: the layers' extents of every memfd registered. A CPU
    # worker's whole KV cache fits in the first, a node's CPU workers in the second.
    "MAX_REGISTERED_BYTES_PER_CONNECTION": Limit(
        256 * 1024**3, "bytes of worker memory (the layers' extents of its memfds) one "
                       "connection may have registered at once"),
    "MAX_REGISTERED_BYTES_PER_UID": Limit(
        1024**4, "bytes of worker memory registered at once from the descriptors of one uid "
                 "(the fd channel's sender), over all connections"),
    "MAX_LEASES_PER_ENGINE": Limit(
        32768, "lookup holds one engine keeps at once; a new one past it releases that "
               "engine's oldest"),
    "MAX_LEASES": Limit(
        131072, "lookup holds kept at once, server-wide; past it a LOOKUP answers without "
                "taking its hold (the chunks stay evictable)"),
    "MAX_LEASED_CHUNKS_PER_ENGINE": Limit(
        1048576, "chunks (times kv workers) one engine's lookup holds keep at once; a new "
                 "hold past it releases that engine's oldest until it fits"),
    "MAX_LEASED_CHUNKS": Limit(
        4194304, "chunks (times kv workers) all lookup holds keep at once, server-wide; past "
                 "it a LOOKUP answers without taking its hold"),
    "REPLY_BACKLOG_BYTES": Limit(
        64 * 1024**2, "reply bytes kept for one connection that does not read them; past it "
                      "the server drops that connection's session and backlog"),
}
MAX_MESSAGE_BYTES = LIMITS["MAX_MESSAGE_BYTES"].value
MAX_ITEMS_PER_MESSAGE = LIMITS["MAX_ITEMS_PER_MESSAGE"].value
MAX_CHUNKS_PER_MESSAGE = LIMITS["MAX_CHUNKS_PER_MESSAGE"].value
MAX_LOOKUP_PROBES = LIMITS["MAX_LOOKUP_PROBES"].value
LOOKUP_SLICE_PROBES = LIMITS["LOOKUP_SLICE_PROBES"].value
TRANSFER_SLICE_CHUNKS = LIMITS["TRANSFER_SLICE_CHUNKS"].value
MAX_REQUEST_VALUES = LIMITS["MAX_REQUEST_VALUES"].value
MAX_MAP_FIELDS = LIMITS["MAX_MAP_FIELDS"].value
MAX_STRING_BYTES = LIMITS["MAX_STRING_BYTES"].value
MAX_REQUEST_ID_CHARS = LIMITS["MAX_REQUEST_ID_CHARS"].value
MAX_SALT_CHARS = LIMITS["MAX_SALT_CHARS"].value
MAX_MODEL_CHARS = LIMITS["MAX_MODEL_CHARS"].value
MAX_NAME_CHARS = LIMITS["MAX_NAME_CHARS"].value
MAX_LAYERS = LIMITS["MAX_LAYERS"].value
MAX_KV_WORLD_SIZE = LIMITS["MAX_KV_WORLD_SIZE"].value
MAX_INSTANCE_ID = LIMITS["MAX_INSTANCE_ID"].value
MAX_BUDGET_MS = LIMITS["MAX_BUDGET_MS"].value
MAX_FDS_PER_MESSAGE = LIMITS["MAX_FDS_PER_MESSAGE"].value
MAX_PENDING_TICKETS = LIMITS["MAX_PENDING_TICKETS"].value
MAX_PENDING_TICKETS_PER_UID = LIMITS["MAX_PENDING_TICKETS_PER_UID"].value
TICKET_TTL_S = LIMITS["TICKET_TTL_S"].value
MAX_SESSIONS = LIMITS["MAX_SESSIONS"].value
MAX_REGISTRATIONS_PER_CONNECTION = LIMITS["MAX_REGISTRATIONS_PER_CONNECTION"].value
MAX_REGISTRATIONS = LIMITS["MAX_REGISTRATIONS"].value
MAX_WATCHES_PER_UID = LIMITS["MAX_WATCHES_PER_UID"].value
MAX_REGISTERED_BYTES_PER_CONNECTION = LIMITS["MAX_REGISTERED_BYTES_PER_CONNECTION"].value
MAX_REGISTERED_BYTES_PER_UID = LIMITS["MAX_REGISTERED_BYTES_PER_UID"].value
MAX_LEASES_PER_ENGINE = LIMITS["MAX_LEASES_PER_ENGINE"].value
MAX_LEASES = LIMITS["MAX_LEASES"].value
MAX_LEASED_CHUNKS_PER_ENGINE = LIMITS["MAX_LEASED_CHUNKS_PER_ENGINE"].value
MAX_LEASED_CHUNKS = LIMITS["MAX_LEASED_CHUNKS"].value
REPLY_BACKLOG_BYTES = LIMITS["REPLY_BACKLOG_BYTES"].value

_CACHE_SALT = re.compile(r"[\x21-\x7e]{0,%d}" % MAX_SALT_CHARS)  # printable ASCII, no spaces

# Ops that need the admin role (HELLO with the admin token); every other op needs only a
# session. STATS answers both, with per-tenant detail for admins only.
ADMIN_OPS = frozenset({"CLEAR", "QUOTA_SET", "QUOTA_GET", "QUOTA_DELETE", "QUOTA_LIST"})
ROLE_ENGINE = "engine"
ROLE_ADMIN = "admin"


def is_valid_salt(salt: str) -> bool:
    """A cache_salt names a tenant: at most MAX_SALT_CHARS printable ASCII characters
    without spaces. Clients check with this; the server refuses with validate_salt."""
    return _CACHE_SALT.fullmatch(salt) is not None


def validate_salt(salt: str, path: str = "cache_salt") -> str:
    """The salt, or BadRequest (the server's refusal) naming the field."""
    if not is_valid_salt(salt):
        raise BadRequest(f"`{path}`: cache_salt must be at most {MAX_SALT_CHARS} printable "
                         f"ASCII characters without spaces, got {salt[:40]!r}")
    return salt


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
# Messages. Every op has a request and a reply class; bytes fields hold packed arrays.

@dataclass
class HelloRequest:
    """Opens the connection's session; every op but HELLO and PING needs one."""

    protocol_version: int
    client_name: str = ""
    # The server's engine token (tcp:// endpoints) or admin token (admin ops); "" on an
    # ipc:// endpoint, whose file permissions already say who may connect.
    token: str = ""
    # A secret the processes of one engine share (its scheduler and every rank): lookup
    # holds and MLA groups belong to it. "": this connection alone.
    engine: str = ""


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
    name: str = ""  # the worker's label for its segment, used in messages only
    kind: str = "memfd"


@dataclass
class CudaIpcHandle:
    """A tensor inside a worker's CUDA allocation, shared by CUDA IPC (no bytes cross the socket)."""

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
    model: str
    kv_world_size: int
    kv_worker_id: int
    layout: str  # "mha": [2, num_blocks, block_size, heads, head_dim]; "mla": [num_blocks, block_size, dim]
    block_size: int
    layers: list[TensorHandle]
    tp_rank: int = 0
    tp_group: str = ""  # names one engine's TP group, so that MLA replicas stay apart
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
    request_id: str
    chunk_hashes: bytes
    cache_salt: str = ""
    hold: bool = False

    @classmethod
    def build(cls, request_id: str, hashes: list[bytes], cache_salt: str = "",
              hold: bool = False) -> LookupItem:
        return cls(request_id, pack_hashes(hashes), cache_salt, hold)


@dataclass
class LookupRequest:
    model: str
    kv_world_size: int
    items: list[LookupItem]


@dataclass
class LookupReply:
    hits: list[int]  # per item: leading chunks stored for every kv worker


@dataclass
class TransferItem:
    """One request's chunks and the engine blocks they come from (STORE) or go to (RETRIEVE)."""

    request_id: str
    chunk_hashes: bytes
    block_ids: bytes
    cache_salt: str = ""
    # RETRIEVE: the worker's number for this load, echoed in LOAD_DONE, so that an MLA
    # follower tells a late notice of an earlier load of the request from this one's
    load_seq: int = 0
    # STORE: the hash of the prompt's chunk before chunk_hashes[0]; empty when that is the
    # prompt's first chunk. The server keeps what remains of a prompt a prefix with it.
    parent_hash: bytes = b""

    @classmethod
    def build(cls, request_id: str, hashes: list[bytes], block_ids: list[int],
              cache_salt: str = "", parent_hash: bytes = b"") -> TransferItem:
        return cls(request_id, pack_hashes(hashes), pack_block_ids(block_ids), cache_salt,
                   parent_hash=parent_hash)


@dataclass
class StoreRequest:
    instance_id: int
    items: list[TransferItem]
    # Milliseconds from the server's receipt after which it starts no more copies out of
    # the blocks (they are EXPIRED); 0: no deadline. See docs/protocol.md, "deadlines".
    budget_ms: int = 0


@dataclass
class StoreReply:
    results: list[bytes]  # per item, one StoreStatus byte per chunk


@dataclass
class RetrieveRequest:
    instance_id: int
    items: list[TransferItem]
    budget_ms: int = 0  # as StoreRequest's: no copy into the blocks starts after it
    # Non-zero: the server may copy layer by layer and push LoadProgress(progress_tag, n)
    # to the sender as the first n layers settle, so that a forward pass can start on
    # them before the reply. See docs/protocol.md, "Loads layer by layer".
    progress_tag: int = 0


@dataclass
class RetrieveReply:
    retrieved: list[int]  # per item: leading chunks written into the blocks


@dataclass
class LeaseRef:
    request_id: str
    cache_salt: str = ""


@dataclass
class ReleaseRequest:
    items: list[LeaseRef]


@dataclass
class ReleaseReply:
    released: int  # chunk holds dropped


@dataclass
class EndSessionRequest:
    request_id: str
    cache_salt: str = ""


@dataclass
class EndSessionReply:
    released: int


@dataclass
class ClearRequest:
    cache_salt: str | None = None  # None clears every tenant


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
    l2_chunks_written: int = 0
    l2_chunks_skipped: int = 0
    l2_dropped: int = 0
    l2_queue_bytes: int = 0
    l2_queue_chunks: int = 0
    l2_bytes_held: int = 0
    l2_errors: int = 0
    l2_prefetch_timeouts: int = 0


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
    cache_salt: str
    cap: int | None  # bytes; None for no cap
    reserve: int = 0


@dataclass
class QuotaGetRequest:
    cache_salt: str


@dataclass
class QuotaDeleteRequest:
    cache_salt: str


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


# ---------------------------------------------------------------------------
# Encoding: plain msgpack maps, never pickle.

def _refuse(value: Any) -> Any:
    """msgspec's hook for what it cannot encode itself: nothing else goes on the wire."""
    raise TypeError(f"cannot send a {type(value).__name__} on the wire")


# msgspec writes a dataclass as the map of its fields, in order (class-level constants
# such as ShmHandle.KIND are none of them), the same bytes as msgpack-python with
# use_bin_type, in C: 4-9x as fast as msgpack.packb with a Python hook per message. An
# Encoder keeps no state between calls: one serves every thread.
pack: Callable[[Any], bytes] = msgspec.msgpack.Encoder(enc_hook=_refuse).encode


_REQUEST_LIMITS = dict(max_array_len=MAX_ITEMS_PER_MESSAGE, max_map_len=MAX_MAP_FIELDS,
                      max_str_len=MAX_STRING_BYTES, max_ext_len=0)


# msgpack errors that carry no text of their own.
_UNPACK_REASONS = {"StackError": "arrays and maps nested more than 1024 deep",
                   "FormatError": "a byte that starts no msgpack value"}


class _ValueBudget:
    """msgpack's list_hook and object_hook: counts each container as it is built, and stops
    the decoding once the request holds more than MAX_REQUEST_VALUES values."""

    def __init__(self) -> None:
        self.left = MAX_REQUEST_VALUES

    def __call__(self, container: Any) -> Any:
        self.left -= len(container)
        if self.left < 0:
            raise BadRequest(f"payload holds more than {MAX_REQUEST_VALUES} values in its "
                             f"arrays and maps (MAX_REQUEST_VALUES)")
        return container


def unpack(cls: type, payload: bytes, bounded: bool = False) -> Any:
    """Decode and validate a payload as `cls`; errors name the field that is wrong.

    `bounded` (the server, for requests): msgpack refuses arrays, maps and strings over
    the LIMITS as it reads their headers, before building anything, and the whole payload
    over MAX_REQUEST_VALUES values as it builds them."""
    twin = _TWINS[cls] if cls in _TWINS else _twin(cls)
    if twin is not None:
        message = twin.decode(payload)
        if message is not None:
            return message
    return from_wire(cls, _decoded(payload, bounded))


def unpack_reply(cls: type, payload: bytes) -> Any:
    """Decode a reply as `cls`, for a client: msgspec builds the dataclass itself, in C, from
    what the server packed (unknown fields ignored, defaults filled in, as unpack() does);
    what it refuses goes to unpack(), which converts or names the field that is wrong. A
    LOOKUP's reply decodes in one C call instead of a dozen lines of Python, which right
    after a round trip (caches cold from the context switches) take ~5 µs."""
    decode = _DIRECT_DECODERS.get(cls)
    if decode is None:
        try:
            decode = _direct_decoder(cls)
        except TypeError:  # a type msgspec cannot build (a union of dataclasses): from now
            # on the general decoder, not a Decoder tried and refused on every reply
            decode = _DIRECT_DECODERS[cls] = functools.partial(unpack, cls)
    try:
        return decode(payload)
    except msgspec.DecodeError:  # its ValidationError too
        return unpack(cls, payload)


def _decoded(payload: bytes, bounded: bool) -> Any:
    """The payload's msgpack value (see unpack); BadRequest if it is not msgpack."""
    try:
        # Every value takes a byte at least: a payload of up to MAX_REQUEST_VALUES bytes
        # cannot hold more values, and skips the count (a Python call per array and map).
        if bounded and len(payload) > MAX_REQUEST_VALUES:
            budget = _ValueBudget()
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, list_hook=budget,
                                  object_hook=budget, **_REQUEST_LIMITS)
        elif bounded:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, **_REQUEST_LIMITS)
        else:
            raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except BadRequest:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        over = _OVER_LIMIT.search(str(exc)) if isinstance(exc, ValueError) else None
        if over is not None:  # one of _REQUEST_LIMITS, read from a header before any work
            limit = _LIMIT_OF_OPTION[over.group(2)]
            raise BadRequest(f"payload holds {_WHAT_OF_OPTION[over.group(2)].format(over.group(1))}"
                             f", more than {limit} allows ({LIMITS[limit].value}: "
                             f"{LIMITS[limit].what})") from None
        reason = str(exc) or _UNPACK_REASONS.get(type(exc).__name__,
                                                 "the data ends early or holds extra bytes")
        raise BadRequest(f"payload is not valid msgpack ({type(exc).__name__}: {reason})"
                         ) from None
    return raw


# msgpack's words when a header is over one of _REQUEST_LIMITS: "1025 exceeds max_array_len(1024)"
_OVER_LIMIT = re.compile(r"(\d+) exceeds (max_array_len|max_map_len|max_str_len)\(")
_LIMIT_OF_OPTION = {"max_array_len": "MAX_ITEMS_PER_MESSAGE", "max_map_len": "MAX_MAP_FIELDS",
                    "max_str_len": "MAX_STRING_BYTES"}
_WHAT_OF_OPTION = {"max_array_len": "an array of {} elements", "max_map_len": "a map of {} keys",
                   "max_str_len": "a string of {} bytes"}


def from_wire(tp: Any, value: Any) -> Any:
    """Validate a decoded msgpack value against a type annotation and build it."""
    try:
        return _decoder(tp)(value)
    except _Invalid as invalid:
        raise BadRequest(invalid.message()) from None


Decoder = Callable[[Any], Any]
_DECODERS: dict[Any, Decoder] = {}
_TYPE_NAMES = {int: "int", float: "float", str: "str", bool: "bool", bytes: "bytes"}
_EXACT_FLOAT_INT = 2**53


class _Invalid(Exception):
    """A value that does not fit its type. Raised where it is found, without its path:
    each array and map it leaves adds its own step, so that only a wrong value costs a
    path (a valid request with thousands of fields formats none)."""

    def __init__(self, describe: Callable[[str], str]):
        """`describe(where)`: the message, given the value's place ("`items[3].model`")."""
        self.describe = describe
        self.steps: list[str] = []

    def at(self, step: str) -> _Invalid:
        """Add the step ("[3]", ".model") from the container it is leaving."""
        self.steps.append(step)
        return self

    def message(self) -> str:
        path = "".join(reversed(self.steps)).removeprefix(".")
        return self.describe(f"`{path}`" if path else "payload")


def _describe(value: Any) -> str:
    return type(value).__name__ if value is not None else "nil"


def _mismatch(expected: str, value: Any) -> _Invalid:
    return _Invalid(lambda where: f"{where}: expected {expected}, got {_describe(value)}")


def _decoder(tp: Any) -> Decoder:
    """Build (once per type) a function that validates and converts values of `tp`."""
    decoder = _DECODERS.get(tp)
    if decoder is None:
        decoder = _DECODERS[tp] = _build_decoder(tp)
    return decoder


def _build_decoder(tp: Any) -> Decoder:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if type(None) not in options:
            return _tagged_decoder(options)
        (inner,) = [o for o in options if o is not type(None)]
        inner_decoder = _decoder(inner)
        return lambda value: None if value is None else inner_decoder(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        item_decoder = _decoder(item_tp)

        def decode_list(value: Any) -> list:
            if not isinstance(value, list):
                raise _mismatch("array", value)
            try:
                return [item_decoder(v) for v in value]
            except _Invalid as invalid:  # which item: found again, only now
                for i, v in enumerate(value):
                    try:
                        item_decoder(v)
                    except _Invalid:
                        raise invalid.at(f"[{i}]") from None
                raise
        return decode_list
    if origin is dict:
        key_decoder, value_decoder = (_decoder(t) for t in typing.get_args(tp))

        def decode_dict(value: Any) -> dict:
            if not isinstance(value, dict):
                raise _mismatch("map", value)
            decoded = {}
            for k, v in value.items():
                try:
                    key = key_decoder(k)
                except _Invalid as invalid:
                    raise invalid.at(".<key>") from None
                try:
                    decoded[key] = value_decoder(v)
                except _Invalid as invalid:
                    raise invalid.at(f".{k}") from None
            return decoded
        return decode_dict
    if dataclasses.is_dataclass(tp):
        return _dataclass_decoder(tp)
    name = _TYPE_NAMES[tp]
    if tp is float:
        def decode_float(value: Any) -> float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            raise _mismatch(name, value)
        return decode_float
    if tp is int:
        def decode_int(value: Any) -> int:
            if isinstance(value, int) and not isinstance(value, bool):
                return value
            # JavaScript's msgpack encoders send integers above 2^32 as float64.
            if isinstance(value, float) and value.is_integer() and abs(value) <= _EXACT_FLOAT_INT:
                return int(value)
            raise _mismatch(name, value)
        return decode_int

    def decode_scalar(value: Any) -> Any:
        if isinstance(value, tp):
            return value
        raise _mismatch(name, value)
    return decode_scalar


def _unsupported_kind(kind: Any, supported: str) -> _Invalid:
    return _Invalid(lambda where: f"{where}: unsupported handle kind {kind!r}; this server "
                                  f"supports {supported}").at(".kind")


def _tagged_decoder(options: tuple[type, ...]) -> Decoder:
    """A union of dataclasses told apart by their `kind` field; without one, the first."""
    by_kind = {cls.KIND: cls for cls in options}

    def decode(value: Any) -> Any:
        if not isinstance(value, dict):
            raise _mismatch("map", value)
        kind = value.get("kind", options[0].KIND)
        cls = by_kind.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise _unsupported_kind(kind, ", ".join(repr(k) for k in by_kind))
        return _decoder(cls)(value)
    return decode


def _field_types(cls: type) -> dict[str, Any]:
    """A message class's field types, its annotations resolved in its module."""
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _dataclass_decoder(cls: type) -> Decoder:
    hints = _field_types(cls)
    fields = [(f.name, hints[f.name],
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
              for f in dataclasses.fields(cls)]
    kind = getattr(cls, "KIND", None)
    # (name, the scalar type a value of which needs no decoding, decoder, required)
    field_decoders: list[tuple[str, type | None, Decoder, bool]] = []

    def decode(value: Any) -> Any:
        if not field_decoders:  # resolved on first use: fields may refer to later classes
            field_decoders.extend((n, t if t in _TYPE_NAMES else None, _decoder(t), required)
                                  for n, t, required in fields)
        if not isinstance(value, dict):
            raise _mismatch("map", value)
        if kind is not None and value.get("kind", kind) != kind:
            raise _unsupported_kind(value.get("kind"), repr(kind))
        kwargs = {}
        for name, exact, field_decoder, required in field_decoders:
            if name in value:
                field_value = value[name]
                if type(field_value) is exact:  # a scalar of its very type: as it is
                    kwargs[name] = field_value
                    continue
                try:
                    kwargs[name] = field_decoder(field_value)
                except _Invalid as invalid:
                    raise invalid.at(f".{name}") from None
            elif required:
                raise _Invalid(lambda where: f"{where}: missing").at(f".{name}")
        # Unknown fields are ignored so that newer clients can talk to this server.
        return cls(**kwargs)
    return decode


# ---------------------------------------------------------------------------
# The quick path: msgspec decodes, in C, the payloads our own clients send.

# A twin's strings are bounded in characters; UTF-8 takes at most 4 bytes a character.
_TWIN_STRING = Annotated[str, msgspec.Meta(max_length=MAX_STRING_BYTES // 4)]
_TWIN_SCALARS = {str: _TWIN_STRING, bytes: bytes, int: int, bool: bool}
_TWINS: dict[type, _Twin | None] = {}


class _Twin:
    """A message class's msgspec Struct of the same fields, in the same order, that takes
    only what the general decoder would take as it is: every value of its field's very
    type, no unknown field, strings and arrays within the LIMITS, and a payload byte for
    byte as pack() (our clients') encodes the decoded message, so that no duplicate key,
    omitted default or other encoding hides in it. Anything else goes to the general
    decoder, which converts, fills in, refuses and names what is wrong. A payload the twin
    takes, msgspec then decodes once more straight into the message class, in C: the same
    values, built without a line of Python (its dataclasses' __init__ ran a line a field,
    items included). A 64-item LOOKUP decodes ~2.5× as fast this way."""

    def __init__(self, struct: type, cls: type):
        self._decoder = msgspec.msgpack.Decoder(struct)
        self._build = _direct_decoder(cls)

    def decode(self, payload: bytes) -> Any | None:
        """The message, or None where the general decoder must decide."""
        try:
            if pack(self._decoder.decode(payload)) != payload:
                return None
            return self._build(payload)
        except msgspec.DecodeError:  # its ValidationError too
            return None


def _twin_array(item_tp: Any) -> Any:
    return Annotated[list[item_tp], msgspec.Meta(max_length=MAX_ITEMS_PER_MESSAGE)]


def _twin(cls: type) -> _Twin | None:
    """The twin of a message class (built once), or None if a field's type has none: only
    strings, bytes, ints, bools, arrays of those and arrays of messages of those have."""
    if cls not in _TWINS:
        struct = _twin_struct(cls)
        _TWINS[cls] = None if struct is None else _Twin(struct, cls)
    return _TWINS[cls]


def _twin_struct(cls: type, nested: bool = False) -> type | None:
    """The Struct of _twin(). Arrays of scalars only in the message itself, not in the
    messages of its arrays: so a twin never takes more than MAX_REQUEST_VALUES values,
    which it does not count."""
    if not dataclasses.is_dataclass(cls) or hasattr(cls, "KIND"):  # tagged: the general path
        return None
    hints = _field_types(cls)
    struct_fields: list[tuple[Any, ...]] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        item_tp = typing.get_args(tp)[0] if typing.get_origin(tp) is list else None
        if tp in _TWIN_SCALARS:
            struct_tp = _TWIN_SCALARS[tp]
        elif item_tp in _TWIN_SCALARS and not nested:
            struct_tp = _twin_array(_TWIN_SCALARS[item_tp])
        elif item_tp is not None and (item_struct := _twin_struct(item_tp, nested=True)):
            struct_tp = _twin_array(item_struct)
        else:
            return None
        if f.default_factory is not dataclasses.MISSING:
            return None
        struct_fields.append((f.name, struct_tp) if f.default is dataclasses.MISSING
                             else (f.name, struct_tp, f.default))
    return msgspec.defstruct(f"{cls.__name__}Twin", struct_fields, forbid_unknown_fields=True)


_DIRECT_DECODERS: dict[type, Callable[[bytes], Any]] = {}


def _direct_decoder(cls: type) -> Callable[[bytes], Any]:
    """msgspec's decoder straight into a message class (built once; a dataclass's fields
    are set without its __init__, which none of the messages needs). unpack_reply() keeps
    the general decoder here for a class msgspec cannot build."""
    decode = _DIRECT_DECODERS.get(cls)
    if decode is None:
        decode = _DIRECT_DECODERS[cls] = msgspec.msgpack.Decoder(cls).decode
    return decode


# ---------------------------------------------------------------------------
# Frames.

def encode_request_id(request_id: int) -> bytes:
    return REQUEST_ID.pack(request_id)


def decode_request_id(frame: bytes) -> int:
    if len(frame) != REQUEST_ID_BYTES:
        raise BadFrame(f"request_id frame must be {REQUEST_ID_BYTES} bytes, got {len(frame)}")
    return REQUEST_ID.unpack(frame)[0]


def request_id_of(frames: list[bytes]) -> int:
    """The request id of a DEALER's frames, or PUSH_REQUEST_ID when it cannot be read."""
    if frames and len(frames[0]) == REQUEST_ID_BYTES:
        return REQUEST_ID.unpack(frames[0])[0]
    return PUSH_REQUEST_ID


class RequestFrames(NamedTuple):
    """A request's frames, split: a tuple, built in one step on every request."""
    request_id: int
    op: str
    payload: bytes


_OP_BY_FRAME = {name.encode("ascii"): name for name in OPS}


def parse_request_frames(frames: list[bytes]) -> RequestFrames:
    """Split [request_id, op, payload] as sent by a DEALER; raises BadFrame or UnknownOp."""
    if len(frames) != 3:
        raise BadFrame(f"a request has 3 frames [request_id, op, payload], got {len(frames)}")
    request_id = decode_request_id(frames[0])
    if request_id == PUSH_REQUEST_ID:
        raise BadFrame(f"request_id {PUSH_REQUEST_ID} is reserved for server push messages")
    op = _OP_BY_FRAME.get(frames[1])
    if op is None:
        try:
            named = frames[1].decode("ascii")
        except UnicodeDecodeError:
            raise BadFrame("op frame is not ASCII") from None
        raise UnknownOp(f"unknown op {named[:64]!r}; known ops: {', '.join(OPS)}")
    return RequestFrames(request_id, op, frames[2])


PUSH_MESSAGES: dict[str, type] = {"LOAD_DONE": LoadDone, "LOAD_PROGRESS": LoadProgress}


def unpack_push(payload: bytes) -> LoadDone | LoadProgress:
    """A push message, of the type its `event` names; BadRequest if it is none of them."""
    raw = _decoded(payload, bounded=False)
    event = raw.get("event") if isinstance(raw, dict) else None
    return from_wire(PUSH_MESSAGES.get(event, LoadDone), raw)


def push_frames(message: Any) -> list[bytes]:
    return [encode_request_id(PUSH_REQUEST_ID), STATUS_OK, pack(message)]


@dataclass(frozen=True)
class Packed:
    """A reply packed already (off the server's loop, for a large one): sent as it is."""
    payload: bytes


def reply_frames(request_id: int, message: Any) -> list[bytes]:
    payload = message.payload if type(message) is Packed else pack(message)
    return [REQUEST_ID.pack(request_id), STATUS_OK, payload]


def error_frames(request_id: int, code: str, message: str) -> list[bytes]:
    return [encode_request_id(request_id), STATUS_ERR, pack(ErrorReply(code, message))]


# ---------------------------------------------------------------------------
# Packed arrays.

def pack_hashes(hashes: list[bytes]) -> bytes:
    return b"".join(hashes)


def check_hashes(packed: bytes, path: str) -> None:
    """BadRequest, naming the field at `path`, unless `packed` holds whole hashes."""
    if len(packed) % CHUNK_HASH_BYTES:
        raise BadRequest(f"`{path}`: length {len(packed)} is not a multiple of {CHUNK_HASH_BYTES}")


def unpack_hashes(packed: bytes, path: str) -> list[bytes]:
    check_hashes(packed, path)
    return list(split_hashes(packed))


# Up to this many hashes, split_hashes() unpacks with one cached struct format, in C:
# ~10-20 ns a hash, where slicing in a Python loop took 50-130 (a batched LOOKUP's 512
# hashes spent more time being split than being looked up).
_SPLIT_IN_C = 1024


@functools.lru_cache(maxsize=64)
def _hash_splitter(count: int) -> Callable[[bytes], tuple[bytes, ...]]:
    return struct.Struct(f"{CHUNK_HASH_BYTES}s" * count).unpack


def split_hashes(packed: bytes) -> tuple[bytes, ...]:
    """unpack_hashes() for a length already checked."""
    count = len(packed) // CHUNK_HASH_BYTES
    if count <= _SPLIT_IN_C:
        return _hash_splitter(count)(packed)
    return tuple(packed[i:i + CHUNK_HASH_BYTES] for i in range(0, len(packed), CHUNK_HASH_BYTES))


def pack_block_ids(block_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(block_ids)}i", *block_ids)


def unpack_block_ids(packed: bytes, path: str) -> list[int]:
    if len(packed) % BLOCK_ID_BYTES:
        raise BadRequest(f"`{path}`: length {len(packed)} is not a multiple of {BLOCK_ID_BYTES}")
    return list(struct.unpack(f"<{len(packed) // BLOCK_ID_BYTES}i", packed))
