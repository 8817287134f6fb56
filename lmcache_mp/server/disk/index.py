"""The compact index of chunks on disk: numpy columns, a hash table, LRU lists; no object a chunk.

A disk holds tens of millions of chunks, so a chunk here is a row of numpy columns (59
bytes) and the structures over them are arrays of record ids:

- an open-addressing hash table of int32 record ids (linear probing, backward-shift
  deletion, doubled at half full), hashed by the key's first half mixed with a seed
  this process picks, so no one who chooses keys can choose collisions;
- two intrusive doubly-linked lists of the evictable records (held by no one, followed
  by no stored chunk of their prompt), least recently used at the head: one over all
  salts and one per salt, in the same order;
- freed record ids reused through a free list threaded through the `next` column.

Single operations go through memoryviews of the columns (a Python int per access, no
numpy scalar), so each costs a few dozen bytecodes whatever the number of chunks; bulk
ones (load, live, a table's rehash) are numpy calls over the columns.

Runs on the event loop only (the tier's DiskSpace owns it).
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Sequence

import numpy as np

from ..cache.pool import ALIGNMENT
from .frozen import KEY_COLUMN, LIVE_COLUMNS, FrozenIndex, chain_order
from .journal import Replayed

MAX_SALTS = 1 << 16  # salt ids are uint16
_KEY = struct.Struct("<QQ")
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying by it mod 2**64 permutes, and mixes high bits
_M64 = (1 << 64) - 1
_COLUMNS = {
    KEY_COLUMN: np.uint64,
    "parent": np.int32,  # record id of the chunk before it, -1 for none
    "children": np.int32,  # records whose parent it is
    "salt": np.uint16,
    "offset": np.uint32,  # in ALIGNMENT units: 16 TiB of data file
    "nbytes": np.uint32, "mac": np.uint32,  # mac: its bytes' (journal.ChunkMac)
    "holds": np.int32,
    "prev": np.int32, "next": np.int32,  # the evictable list; `next` links free ids too
    "salt_prev": np.int32, "salt_next": np.int32,  # the salt's evictable list
    "live": np.uint8,
}


def _extent(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def _checked_rows(replayed: Replayed, salt_ids: np.ndarray) -> np.ndarray:
    """`salt_ids` as 16-bit ints (a stable sort of them is a radix sort), once a replay's
    rows are known to fit the index's columns; ValueError if not."""
    n, offsets, nbytes = len(replayed), replayed.offsets, replayed.nbytes
    if salt_ids.shape != (n,) or (n and (salt_ids.min() < 0 or salt_ids.max() >= MAX_SALTS
                                         or np.any(offsets % ALIGNMENT)
                                         or offsets.min() < 0
                                         or offsets.max() >= ALIGNMENT << 32
                                         or nbytes.min() <= 0
                                         or nbytes.max() >= 1 << 32)):
        raise ValueError("load() needs a salt id below MAX_SALTS a row, 4096-aligned "
                         "offsets below 16 TiB and 1 to 2**32-1 bytes a record")
    return salt_ids.astype(np.uint16)


class DiskIndex:
    """Every chunk on disk, by record id (an int, reused after remove()).

    A record is evictable when no one holds it and no record names it as parent: a
    prompt's later chunks go before its earlier ones, which keeps prefixes. Recency: add()
    and touch() make a record the most recent; one whose last hold is released comes back
    as the most recent (a hold is taken to read it); one whose last child goes comes back
    as the least recent (its child was just evicted as the least recent, and a prompt
    goes from its end back, before other prompts' chunks). touch() of a record that is
    not evictable changes nothing."""

    def __init__(self, initial_capacity: int = 1024):
        self._seed = secrets.randbits(64)
        self._initial = max(1, initial_capacity)
        self._salt_head = np.full(MAX_SALTS, -1, np.int32)
        self._salt_tail = np.full(MAX_SALTS, -1, np.int32)
        self._salt_bytes = np.zeros(MAX_SALTS, np.int64)
        self._salt_chunks = np.zeros(MAX_SALTS, np.int64)
        self._reset(self._initial)

    def _reset(self, capacity: int) -> None:
        self._capacity = capacity
        self._arrays = {name: np.zeros(_shape(name, capacity), kind)
                        for name, kind in _COLUMNS.items()}
        self._used = 0  # ids below it have been handed out
        self._free = -1
        self._count = 0
        self._total = 0
        self._head = self._tail = -1
        self._salt_head.fill(-1)
        self._salt_tail.fill(-1)
        self._salt_bytes.fill(0)
        self._salt_chunks.fill(0)
        self._table_array = np.full(_table_size(capacity), -1, np.int32)
        self._views()

    def _views(self) -> None:
        # .data is a memoryview: indexing it gives a Python int, at a fraction of the cost
        # of a numpy scalar. Rebuilt whenever an array is replaced.
        a = self._arrays
        self._keys = a[KEY_COLUMN].reshape(-1).data  # a record's halves at 2 rid, 2 rid + 1
        self._parent, self._children = a["parent"].data, a["children"].data
        self._salt, self._offset = a["salt"].data, a["offset"].data
        self._nbytes, self._mac = a["nbytes"].data, a["mac"].data
        self._holds, self._live = a["holds"].data, a["live"].data
        self._prev, self._next = a["prev"].data, a["next"].data
        self._salt_prev, self._salt_next = a["salt_prev"].data, a["salt_next"].data
        self._heads, self._tails = self._salt_head.data, self._salt_tail.data
        self._bytes_of, self._chunks_of = self._salt_bytes.data, self._salt_chunks.data
        self._table = self._table_array.data
        size = len(self._table_array)
        self._mask = size - 1
        self._shift = 64 - (size.bit_length() - 1)

    def __len__(self) -> int:
        return self._count

    @property
    def total_bytes(self) -> int:
        """Disk the records take: each one's nbytes rounded up to whole 4096-byte units."""
        return self._total

    def salt_bytes(self, salt: int) -> int:
        """Disk the salt's records take, as total_bytes counts it."""
        return self._bytes_of[salt]

    def salt_chunks(self, salt: int) -> int:
        return self._chunks_of[salt]

    # Field getters: `rid` is a record in the index (not checked, for speed).
    def offset(self, rid: int) -> int:
        return self._offset[rid] * ALIGNMENT

    def nbytes(self, rid: int) -> int:
        return self._nbytes[rid]

    def mac(self, rid: int) -> int:
        return self._mac[rid]

    def salt(self, rid: int) -> int:
        return self._salt[rid]

    def parent(self, rid: int) -> int:
        return self._parent[rid]

    def key(self, rid: int) -> bytes:
        return _KEY.pack(self._keys[2 * rid], self._keys[2 * rid + 1])

    def held(self, rid: int) -> bool:
        return self._holds[rid] > 0

    def find(self, key: bytes) -> int:
        """The record of the 16-byte `key`, or -1."""
        k0, k1 = _KEY.unpack(key)
        table, mask, keys = self._table, self._mask, self._keys
        slot = ((k0 ^ self._seed) * _MIX & _M64) >> self._shift
        while True:
            rid = table[slot]
            if rid < 0:
                return -1
            if keys[2 * rid] == k0 and keys[2 * rid + 1] == k1:
                return rid
            slot = (slot + 1) & mask

    def find_run(self, keys: Sequence[bytes]) -> int:
        """How many of `keys`, from the first, are in the index."""
        for count, key in enumerate(keys):
            if self.find(key) < 0:
                return count
        return len(keys)

    def add(self, key: bytes, parent: int, salt: int, offset: int, nbytes: int,
            mac: int) -> int:
        """A new record, evictable and the most recent, for a `key` not in the index;
        `parent`: the record of the chunk before it in its prompt, or -1 (it stops being
        evictable); `salt`: the caller's id of the cache_salt, below MAX_SALTS."""
        k0, k1 = _KEY.unpack(key)
        if not (0 <= salt < MAX_SALTS and 0 < nbytes < 1 << 32 and 0 <= mac < 1 << 32
                and 0 <= offset < ALIGNMENT << 32 and not offset % ALIGNMENT):
            raise ValueError(f"a record needs a salt id below {MAX_SALTS}, a 4096-aligned "
                             f"offset below 16 TiB and 1 to 2**32-1 bytes")
        if parent >= 0:
            self._check(parent)
        if self._count >= len(self._table_array) >> 1:
            self._rehash(2 * len(self._table_array))
        rid = self._free
        if rid >= 0:
            self._free = self._next[rid]
        else:
            if self._used == self._capacity:
                self._grow(2 * self._capacity)
            rid = self._used
            self._used += 1
        self._keys[2 * rid], self._keys[2 * rid + 1] = k0, k1
        self._salt[rid] = salt
        self._offset[rid] = offset // ALIGNMENT
        self._nbytes[rid] = nbytes
        self._mac[rid] = mac
        self._holds[rid] = self._children[rid] = 0
        self._live[rid] = 1
        self._parent[rid] = parent if parent >= 0 else -1
        if parent >= 0:
            children = self._children[parent]
            if not children and not self._holds[parent]:
                self._unlink(parent)
            self._children[parent] = children + 1
        self._place(rid, k0)
        self._push_tail(rid)
        extent = _extent(nbytes)
        self._bytes_of[salt] += extent
        self._chunks_of[salt] += 1
        self._total += extent
        self._count += 1
        return rid

    def remove(self, rid: int) -> tuple[int, int]:
        """Drop a record, whatever its state (the caller decides: an eviction, or a read
        that failed): (offset, nbytes) for the caller to free. Records it was the parent
        of lose their parent link (parent -1); finding them is a numpy pass over the
        parent column (a few ms at 10M records), only for a record with children."""
        self._check(rid)
        if not self._holds[rid] and not self._children[rid]:
            self._unlink(rid)
        self._unplace(rid)
        if self._children[rid]:
            parents = self._arrays["parent"]
            parents[np.flatnonzero(parents[:self._used] == rid)] = -1
            self._children[rid] = 0
        parent = self._parent[rid]
        if parent >= 0:
            children = self._children[parent] - 1
            self._children[parent] = children
            if not children and not self._holds[parent]:
                self._push_head(parent)
        salt, nbytes = self._salt[rid], self._nbytes[rid]
        extent = _extent(nbytes)
        self._bytes_of[salt] -= extent
        self._chunks_of[salt] -= 1
        self._total -= extent
        self._count -= 1
        self._live[rid] = 0
        self._parent[rid] = -1
        self._holds[rid] = 0
        self._next[rid] = self._free
        self._free = rid
        return self._offset[rid] * ALIGNMENT, nbytes

    def hold(self, rid: int) -> None:
        """Keep the record from being a victim until as many unhold() calls."""
        self._check(rid)
        holds = self._holds[rid]
        if not holds and not self._children[rid]:
            self._unlink(rid)
        self._holds[rid] = holds + 1

    def unhold(self, rid: int) -> None:
        self._check(rid)
        holds = self._holds[rid] - 1
        if holds < 0:
            raise ValueError(f"record {rid} is not held")
        self._holds[rid] = holds
        if not holds and not self._children[rid]:
            self._push_tail(rid)

    def touch(self, rid: int) -> None:
        """The record was used: it is the most recent, if it is evictable."""
        self._check(rid)
        if rid != self._tail and not self._holds[rid] and not self._children[rid]:
            self._unlink(rid)
            self._push_tail(rid)

    def victim(self, salt: int | None = None) -> int:
        """The least recently used evictable record, of all or of `salt`; -1 if none."""
        if salt is None:
            return self._head
        if not 0 <= salt < MAX_SALTS:
            raise ValueError(f"salt ids are below {MAX_SALTS}")
        return self._heads[salt]

    def _check(self, rid: int) -> None:
        if not (0 <= rid < self._used and self._live[rid]):
            raise ValueError(f"record {rid} is not in the index")

    def _push_tail(self, rid: int) -> None:
        prev, nxt = self._prev, self._next
        tail = self._tail
        prev[rid], nxt[rid] = tail, -1
        if tail >= 0:
            nxt[tail] = rid
        else:
            self._head = rid
        self._tail = rid
        salt = self._salt[rid]
        prev, nxt, tails = self._salt_prev, self._salt_next, self._tails
        tail = tails[salt]
        prev[rid], nxt[rid] = tail, -1
        if tail >= 0:
            nxt[tail] = rid
        else:
            self._heads[salt] = rid
        tails[salt] = rid

    def _push_head(self, rid: int) -> None:
        prev, nxt = self._prev, self._next
        head = self._head
        prev[rid], nxt[rid] = -1, head
        if head >= 0:
            prev[head] = rid
        else:
            self._tail = rid
        self._head = rid
        salt = self._salt[rid]
        prev, nxt, heads = self._salt_prev, self._salt_next, self._heads
        head = heads[salt]
        prev[rid], nxt[rid] = -1, head
        if head >= 0:
            prev[head] = rid
        else:
            self._tails[salt] = rid
        heads[salt] = rid

    def _unlink(self, rid: int) -> None:
        prev, nxt = self._prev, self._next
        before, after = prev[rid], nxt[rid]
        if before >= 0:
            nxt[before] = after
        else:
            self._head = after
        if after >= 0:
            prev[after] = before
        else:
            self._tail = before
        salt = self._salt[rid]
        prev, nxt = self._salt_prev, self._salt_next
        before, after = prev[rid], nxt[rid]
        if before >= 0:
            nxt[before] = after
        else:
            self._heads[salt] = after
        if after >= 0:
            prev[after] = before
        else:
            self._tails[salt] = before

    def _place(self, rid: int, k0: int) -> None:
        table, mask = self._table, self._mask
        slot = ((k0 ^ self._seed) * _MIX & _M64) >> self._shift
        while table[slot] >= 0:
            slot = (slot + 1) & mask
        table[slot] = rid

    def _unplace(self, rid: int) -> None:
        table, mask, keys, seed, shift = self._table, self._mask, self._keys, self._seed, \
            self._shift
        hole = ((keys[2 * rid] ^ seed) * _MIX & _M64) >> shift
        while table[hole] != rid:
            hole = (hole + 1) & mask
        # Backward shift: pull each later entry of the run back into the hole, unless the
        # hole lies before its home (it would no longer be found from there).
        slot = hole
        while True:
            slot = (slot + 1) & mask
            other = table[slot]
            if other < 0:
                break
            home = ((keys[2 * other] ^ seed) * _MIX & _M64) >> shift
            if (slot - home) & mask >= (slot - hole) & mask:
                table[hole] = other
                hole = slot
        table[hole] = -1

    def _grow(self, capacity: int) -> None:
        for name, column in self._arrays.items():
            grown = np.zeros(_shape(name, capacity), column.dtype)
            grown[:len(column)] = column
            self._arrays[name] = grown
        self._capacity = capacity
        self._views()

    def _homes(self, k0: np.ndarray, size: int) -> np.ndarray:
        shift = np.uint64(64 - (size.bit_length() - 1))
        return ((k0 ^ np.uint64(self._seed)) * np.uint64(_MIX) >> shift).astype(np.int64)

    def _rehash(self, size: int) -> None:
        rids = np.flatnonzero(self._arrays["live"][:self._used])
        table = self._table_array if len(self._table_array) == size else \
            np.empty(size, np.int32)
        table.fill(-1)
        _fill(table, self._homes(self._arrays[KEY_COLUMN][rids, 0], size), rids)
        self._table_array = table
        self._views()

    def _find_many(self, wanted: np.ndarray) -> np.ndarray:
        """find() for an (n, 2) array of keys, probing all of them a step at a time."""
        table, keys = self._table_array, self._arrays[KEY_COLUMN]
        firsts, seconds = keys[:, 0], keys[:, 1]
        found = np.full(len(wanted), -1, np.int64)
        active = np.arange(len(wanted))
        first, second = wanted[:, 0], wanted[:, 1]
        slots = self._homes(first, len(table))
        while len(active):
            rids = table[slots]
            occupied = rids >= 0
            hit = occupied & (firsts[rids] == first) & (seconds[rids] == second)
            found[active[hit]] = rids[hit]
            going = occupied & ~hit
            active, first, second = active[going], first[going], second[going]
            slots = (slots[going] + 1) & self._mask
        return found

    def load(self, replayed: Replayed, salt_ids: np.ndarray) -> None:
        """Fill an empty index from a journal's replay (keys unique, oldest first, as
        replay() and live() give them); `salt_ids[i]`: the salt id of row i. A parent
        not among the rows is none; the evictable records are in row order, oldest
        first, and nothing is held."""
        if self._count:
            raise ValueError("load() fills an empty index")
        n = len(replayed)
        offsets, nbytes = replayed.offsets, replayed.nbytes
        salt_ids = _checked_rows(replayed, np.asarray(salt_ids))
        capacity = self._initial
        while capacity < n:
            capacity *= 2
        self._reset(capacity)
        a = self._arrays
        a[KEY_COLUMN][:n] = replayed.keys
        a["salt"][:n] = salt_ids
        a["offset"][:n] = offsets // ALIGNMENT
        a["nbytes"][:n], a["mac"][:n] = nbytes, replayed.macs
        a["live"][:n] = 1
        self._used = self._count = n
        size = len(self._table_array)
        while n > size >> 1:
            size *= 2
        self._rehash(size)

        parents = np.full(n, -1, np.int64)
        named = np.flatnonzero((replayed.parents[:, 0] != 0) | (replayed.parents[:, 1] != 0))
        parents[named] = self._find_many(replayed.parents[named])
        parents[parents == np.arange(n)] = -1  # a record cannot come after itself
        a["parent"][:n] = parents
        children = np.bincount(parents[parents >= 0], minlength=n)
        a["children"][:n] = children
        self._link_evictable(np.flatnonzero(children == 0), salt_ids)
        extents = -(-nbytes // ALIGNMENT) * ALIGNMENT
        # float64 sums are exact below 2**53 bytes (8 PiB) a salt
        self._salt_bytes[:] = np.bincount(salt_ids, weights=extents, minlength=MAX_SALTS)
        self._salt_chunks[:] = np.bincount(salt_ids, minlength=MAX_SALTS)
        self._total = int(extents.sum())

    def _link_evictable(self, evictable: np.ndarray, salt_ids: np.ndarray) -> None:
        """The evictable rows (no child), in row order, as the eviction list and as each
        salt's list, at once (load())."""
        a = self._arrays
        for column in ("prev", "next", "salt_prev", "salt_next"):
            a[column].fill(-1)
        if len(evictable):
            a["prev"][evictable[1:]] = evictable[:-1]
            a["next"][evictable[:-1]] = evictable[1:]
            self._head, self._tail = int(evictable[0]), int(evictable[-1])
            by_salt = evictable[np.argsort(salt_ids[evictable], kind="stable")]
            salts = salt_ids[by_salt]
            same = salts[1:] == salts[:-1]
            a["salt_prev"][by_salt[1:][same]] = by_salt[:-1][same]
            a["salt_next"][by_salt[:-1][same]] = by_salt[1:][same]
            first = np.concatenate(([True], ~same))
            last = np.concatenate((~same, [True]))
            self._salt_head[salts[first]] = by_salt[first]
            self._salt_tail[salts[last]] = by_salt[last]

    def _evictable(self) -> np.ndarray:
        a, used = self._arrays, self._used
        return (a["live"][:used] == 1) & (a["holds"][:used] == 0) & (a["children"][:used] == 0)

    def frozen(self) -> FrozenIndex:
        """A copy of the columns live() reads: a copy of arrays on the loop thread, so that
        the ordering live() does (pointer jumping over millions of records) can run on
        another thread while the index goes on changing."""
        used = self._used
        return FrozenIndex({name: self._arrays[name][:used].copy() for name in LIVE_COLUMNS},
                           used)

    def live(self, salt_digests: np.ndarray) -> Replayed:
        """frozen().live(): the records as journal rows, oldest first."""
        return self.frozen().live(salt_digests)

    def memory_bytes(self) -> int:
        """Server memory the index's arrays take."""
        return (sum(column.nbytes for column in self._arrays.values())
                + self._table_array.nbytes + self._salt_head.nbytes + self._salt_tail.nbytes
                + self._salt_bytes.nbytes + self._salt_chunks.nbytes)

    def check_invariants(self) -> None:
        """AssertionError unless every structure agrees with the columns (for tests)."""
        a, used = self._arrays, self._used
        live = a["live"][:used] == 1
        rids = np.flatnonzero(live)
        assert len(rids) == self._count
        parents = a["parent"][:used]
        assert np.all(parents[~live] == -1)
        linked = parents[live]
        assert np.all(live[linked[linked >= 0]]), "a parent that is not a record"
        children = np.bincount(linked[linked >= 0], minlength=used)
        assert np.array_equal(children[live], a["children"][:used][live]), "child counts"
        assert np.all(a["holds"][:used][live] >= 0)

        evictable = np.flatnonzero(self._evictable())
        order, to_end = chain_order(a["next"], evictable, self._used)
        assert np.array_equal(np.sort(to_end), np.arange(len(evictable))), \
            "the evictable list is not one chain"
        assert self._head == (order[0] if len(order) else -1)
        assert self._tail == (order[-1] if len(order) else -1)
        if len(order):
            assert a["prev"][order[0]] == -1
            assert np.array_equal(a["prev"][order[1:]], order[:-1]), "prev links"
        # Each salt's list: the evictable list's order, that salt's records alone.
        by_salt = order[np.argsort(a["salt"][order], kind="stable")]
        grouped = a["salt"][by_salt].astype(np.int64)
        first = np.ones(len(by_salt), bool)
        first[1:] = grouped[1:] != grouped[:-1]
        last = np.roll(first, -1)
        before, after = np.roll(by_salt, 1), np.roll(by_salt, -1)
        assert np.array_equal(a["salt_prev"][by_salt], np.where(first, -1, before))
        assert np.array_equal(a["salt_next"][by_salt], np.where(last, -1, after))
        heads = np.full(MAX_SALTS, -1, np.int32)
        tails = np.full(MAX_SALTS, -1, np.int32)
        heads[grouped[first]] = by_salt[first]
        tails[grouped[last]] = by_salt[last]
        assert np.array_equal(heads, self._salt_head) and np.array_equal(tails, self._salt_tail)

        free = np.flatnonzero(~live)
        chained, _ = chain_order(a["next"], free, self._used)
        assert self._free == (chained[0] if len(chained) else -1), "the free list"

        table = self._table_array
        assert np.count_nonzero(table >= 0) == self._count
        assert np.all(live[table[table >= 0]]), "the table names a removed record"
        found = self._find_many(a[KEY_COLUMN][rids])
        assert np.array_equal(found, rids), "the table misses a record"

        extents = -(-a["nbytes"][rids].astype(np.int64) // ALIGNMENT) * ALIGNMENT
        salt_of = a["salt"][rids]
        assert np.array_equal(np.bincount(salt_of, weights=extents, minlength=MAX_SALTS),
                              self._salt_bytes)
        assert np.array_equal(np.bincount(salt_of, minlength=MAX_SALTS), self._salt_chunks)
        assert self._total == int(extents.sum())


def _table_size(records: int) -> int:
    size = 2
    while size < 2 * records:
        size *= 2
    return size


def _shape(name: str, capacity: int) -> tuple[int, ...]:
    return (capacity, 2) if name == KEY_COLUMN else (capacity,)


def _fill(table: np.ndarray, homes: np.ndarray, rids: np.ndarray) -> None:
    """Put `rids` into an empty linear-probing `table`, each at the first free slot from
    its home on, all at once: each round every record not yet placed writes itself into
    its slot if free, one writer wins each slot, the others step on. A record passes a
    slot only when it is taken, so find() meets no gap; at half full the rounds are few."""
    mask = len(table) - 1
    slots = homes.copy()
    waiting = np.arange(len(rids))
    while len(waiting):
        tried = slots[waiting]
        free = table[tried] < 0
        table[tried[free]] = rids[waiting[free]]
        placed = np.zeros(len(waiting), bool)
        placed[free] = table[tried[free]] == rids[waiting[free]]
        waiting = waiting[~placed]
        slots[waiting] = (slots[waiting] + 1) & mask
