"""The disk tier's journal and salt names: what replays after a crash, a tamper or a foreign key.

`python -m tests.server.disk.test_journal [RECORDS ...]` prints the time of replay() at
those sizes (the figure in docs/disk.md).
"""

from __future__ import annotations

import os
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.server.disk.journal import (
    CHUNK_RECORD_BYTES,
    REPLAY_BLOCK,
    ChunkMac,
    ChunkRecord,
    Journal,
    Removals,
    Replayed,
    SaltNames,
    salt_digest,
)
from lmcache_mp.server.private_dir import PrivateDir, UnsafePath

SECRET = bytes(range(32))
NAME = "journal"


@pytest.fixture
def directory(tmp_path):
    opened = PrivateDir(tmp_path / "disk")
    yield opened
    opened.close()


def record(number: int, offset: int | None = None, nbytes: int = 5000, key: int | None = None,
           parent: int = 0) -> ChunkRecord:
    return ChunkRecord(struct.pack("<QQ", key if key is not None else number, 7),
                       struct.pack("<QQ", parent, 7) if parent else bytes(16),
                       salt_digest(f"salt {number % 2}"),
                       offset if offset is not None else number * 8192, nbytes, number)


def rows(replayed: Replayed) -> list[tuple[int, int]]:
    """(key's first half, offset) of each live record, oldest first."""
    return list(zip(replayed.keys[:, 0].tolist(), replayed.offsets.tolist()))


def path_of(directory: PrivateDir, name: str = NAME) -> Path:
    return directory.path / name


def test_records_come_back_as_they_went_in(directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1), record(2, parent=1)])
    journal.append([record(3)])
    assert journal.records == 3
    journal.close()
    replayed = Journal.open(directory, NAME, SECRET).replay()
    assert (replayed.read, replayed.bad, replayed.superseded) == (3, 0, 0)
    assert rows(replayed) == [(1, 8192), (2, 16384), (3, 24576)]
    assert replayed.parents[1].tobytes() == struct.pack("<QQ", 1, 7)
    assert not replayed.parents[0].any()
    assert replayed.salts[1].tobytes() == salt_digest("salt 0")
    assert replayed.nbytes.tolist() == [5000] * 3 and replayed.macs.tolist() == [1, 2, 3]
    assert os.stat(path_of(directory)).st_mode & 0o777 == 0o600


def test_a_torn_tail_is_cut_off_and_the_next_append_lands_after_the_last_whole_record(
        directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1), record(2), record(3)])
    journal.close()
    os.truncate(path_of(directory), 2 * CHUNK_RECORD_BYTES + 50)
    journal = Journal.open(directory, NAME, SECRET)
    assert journal.records == 2
    assert os.path.getsize(path_of(directory)) == 2 * CHUNK_RECORD_BYTES
    assert rows(journal.replay()) == [(1, 8192), (2, 16384)]
    journal.append([record(4)])
    replayed = journal.replay()
    assert rows(replayed) == [(1, 8192), (2, 16384), (4, 32768)] and replayed.bad == 0


@pytest.mark.parametrize("where", [0, 5, 9, 60, 70, 100, 127])  # magic .. sequence, pad, MAC
def test_a_flipped_byte_drops_only_its_record(directory, where):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1), record(2), record(3)])
    with open(path_of(directory), "r+b") as file:
        file.seek(CHUNK_RECORD_BYTES + where)
        byte = file.read(1)
        file.seek(CHUNK_RECORD_BYTES + where)
        file.write(bytes([byte[0] ^ 0x10]))
    replayed = journal.replay()
    assert rows(replayed) == [(1, 8192), (3, 24576)]
    assert (replayed.read, replayed.bad) == (3, 1)


def test_a_record_copied_to_another_place_is_refused(directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1), record(2), record(3)])
    with open(path_of(directory), "r+b") as file:
        first = file.read(CHUNK_RECORD_BYTES)
        file.seek(2 * CHUNK_RECORD_BYTES)
        file.write(first)
    replayed = journal.replay()
    assert rows(replayed) == [(1, 8192), (2, 16384)] and replayed.bad == 1


def test_a_journal_signed_with_another_secret_replays_empty(directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1), record(2)])
    journal.close()
    replayed = Journal.open(directory, NAME, bytes(32)).replay()
    assert len(replayed) == 0 and (replayed.read, replayed.bad, replayed.unsigned) == (2, 2, 2)


def test_later_records_replace_the_same_key_and_kill_what_they_overwrite(directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([
        record(1, offset=0, nbytes=8192),  # overwritten in part by 3
        record(2, offset=8192, nbytes=4096),  # replaced by 4 (same key, elsewhere)
        record(3, offset=4096, nbytes=100),
        record(4, offset=40960, key=2),
        record(5, offset=12288, nbytes=4096),  # touches 2's extent end to end: no overlap
    ])
    replayed = journal.replay()
    assert rows(replayed) == [(3, 4096), (2, 40960), (5, 12288)]
    assert (replayed.read, replayed.bad, replayed.superseded) == (5, 0, 2)


def test_a_record_overwritten_by_one_that_dies_later_stays_dead(directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1, offset=0, nbytes=4096), record(2, offset=0, nbytes=8192),
                    record(3, offset=4096, nbytes=4096)])
    assert rows(journal.replay()) == [(3, 4096)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 12), st.integers(1, 3 * 4096)),
                max_size=30))
def test_replay_keeps_what_no_later_record_replaces_or_overlaps(extents):
    with tempfile.TemporaryDirectory() as place:
        directory = PrivateDir(Path(place) / "disk")
        journal = Journal.open(directory, NAME, SECRET)
        written = [record(n, offset=4096 * page, nbytes=size, key=key)
                   for n, (key, page, size) in enumerate(extents)]
        journal.append(written)
        expected = [(r.key, r.offset) for i, r in enumerate(written)
                    if not any(later.key == r.key
                               or (later.offset < r.offset + r.nbytes
                                   and r.offset < later.offset + later.nbytes)
                               for later in written[i + 1:])]
        replayed = journal.replay()
        assert [(key.tobytes(), offset) for key, offset in
                zip(replayed.keys, replayed.offsets.tolist())] == expected
        journal.close()
        directory.close()


def test_rewrite_keeps_the_old_journal_whole_until_the_rename(directory, monkeypatch):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(n) for n in range(10)] + [record(1, offset=200 * 8192)])
    live = journal.replay()
    before = path_of(directory).read_bytes()
    seen: dict[str, Any] = {}  # the old file's bytes, the new file's records
    rename = directory.replace

    def failing(source, target):
        seen["old"] = path_of(directory).read_bytes()
        written = Journal(directory.open(source, os.O_RDWR), SECRET, directory, source)
        seen["new"] = written.replay()
        written.close()
        raise OSError(5, "no rename today")

    monkeypatch.setattr(directory, "replace", failing)
    with pytest.raises(OSError):
        journal.rewrite(live)
    assert seen["old"] == before and path_of(directory).read_bytes() == before
    assert rows(seen["new"]) == rows(live)  # the new file was whole before the rename
    assert sorted(os.listdir(directory.path)) == [NAME]  # the new file went again
    journal.append([record(20)])  # the old journal, still open, takes appends
    assert journal.records == 12

    monkeypatch.setattr(directory, "replace", rename)
    live = journal.replay()
    journal.rewrite(live)
    assert journal.records == len(live) == 11
    assert os.path.getsize(path_of(directory)) == 11 * CHUNK_RECORD_BYTES
    journal.append([record(21)])
    journal.close()
    replayed = Journal.open(directory, NAME, SECRET).replay()
    assert rows(replayed) == rows(live) + [(21, 21 * 8192)]
    assert (replayed.read, replayed.bad, replayed.superseded) == (12, 0, 0)


def test_a_journal_opened_read_only_replays_and_takes_no_appends(directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1), record(2)])
    journal.close()
    os.truncate(path_of(directory), CHUNK_RECORD_BYTES + 50)
    journal = Journal.open(directory, NAME, SECRET, read_only=True)
    assert rows(journal.replay()) == [(1, 8192)] and journal.records == 1
    assert os.path.getsize(path_of(directory)) == CHUNK_RECORD_BYTES + 50  # left as it was
    with pytest.raises(OSError):
        journal.append([record(3)])
    with pytest.raises(FileNotFoundError):
        Journal.open(directory, "none", SECRET, read_only=True)


def test_records_out_of_bounds_are_refused_before_writing(directory):
    journal = Journal.open(directory, NAME, SECRET)
    for bad in [record(1, offset=100), record(1, offset=1 << 44), record(1, nbytes=0),
                record(1, nbytes=1 << 32),
                ChunkRecord(bytes(15), bytes(16), bytes(8), 0, 1, 0)]:
        with pytest.raises(ValueError):
            journal.append([bad])
    assert journal.records == 0 and os.path.getsize(path_of(directory)) == 0


def test_a_link_in_place_of_the_journal_is_refused(directory, tmp_path):
    (tmp_path / "elsewhere").write_bytes(b"")
    os.symlink(tmp_path / "elsewhere", path_of(directory))
    with pytest.raises(UnsafePath):
        Journal.open(directory, NAME, SECRET)


def test_salt_names_come_back_and_a_tampered_or_torn_entry_is_skipped(directory):
    names = SaltNames.open(directory, "salts", SECRET)
    names.add([(salt_digest(name), name) for name in ["", "tenant-a", "x" * 256]])
    with pytest.raises(ValueError):
        names.add([(salt_digest("é"), "é")])
    with pytest.raises(ValueError):
        names.add([(salt_digest("c"), "c"), (salt_digest("a"), "b")])  # none of them
    names.close()
    assert SaltNames.open(directory, "salts", SECRET).load() == {
        salt_digest(name): name for name in ["", "tenant-a", "x" * 256]}
    assert SaltNames.open(directory, "salts", bytes(32)).load() == {}
    size = os.path.getsize(path_of(directory, "salts"))
    entry = size // 3
    with open(path_of(directory, "salts"), "r+b") as file:
        file.seek(entry + 20)
        file.write(b"Z")
    os.truncate(path_of(directory, "salts"), size - 10)
    names = SaltNames.open(directory, "salts", SECRET)
    assert names.load() == {salt_digest(""): ""}
    names.add([(salt_digest("later"), "later")])
    assert names.load() == {salt_digest(""): "", salt_digest("later"): "later"}


def removals(*entries: tuple[int, int, int]) -> np.ndarray:
    """Removals.take()'s rows for (key number, offset, nbytes) entries, as record() keys."""
    queue = Removals()
    for key, offset, nbytes in entries:
        queue.add(struct.pack("<QQ", key, 7), offset, nbytes)
    return queue.take()


def test_a_removal_kills_its_key_and_is_no_chunk_and_a_later_record_lives(directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1), record(2), record(3)])
    journal.append([record(4)], removals((2, 16384, 5000), (3, 24576, 5000)))
    journal.append([record(3, offset=65536)])  # key 3 written again, after its removal
    replayed = journal.replay()
    assert rows(replayed) == [(1, 8192), (4, 32768), (3, 65536)]
    assert (replayed.read, replayed.bad, replayed.superseded) == (7, 0, 4)
    # Compaction keeps the live records alone: the removals are gone with their chunks.
    journal.rewrite(replayed)
    assert journal.records == 3 and rows(journal.replay()) == rows(replayed)


def test_removals_come_back_in_order_after_a_failed_append():
    queue = Removals()
    queue.add(struct.pack("<QQ", 1, 7), 0, 10)
    taken = queue.take()
    queue.add(struct.pack("<QQ", 2, 7), 4096, 20)
    queue.put_back(taken)
    assert [row["offset"] for row in queue.take()] == [0, 4096]
    assert queue.made == 2 and queue.durable == 0 and len(queue) == 0


def test_format_1_records_replay_as_bad(directory):
    journal = Journal.open(directory, NAME, SECRET)
    journal.append([record(1), record(2)])
    with open(path_of(directory), "r+b") as file:
        file.seek(4)  # the format field of the first record: 1, as the old journals hold
        file.write(struct.pack("<H", 1))
    replayed = journal.replay()
    assert rows(replayed) == [(2, 16384)] and replayed.bad == 1


def test_replay_reads_at_most_the_last_limit_records_block_by_block(directory):
    journal = Journal.open(directory, NAME, SECRET)
    count = REPLAY_BLOCK + 10  # two blocks
    journal.append([record(n) for n in range(count)])
    assert len(journal.replay()) == count
    tail = journal.replay(limit=15)
    assert rows(tail) == [(n, n * 8192) for n in range(count - 15, count)]
    assert (tail.read, tail.skipped, tail.bad) == (15, count - 15, 0)
    # A journal padded with a hole (zeros) replays its good records and nothing of the hole.
    journal.close()
    os.truncate(path_of(directory), 64 * count * CHUNK_RECORD_BYTES)
    padded = Journal.open(directory, NAME, SECRET).replay(limit=2 * count)
    assert len(padded) == 0 and padded.bad == 2 * count and padded.unsigned == 0


def test_a_chunk_mac_covers_its_key_and_its_bytes():
    mac = ChunkMac(SECRET)
    key, data = bytes(16), b"x" * 5000
    assert mac.of(key, data) == mac.of(key, memoryview(data))
    assert mac.of(key, data) != mac.of(bytes(15) + b"\1", data)
    assert mac.of(key, data) != mac.of(key, b"y" + data[1:])
    assert mac.of(key, data) != ChunkMac(bytes(32)).of(key, data)
    assert 0 <= mac.of(key, data) < 1 << 32


def measure(records: int) -> dict[str, float]:
    """Seconds of replay() for a journal of `records` distinct chunks."""
    with tempfile.TemporaryDirectory() as place:
        directory = PrivateDir(Path(place) / "disk")
        journal = Journal.open(directory, NAME, SECRET)
        keys = np.random.default_rng(0).integers(0, 2**63, (records, 2)).astype(np.uint64)
        journal.rewrite(Replayed(keys, np.zeros_like(keys), np.zeros(records, np.uint64),
                                 np.arange(records, dtype=np.int64) * 8192,
                                 np.full(records, 5000, np.int64),
                                 np.zeros(records, np.uint32)))
        started = time.perf_counter()
        replayed = journal.replay()
        replay_s = time.perf_counter() - started
        assert len(replayed) == records
        journal.close()
        directory.close()
    return {"records": records, "replay_s": replay_s}


if __name__ == "__main__":
    for count in [int(arg) for arg in sys.argv[1:]] or [1_000_000]:
        print(measure(count), flush=True)
