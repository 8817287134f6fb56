"""LIMITS, the table of every limit (its value and what it bounds), and a constant per row.

Each limit is defined here once, checked by the server before any work, used by the client,
and listed in docs/protocol.md from this table (tests/protocol_doc/test_tables.py checks it).
"""

from __future__ import annotations

from dataclasses import dataclass


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
    "MAX_NAME_CHARS": Limit(256, "characters of client_name, engine, tp_group, token (so of "
                            "the token files too) and a memfd handle's name"),
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
    # A worker sends its request right after connect(), usually before the server accepts:
    # a connection still silent after this is not a worker's.
    "FD_REQUEST_TIMEOUT_MS": Limit(
        500, "milliseconds an fd channel connection may wait before its request arrives"),
    "MAX_WAITING_FD_CONNECTIONS": Limit(
        64, "fd channel connections waiting for their request at once, server-wide"),
    "MAX_WAITING_FD_CONNECTIONS_PER_UID": Limit(
        16, "fd channel connections waiting for their request at once from one uid"),
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
FD_REQUEST_TIMEOUT_MS = LIMITS["FD_REQUEST_TIMEOUT_MS"].value
MAX_WAITING_FD_CONNECTIONS = LIMITS["MAX_WAITING_FD_CONNECTIONS"].value
MAX_WAITING_FD_CONNECTIONS_PER_UID = LIMITS["MAX_WAITING_FD_CONNECTIONS_PER_UID"].value
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
