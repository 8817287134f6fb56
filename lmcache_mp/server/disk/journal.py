"""The journal of chunks on disk: authenticated fixed-size records, appended, replayed, compacted.

The journal is a file of 128-byte records (format 3), each naming one chunk whose bytes are
already in the tier's data file (the writer syncs the bytes before it appends their
records), or one chunk that left the tier (a removal):

    magic b"LMCD", format (u16), kind (u16, 1: a chunk, 2: a removal), key (16 bytes),
    parent (16 bytes: the key of the chunk before it in its prompt, zeros for none), salt
    (8 bytes: the cache_salt's digest), offset (u64, in the data file, 4096-aligned),
    nbytes (u32), the chunk's MAC (u32: a keyed BLAKE3 of its disk key and its bytes, cut
    to 32 bits, ChunkMac; zero in a removal), sequence (u64: the record's place in the
    file), 40 zero bytes, then a keyed BLAKE2b-128 MAC of the 112 bytes before it

Records are never rewritten in place: a chunk written again, or an extent reused, gets a
new record, and replay lets the later one win (same key: it replaces the earlier; an
overlapping extent: the earlier's bytes were overwritten). A removal names the key and
the extent of a chunk that left the tier (evicted, cleared, over its salt's cap, or failed
its read): it kills the key's earlier record, and is itself no chunk. The writer makes a
removal durable before any byte is written into the extent it frees, so no synced record
ever names bytes its chunk did not have. When the file holds many more records than live
chunks, the writer rewrites it from the index's live records into a new file renamed over
the old one, so a crash leaves one or the other, whole (the removals are gone from it:
their chunks are not among the live records).

The MACs are keyed by a secret the tier keeps outside its directory (--disk-key-file, or
the server's runtime directory, see tier.py): a journal or a names file from another
directory, or written by anyone else, replays as nothing (counted apart, `unsigned`, when
it is whole and of this format), and so does a record of another format (those of
formats 1 and 2 are bad records). The sequence must equal the record's place, so a record copied
elsewhere in the file is refused too. A crash can leave a torn last record: opening the
journal cuts it off, so the next append lands right after the last whole one. Replay reads
the file in blocks of REPLAY_BLOCK records and keeps only the good ones, and at most the
last `limit` records of it (what the tier's capacity allows, tier.py): a damaged or padded
journal costs no more memory than a valid one.

The cache_salt strings themselves go into a second small file (SaltNames), so that quotas
find their tenants again after a restart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

from ..cache.pool import ALIGNMENT  # data-file offsets are multiples of it (O_DIRECT)
from ..private_dir import PrivateDir

logger = logging.getLogger("lmcache_mp.server.disk")

CHUNK_RECORD_BYTES = 128
FORMAT_VERSION = 3
MAGIC = b"LMCD"
KIND_CHUNK = 1
KIND_REMOVED = 2
SALT_DIGEST_BYTES = 8
MAX_SALT_NAME = 256

_RECORD = np.dtype([
    ("magic", "S4"), ("version", "<u2"), ("kind", "<u2"), ("key", "<u8", (2,)),
    ("parent", "<u8", (2,)), ("salt", "<u8"), ("offset", "<u8"), ("nbytes", "<u4"),
    ("chunk_mac", "<u4"), ("sequence", "<u8"), ("reserved", "u1", (40,)), ("mac", "<u8", (2,)),
])
_MAC_BYTES = 16
# The index keeps a chunk's MAC in 4 bytes of its row. Enough: no one without the key can
# compute one, so a forgery is a guess that only a read-back checks, and a wrong guess
# drops the chunk: each try needs its victim to store the chunk again.
CHUNK_MAC_BYTES = 4
_CHUNK_MAC_CONTEXT = "lmcache-mp disk tier 2026-12 chunk bytes MAC"
_SIGNED_BYTES = CHUNK_RECORD_BYTES - _MAC_BYTES  # the MAC comes last
assert _RECORD.itemsize == CHUNK_RECORD_BYTES
# Offsets at or beyond this (16 TiB) are refused on replay: the index keeps offsets in
# 4096-byte units in 32 bits, and replay sorts by (offset units, place) packed in 64.
_MAX_OFFSET = ALIGNMENT << 32
# rewrite() encodes and writes this many records at a time, so compacting a large journal
# needs a few MiB of buffer, not a copy of the file.
_REWRITE_BATCH = 1 << 16
# Overlapping pairs replay examines at a time: bounded memory for any history.
_PAIR_BATCH = 1 << 22
# Records replay reads, checks and sifts at a time: 8 MiB of file, whatever its length.
REPLAY_BLOCK = 1 << 16
# A removal as the writer queues it: the key and the extent of a chunk that left the tier.
_REMOVAL = np.dtype([("key", "<u8", (2,)), ("offset", "<i8"), ("nbytes", "<i8")])


def _hasher(secret: bytes, person: bytes) -> hashlib.blake2b:
    # `person` separates the two files' MACs: an entry of one never verifies as the other's.
    return hashlib.blake2b(key=secret, digest_size=_MAC_BYTES, person=person)


class ChunkMac:
    """The MAC of a chunk's bytes: BLAKE3 in its keyed mode over its disk key and its
    bytes, cut to CHUNK_MAC_BYTES, under a key derived from the secret for this use alone
    (BLAKE3's own derive_key mode); only a holder of the secret makes bytes that verify,
    and only under the key they were written for. BLAKE3, not HMAC-SHA256 (format 2):
    every byte written or read back goes through it, and even against the CPU's SHA
    instructions it hashes over twice as fast a thread (3.7 against 1.6 GB/s on the
    project's machine), which on a node with few free cores is the tier's bandwidth. Any
    thread may call of(): each call hashes a copy of the keyed state, without the GIL."""

    def __init__(self, secret: bytes):
        derived = blake3.blake3(secret, derive_key_context=_CHUNK_MAC_CONTEXT).digest()
        self._base = blake3.blake3(key=derived)

    def of(self, key: bytes, data: bytes | memoryview) -> int:
        mac = self._base.copy()
        mac.update(key)
        mac.update(data)
        return int.from_bytes(mac.digest(CHUNK_MAC_BYTES), "little")


def salt_digest(cache_salt: str) -> bytes:
    """The 8 bytes a journal record names its chunk's cache_salt by."""
    return hashlib.blake2b(cache_salt.encode(), digest_size=SALT_DIGEST_BYTES,
                           person=b"lmcd-salt").digest()


@dataclass(frozen=True)
class ChunkRecord:
    """One chunk whose bytes are on disk: what its journal record says."""

    key: bytes  # 16 bytes
    parent: bytes  # 16 bytes; zeros: the first chunk of its prompt
    salt: bytes  # salt_digest(cache_salt)
    offset: int  # in the data file, a multiple of 4096
    nbytes: int
    mac: int  # ChunkMac.of(key, the chunk's bytes)


@dataclass
class Replayed:
    """Chunk records as columns, oldest first: what replay found alive, or what the index
    holds (DiskIndex.live(), for Journal.rewrite)."""

    keys: np.ndarray  # (n, 2) uint64: a key's 16 bytes as two little-endian halves
    parents: np.ndarray  # (n, 2) uint64, likewise; zeros: none
    salts: np.ndarray  # (n,) uint64: the salt digest's 8 bytes, little-endian
    offsets: np.ndarray  # (n,) int64
    nbytes: np.ndarray  # (n,) int64
    macs: np.ndarray  # (n,) uint32: ChunkMac.of each chunk
    read: int = 0  # whole records replay looked at
    bad: int = 0  # records refused: not a record, another format, a MAC that fails
    unsigned: int = 0  # of the bad ones, records whole and of this format whose MAC fails
    superseded: int = 0  # good records a later one replaced, overwrote or removed, and removals
    skipped: int = 0  # records before the last `limit` ones, not looked at

    def __len__(self) -> int:
        return len(self.offsets)

    @classmethod
    def empty(cls) -> Replayed:
        return cls(np.zeros((0, 2), np.uint64), np.zeros((0, 2), np.uint64),
                   np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int64),
                   np.zeros(0, np.uint32))

    def select(self, which: np.ndarray | slice) -> Replayed:
        """The rows `which` picks (a mask, indices or a slice), counts left at zero."""
        return Replayed(self.keys[which], self.parents[which], self.salts[which],
                        self.offsets[which], self.nbytes[which], self.macs[which])


class Removals:
    """Chunks that left the tier whose removal records are not yet in the journal, oldest
    first (the loop adds, the writer takes): 32 bytes a chunk, no object. `made` counts
    every removal added, `durable` those now in the journal, synced (or given up on in a
    tier that writes nothing)."""

    _ENTRY = struct.Struct("<16sqq")

    def __init__(self) -> None:
        self._rows = bytearray()
        self.made = 0
        self.durable = 0

    def __len__(self) -> int:
        return len(self._rows) // self._ENTRY.size

    def add(self, key: bytes, offset: int, nbytes: int) -> None:
        self._rows += self._ENTRY.pack(key, offset, nbytes)
        self.made += 1

    def take(self) -> np.ndarray:
        """Every removal queued, as rows for Journal.append, and none left queued."""
        rows = np.frombuffer(bytes(self._rows), _REMOVAL)
        self._rows.clear()
        return rows

    def put_back(self, rows: np.ndarray) -> None:
        """Removals taken whose append failed: queued again, before those added since."""
        self._rows[:0] = rows.tobytes()

    def recorded(self, rows: np.ndarray) -> None:
        self.durable += len(rows)


class Journal:
    """The journal file, open. append() and rewrite() run on one thread at a time (the
    tier's write threads take a lock around them); replay() before the first of them, at
    start-up."""

    def __init__(self, fd: int, secret: bytes, directory: PrivateDir, name: str,
                 read_only: bool = False):
        """`fd`: the journal, open for reading and writing (or only reading); a torn last
        record (a crash during an append) is cut off here (or, read only, ignored)."""
        self.fd = fd
        self._directory = directory
        self._name = name
        self._mac = _hasher(secret, b"lmcd-chunk")
        self._end = _whole(fd, CHUNK_RECORD_BYTES, read_only)

    @classmethod
    def open(cls, directory: PrivateDir, name: str, secret: bytes,
             read_only: bool = False) -> Journal:
        """The journal `name` in `directory`, created empty if there is none (read only:
        FileNotFoundError); raises UnsafePath for a file there that is not the server's
        own."""
        return cls(_open(directory, name, read_only), secret, directory, name, read_only)

    @property
    def records(self) -> int:
        """Records in the file now, live or not."""
        return self._end // CHUNK_RECORD_BYTES

    def append(self, records: Sequence[ChunkRecord], removals: np.ndarray | None = None
               ) -> None:
        """Record removals (Removals.take()'s rows) and chunks whose bytes are on disk
        (synced), the removals first: one write, then fdatasync. Raises OSError; then none
        of them counts as recorded (the file is cut back)."""
        parts = []
        if removals is not None and len(removals):
            n = len(removals)
            gone = Replayed(removals["key"], np.zeros((n, 2), np.uint64),
                            np.zeros(n, np.uint64), removals["offset"], removals["nbytes"],
                            np.zeros(n, np.uint32))
            parts.append(self._encode(gone, self.records, KIND_REMOVED))
        if records:
            columns = Replayed(
                _halves([r.key for r in records], 16), _halves([r.parent for r in records], 16),
                _halves([r.salt for r in records], SALT_DIGEST_BYTES).reshape(-1),
                np.array([r.offset for r in records], np.int64),
                np.array([r.nbytes for r in records], np.int64),
                np.array([r.mac for r in records], np.uint32))
            placed = self.records + sum(len(part) for part in parts) // CHUNK_RECORD_BYTES
            parts.append(self._encode(columns, placed))
        if not parts:
            return
        data = b"".join(parts)
        try:
            _write_all(self.fd, data, self._end)
            os.fdatasync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, self._end)
            except OSError:
                pass  # a torn or unsynced tail is cut off or overwritten later anyway
            raise
        self._end += len(data)

    def _encode(self, columns: Replayed, first_sequence: int, kind: int = KIND_CHUNK
                ) -> bytearray:
        n = len(columns)
        offsets, nbytes = columns.offsets, columns.nbytes
        if np.any(offsets % ALIGNMENT) or np.any(offsets < 0) or np.any(offsets >= _MAX_OFFSET) \
                or np.any(nbytes <= 0) or np.any(nbytes >= 1 << 32):
            raise ValueError("a chunk record needs a 4096-aligned offset below 16 TiB and 1 "
                             "to 2**32-1 bytes")
        table = np.zeros(n, _RECORD)
        table["magic"] = MAGIC
        table["version"] = FORMAT_VERSION
        table["kind"] = kind
        table["key"] = columns.keys
        table["parent"] = columns.parents
        table["salt"] = columns.salts
        table["offset"] = columns.offsets
        table["nbytes"] = columns.nbytes
        table["chunk_mac"] = columns.macs
        table["sequence"] = np.arange(first_sequence, first_sequence + n, dtype=np.uint64)
        data = bytearray(table.tobytes())
        view = memoryview(data)
        for start in range(0, len(data), CHUNK_RECORD_BYTES):
            mac = self._mac.copy()
            mac.update(view[start:start + _SIGNED_BYTES])
            view[start + _SIGNED_BYTES:start + CHUNK_RECORD_BYTES] = mac.digest()
        return data

    def replay(self, limit: int | None = None) -> Replayed:
        """The live chunks the journal records, oldest first, from at most its last `limit`
        records (None: all). A record that is not whole, not of this format, or not signed
        with this journal's secret is bad and skipped (the records after it still count);
        of the good ones, a later record for the same key (a chunk or a removal) replaces
        the earlier, and a later record whose extent overlaps an earlier's kills the
        earlier (its bytes were overwritten); removals themselves are no chunks. The file
        is read REPLAY_BLOCK records at a time, and only good records are kept."""
        total = self.records
        first = 0 if limit is None else max(0, total - limit)
        if first:
            logger.warning("disk journal %s holds %d records, more than a tier of this size "
                           "writes before it compacts its journal (%d): only the last %d are "
                           "replayed", self._directory.path / self._name, total, limit, limit)
        kept, unsigned = [], 0
        for start in range(first, total, REPLAY_BLOCK):
            table, failed = self._good_block(start, min(REPLAY_BLOCK, total - start))
            unsigned += failed
            if len(table):
                kept.append(table)
        table = np.concatenate(kept) if kept else np.zeros(0, _RECORD)
        offsets = table["offset"].astype(np.int64)
        nbytes = table["nbytes"].astype(np.int64)
        keys = table["key"]
        alive = _last_of_each_key(keys) & ~_overwritten(offsets, nbytes) \
            & (table["kind"] == KIND_CHUNK)
        rows = table[alive]
        read = total - first
        return Replayed(rows["key"], rows["parent"], rows["salt"], offsets[alive],
                        nbytes[alive], rows["chunk_mac"], read=read, bad=read - len(table),
                        unsigned=unsigned, superseded=len(table) - len(rows), skipped=first)

    def _good_block(self, start: int, count: int) -> tuple[np.ndarray, int]:
        """Records `start` to `start + count` that are good: whole, of this format, in their
        place, signed (a copy: the block's buffer is let go); and how many of them were all
        of that but signed with another key."""
        raw = _read_all(self.fd, count * CHUNK_RECORD_BYTES, start * CHUNK_RECORD_BYTES)
        del raw[len(raw) - len(raw) % CHUNK_RECORD_BYTES:]
        table = np.frombuffer(raw, _RECORD)
        n = len(table)
        good = ((table["magic"] == MAGIC) & (table["version"] == FORMAT_VERSION)
                & ((table["kind"] == KIND_CHUNK) | (table["kind"] == KIND_REMOVED))
                & (table["sequence"] == np.arange(start, start + n, dtype=np.uint64))
                & (table["offset"] % ALIGNMENT == 0) & (table["offset"] < _MAX_OFFSET)
                & (table["nbytes"] > 0))
        candidates = np.flatnonzero(good)
        signed = self._macs_match(raw, candidates, table["mac"][candidates])
        good[candidates] = signed
        return table[good].copy(), len(candidates) - int(np.count_nonzero(signed))

    def _macs_match(self, raw: bytearray, rows: np.ndarray, macs: np.ndarray) -> np.ndarray:
        # The one loop a record: hashlib has no batch form, and a copy of the keyed state
        # saves re-keying each time (about 1 µs a record).
        view = memoryview(raw)
        base = self._mac

        def mac(start: int) -> bytes:
            each = base.copy()
            each.update(view[start:start + _SIGNED_BYTES])
            return each.digest()

        starts = rows * CHUNK_RECORD_BYTES
        computed = np.frombuffer(b"".join([mac(start) for start in starts.tolist()]),
                                 "<u8").reshape(-1, 2)
        return (macs[:, 0] == computed[:, 0]) & (macs[:, 1] == computed[:, 1])

    def rewrite(self, columns: Replayed) -> None:
        """Replace the journal with `columns` (the live records, oldest first): written to
        a new file, synced, renamed over the journal, the directory synced. Until the
        rename the old journal stays as it was; raises OSError (the journal is then the
        old one, still open, or the new one if only the directory's sync failed)."""
        temporary = self._name + ".new"
        directory = self._directory
        directory.unlink(temporary)  # a crash's leftover
        fd = directory.create(temporary)
        try:
            for start in range(0, len(columns), _REWRITE_BATCH):
                part = columns.select(slice(start, start + _REWRITE_BATCH))
                _write_all(fd, self._encode(part, start), start * CHUNK_RECORD_BYTES)
            os.fdatasync(fd)
            directory.replace(temporary, self._name)
        except BaseException:
            os.close(fd)
            directory.unlink(temporary)
            raise
        old, self.fd = self.fd, fd
        self._end = len(columns) * CHUNK_RECORD_BYTES
        os.close(old)
        directory.sync()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open(directory: PrivateDir, name: str, read_only: bool) -> int:
    if read_only:
        return directory.open(name, os.O_RDONLY)
    try:
        return directory.open(name, os.O_RDWR)
    except FileNotFoundError:
        fd = directory.create(name)
        directory.sync()
        return fd


def _whole(fd: int, entry_bytes: int, read_only: bool) -> int:
    """The file's length in whole entries; the rest (a crash's torn last write) is cut
    off, or only ignored in a file open read only."""
    size = os.fstat(fd).st_size
    whole = size - size % entry_bytes
    if whole != size and not read_only:
        os.ftruncate(fd, whole)
    return whole


def _halves(values: list[bytes], width: int) -> np.ndarray:
    """Fixed-width byte strings as rows of little-endian uint64s; ValueError for any
    other width."""
    joined = b"".join(values)
    if len(joined) != width * len(values) or any(len(value) != width for value in values):
        raise ValueError(f"expected {width}-byte keys and salts")
    return np.frombuffer(joined, "<u8").reshape(-1, width // 8)


def _last_of_each_key(keys: np.ndarray) -> np.ndarray:
    """Which rows of `keys` ((n, 2), oldest first) no later row repeats. Sorting by the
    first halves alone is fast; only rows that share a first half (a key written again)
    are sorted by whole key and place."""
    n = len(keys)
    order = np.argsort(keys[:, 0])
    firsts = keys[order, 0]
    shared = np.zeros(n, bool)
    same = firsts[1:] == firsts[:-1]
    shared[1:] |= same
    shared[:-1] |= same
    alive = np.ones(n, bool)
    rows = order[shared]
    exact = rows[np.lexsort((rows, keys[rows, 1], keys[rows, 0]))]
    ordered = keys[exact]
    last = np.ones(len(exact), bool)
    last[:-1] = (ordered[1:, 0] != ordered[:-1, 0]) | (ordered[1:, 1] != ordered[:-1, 1])
    alive[exact[~last]] = False
    return alive


def _overwritten(offsets: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Which extents (oldest first) a later one overlaps. Every overlapping pair is met
    once, in order of start: each extent with those that start before it ends. Extents
    are reused, not piled up, so the pairs are about as many as the reuses."""
    n = len(offsets)
    dead = np.zeros(n, bool)
    # One sort of (offset units, place) packed in 64 bits (a journal holds fewer than 2**32
    # records): far faster than an argsort.
    packed = np.sort((offsets // ALIGNMENT).astype(np.uint64) << np.uint64(32)
                     | np.arange(n, dtype=np.uint64))
    by_start = (packed & np.uint64(0xFFFFFFFF)).astype(np.int64)
    starts = offsets[by_start]
    ends = starts + nbytes[by_start]
    # Extents after position p in start order that begin before p's end overlap it.
    counts = np.searchsorted(starts, ends, side="left") - np.arange(n) - 1
    total = np.cumsum(counts)
    first = 0
    while first < n:
        limit = (total[first - 1] if first else 0) + _PAIR_BATCH
        last = max(first + 1, int(np.searchsorted(total, limit, side="right")))
        batch = counts[first:last]
        pairs = int(batch.sum())
        if pairs:
            left = np.repeat(np.arange(first, last), batch)
            step = np.arange(pairs) - np.repeat(np.cumsum(batch) - batch, batch)
            right = left + 1 + step
            older = np.where(by_start[left] < by_start[right], by_start[left],
                             by_start[right])
            dead[older] = True
        first = last
    return dead


def _read_all(fd: int, size: int, offset: int = 0) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        count = os.preadv(fd, [view[got:]], offset + got)
        if count <= 0:
            break  # cut short under the server: what was read replays
        got += count
    del view
    del data[got:]
    return data


def _write_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(f"pwrite wrote nothing at {offset}")
        view = view[written:]
        offset += written


# A names entry: magic b"LMCN", format (u16), name length (u16), salt digest (8 bytes),
# the name (ASCII, zero-padded), MAC of what comes before it. Fixed size, so that one bad
# entry never throws the next ones out of step.
_NAME_MAGIC = b"LMCN"
_NAME_ENTRY = struct.Struct(f"<4sHH{SALT_DIGEST_BYTES}s{MAX_SALT_NAME}s{_MAC_BYTES}s")
_NAME_SIGNED = _NAME_ENTRY.size - _MAC_BYTES


def valid_salt_name(name: str) -> bool:
    """Whether `name` can be recorded: at most 256 printable ASCII characters."""
    return len(name) <= MAX_SALT_NAME and name.isascii() and name.isprintable()


class SaltNames:
    """The file of cache_salt names by digest, appended to once per batch of new salts."""

    def __init__(self, fd: int, secret: bytes, read_only: bool = False):
        """`fd`: the file, open for reading and writing (or only reading); a torn last
        entry is cut off (or, read only, ignored)."""
        self.fd = fd
        self._mac = _hasher(secret, b"lmcd-salt-name")
        self._end = _whole(fd, _NAME_ENTRY.size, read_only)

    @classmethod
    def open(cls, directory: PrivateDir, name: str, secret: bytes,
             read_only: bool = False) -> SaltNames:
        """As Journal.open()."""
        return cls(_open(directory, name, read_only), secret, read_only)

    def _signed(self, head: bytes) -> bytes:
        mac = self._mac.copy()
        mac.update(head)
        return mac.digest()

    def add(self, names: Sequence[tuple[bytes, str]]) -> None:
        """Record that each `digest` is salt_digest(`name`): one write, then fdatasync;
        raises OSError (then none is recorded), and ValueError for a name that is not
        valid_salt_name() or a digest that is not its."""
        entries = []
        for digest, name in names:
            if not valid_salt_name(name) or digest != salt_digest(name):
                raise ValueError("a salt name is at most 256 printable ASCII characters, "
                                 "recorded with its salt_digest()")
            head = _NAME_ENTRY.pack(_NAME_MAGIC, FORMAT_VERSION, len(name), digest,
                                    name.encode(), bytes(_MAC_BYTES))[:_NAME_SIGNED]
            entries.append(head + self._signed(head))
        if not entries:
            return
        data = b"".join(entries)
        try:
            _write_all(self.fd, data, self._end)
            os.fdatasync(self.fd)
        except OSError:
            try:
                os.ftruncate(self.fd, self._end)
            except OSError:
                pass  # cut off or overwritten later anyway
            raise
        self._end += len(data)

    def load(self) -> dict[bytes, str]:
        """Every name recorded, by digest; entries that fail their MAC or do not match
        their digest are skipped."""
        raw = bytes(_read_all(self.fd, self._end))
        raw = raw[:len(raw) - len(raw) % _NAME_ENTRY.size]
        names: dict[bytes, str] = {}
        for start in range(0, len(raw), _NAME_ENTRY.size):
            magic, version, length, digest, padded, mac = _NAME_ENTRY.unpack_from(raw, start)
            if magic != _NAME_MAGIC or version != FORMAT_VERSION or length > MAX_SALT_NAME:
                continue
            if mac != self._signed(raw[start:start + _NAME_SIGNED]):
                continue
            name = padded[:length].decode("ascii", "replace")
            if valid_salt_name(name) and salt_digest(name) == digest:
                names[digest] = name
        return names

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
