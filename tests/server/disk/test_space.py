"""The disk tier's rules of room: caps and eviction make space, and a failed write shrinks the
tier (out of room) or stops its writes (anything else) for a while, then it tries again."""

from __future__ import annotations

import errno

from lmcache_mp.server.disk.index import MAX_SALTS
from lmcache_mp.server.disk.space import RETRY_S, DiskCounters, DiskSpace

from ...utils import FakeClock

CHUNK = 512 * 1024


def space(capacity: int = 8 * CHUNK, reserves: dict[str, int] | None = None
          ) -> tuple[DiskSpace, FakeClock]:
    clock = FakeClock()
    table = reserves or {}
    return DiskSpace(capacity, DiskCounters(), "/disk", lambda salt: table.get(salt, 0),
                     clock), clock


def fill(disk: DiskSpace, chunks: int, salt: int = 0, parent: bytes | None = None) -> list[bytes]:
    keys = []
    while len(disk.salt_names) <= salt:
        disk.salt_id(f"salt-{len(disk.salt_names)}")
    for i in range(chunks):
        key = bytes([salt, i]) + bytes(14)
        offset = disk.allocate(CHUNK, salt, None)
        assert offset is not None
        disk.written(key, parent, salt, offset, CHUNK, 0)
        parent = key
        keys.append(key)
    return keys


def test_room_is_made_from_the_end_of_the_least_recent_prompt():
    disk, _ = space(4 * CHUNK)
    first = fill(disk, 2)
    second = fill(disk, 2, salt=1)
    assert disk.allocate(CHUNK, 2, None) is not None  # evicts one chunk
    index = disk.index
    assert index.find(first[1]) < 0 and index.find(first[0]) >= 0
    assert all(index.find(key) >= 0 for key in second)
    assert disk.counters.evictions == 1


def test_room_for_others_is_not_made_from_a_salts_reservation():
    disk, _ = space(4 * CHUNK, reserves={"salt-0": 2 * CHUNK})
    reserved = fill(disk, 2)  # the least recent chunks, within salt-0's reservation
    other = fill(disk, 2, salt=1)
    offset = disk.allocate(CHUNK, 2, None)
    assert offset is not None
    index = disk.index
    assert all(index.find(key) >= 0 for key in reserved)
    assert index.find(other[1]) < 0 and index.find(other[0]) >= 0
    # Salt 0 itself may make room from its own reserved chunks, once no other's is left.
    assert disk.allocate(CHUNK, 0, None) is not None  # other[0], least recent, goes first
    assert index.find(other[0]) < 0 and all(index.find(key) >= 0 for key in reserved)
    disk.not_written(2, offset, CHUNK)  # salt 2's write failed: its room is free again
    assert disk.allocate(CHUNK, 0, None) is not None
    assert disk.allocate(CHUNK, 0, None) is not None
    assert index.find(reserved[1]) < 0


def test_a_salts_cap_counts_its_writes_in_flight():
    disk, _ = space()
    assert disk.allocate(CHUNK, 0, 2 * CHUNK) is not None
    assert disk.allocate(CHUNK, 0, 2 * CHUNK) is not None
    # Nothing of salt 0 is on disk yet to make room with: the third is refused.
    assert disk.allocate(CHUNK, 0, 2 * CHUNK) is None
    assert disk.allocate(CHUNK, 1, 2 * CHUNK) is not None


def test_out_of_room_shrinks_the_tier_to_what_it_holds_then_tries_again():
    disk, clock = space()
    fill(disk, 3)
    disk.write_failed(OSError(errno.ENOSPC, "No space left on device"))
    assert not disk.writable() and not disk.counters.writing
    assert disk.room == 3 * CHUNK == disk.counters.capacity_bytes
    clock.now += RETRY_S
    assert disk.writable()
    disk.retry_room()
    assert disk.room == disk.capacity
    fill(disk, 1, salt=1)
    assert disk.counters.writing


def test_a_failed_disk_stops_writes_but_keeps_what_it_holds():
    disk, clock = space()
    keys = fill(disk, 2)
    disk.write_failed(OSError(errno.EIO, "Input/output error"))
    assert not disk.writable()
    assert disk.room == disk.capacity and all(disk.index.find(k) >= 0 for k in keys)
    clock.now += RETRY_S - 1
    assert not disk.writable()
    clock.now += 1
    assert disk.writable()


def test_a_read_only_directory_never_writes():
    disk, clock = space()
    disk.read_only()
    clock.now += 10 * RETRY_S
    assert not disk.writable() and not disk.counters.writing


def test_salts_beyond_the_index_limit_are_not_written():
    """A client inventing salts cannot grow the disk tier's salt table without bound."""
    disk, _ = space()
    for n in range(MAX_SALTS):
        assert disk.salt_id(f"s{n}") == n
    assert disk.salt_id("one-too-many") is None
    assert disk.salt_id("s7") == 7  # those it has keep their ids
    assert len(disk.unsaved_salts) == MAX_SALTS
