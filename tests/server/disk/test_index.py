"""The disk tier's compact index against a model of dicts and a list, and what it costs.

The model keeps each record's fields and the evictable records least recent first, by the
index's rules (add and touch: most recent; last hold released: most recent; last child
gone: least recent). Keys share first halves on purpose: those land on the same home slot
and make long probe runs, which is where backward-shift deletion goes wrong if it does.

`python -m tests.server.disk.test_index [CHUNKS ...]` prints the memory a chunk and the
time of find() and load() at those sizes (the figures in docs/disk.md).
"""

from __future__ import annotations

import struct
import sys
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_mp.server.disk.index import MAX_SALTS, DiskIndex
from lmcache_mp.server.disk.journal import Replayed

SALTS = 3
DIGEST_BASE = 1000  # salt id s is written to the journal as digest DIGEST_BASE + s
DIGESTS = np.arange(DIGEST_BASE, DIGEST_BASE + SALTS, dtype=np.uint64)


def key(first: int, second: int) -> bytes:
    return struct.pack("<QQ", first, second)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index = DiskIndex(initial_capacity=2)
        self.records: dict[int, dict] = {}  # rid -> key, parent, salt, offset, nbytes, mac, holds
        self.order: list[int] = []  # the evictable records, least recent first
        self.serial = 0

    def children(self, rid: int) -> int:
        return sum(1 for record in self.records.values() if record["parent"] == rid)

    def evictable(self, rid: int) -> bool:
        return not self.records[rid]["holds"] and not self.children(rid)

    def pick(self, which: int) -> int:
        return sorted(self.records)[which % len(self.records)]

    @rule(first=st.sampled_from([0, 1, 2**63, 2**64 - 1, 12345]), salt=st.integers(0, SALTS - 1),
          parent=st.integers(-1, 50), nbytes=st.integers(1, 3 * 4096))
    def add(self, first: int, salt: int, parent: int, nbytes: int) -> None:
        self.serial += 1
        parent_id = self.pick(parent) if parent >= 0 and self.records else -1
        if parent_id >= 0 and self.evictable(parent_id):
            self.order.remove(parent_id)
        record_key, offset = key(first, self.serial), 4096 * self.serial
        record = {"key": record_key, "parent": parent_id, "salt": salt, "offset": offset,
                  "nbytes": nbytes, "mac": self.serial, "holds": 0}
        rid = self.index.add(record_key, parent_id, salt, offset, nbytes, self.serial)
        assert rid not in self.records
        self.records[rid] = record
        self.order.append(rid)

    @precondition(lambda self: self.records)
    @rule(which=st.integers(0, 50))
    def remove(self, which: int) -> None:
        rid = self.pick(which)
        record = self.records[rid]
        if self.evictable(rid):
            self.order.remove(rid)
        assert self.index.remove(rid) == (record["offset"], record["nbytes"])
        del self.records[rid]
        for other in self.records.values():
            if other["parent"] == rid:
                other["parent"] = -1
        parent = record["parent"]
        if parent >= 0 and self.evictable(parent):
            self.order.insert(0, parent)

    @precondition(lambda self: self.records)
    @rule(which=st.integers(0, 50))
    def hold(self, which: int) -> None:
        rid = self.pick(which)
        if self.evictable(rid):
            self.order.remove(rid)
        self.records[rid]["holds"] += 1
        self.index.hold(rid)

    @precondition(lambda self: any(record["holds"] for record in self.records.values()))
    @rule(which=st.integers(0, 50))
    def unhold(self, which: int) -> None:
        held = sorted(rid for rid, record in self.records.items() if record["holds"])
        rid = held[which % len(held)]
        self.records[rid]["holds"] -= 1
        self.index.unhold(rid)
        if self.evictable(rid):
            self.order.append(rid)

    @precondition(lambda self: self.records)
    @rule(which=st.integers(0, 50))
    def touch(self, which: int) -> None:
        rid = self.pick(which)
        if self.evictable(rid):
            self.order.remove(rid)
            self.order.append(rid)
        self.index.touch(rid)

    @rule()
    def evict(self) -> None:
        rid = self.index.victim()
        if rid >= 0:
            self.remove(sorted(self.records).index(rid))

    @rule()
    def reload(self) -> None:
        """load(live()) into a new index: the same records, parents and victim order;
        nothing held, so held leaves join the list after the rest, in record order."""
        live = self.index.live(DIGESTS)
        loaded = DiskIndex(initial_capacity=2)
        loaded.load(live, (live.salts - DIGEST_BASE).astype(np.int64))
        renamed = {rid: loaded.find(record["key"]) for rid, record in self.records.items()}
        released = sorted(rid for rid, record in self.records.items()
                          if record["holds"] and not self.children(rid))
        self.order = [renamed[rid] for rid in self.order + released]
        self.records = {renamed[rid]: {**record, "holds": 0,
                                       "parent": renamed.get(record["parent"], -1)}
                        for rid, record in self.records.items()}
        self.index = loaded

    @invariant()
    def agrees(self) -> None:
        index = self.index
        index.check_invariants()
        assert len(index) == len(self.records)
        for rid, record in self.records.items():
            assert index.find(record["key"]) == rid
            assert index.key(rid) == record["key"] and index.parent(rid) == record["parent"]
            assert (index.salt(rid), index.offset(rid), index.nbytes(rid), index.mac(rid)) == \
                (record["salt"], record["offset"], record["nbytes"], record["mac"])
            assert index.held(rid) == bool(record["holds"])
        assert index.victim() == (self.order[0] if self.order else -1)
        for salt in range(SALTS):
            mine = [rid for rid in self.order if self.records[rid]["salt"] == salt]
            assert index.victim(salt) == (mine[0] if mine else -1)
            extents = [-(-r["nbytes"] // 4096) * 4096 for r in self.records.values()
                       if r["salt"] == salt]
            assert index.salt_bytes(salt) == sum(extents)
            assert index.salt_chunks(salt) == len(extents)
        assert index.find(key(7, 0)) == -1


TestIndexAgainstModel = IndexMachine.TestCase
TestIndexAgainstModel.settings = settings(max_examples=80, stateful_step_count=30,
                                          deadline=None)


def test_a_prompt_is_evicted_from_its_end_and_a_held_chunk_never():
    index = DiskIndex()
    first = index.add(key(1, 1), -1, 0, 0, 4096, 0)
    second = index.add(key(1, 2), first, 0, 4096, 4096, 0)
    third = index.add(key(1, 3), second, 0, 8192, 4096, 0)
    other = index.add(key(2, 1), -1, 1, 12288, 4096, 0)
    index.hold(third)
    assert index.victim() == other  # the prompt's only leaf is held
    index.unhold(third)
    assert index.victim() == other  # released: the most recent
    index.remove(other)
    assert [index.victim(), index.victim(0), index.victim(1)] == [third, third, -1]
    index.remove(third)
    assert index.victim() == second
    assert index.find_run([key(1, 1), key(1, 2), key(1, 3)]) == 2
    index.check_invariants()


def test_removing_a_parent_orphans_its_children():
    index = DiskIndex()
    parent = index.add(key(1, 1), -1, 0, 0, 4096, 0)
    children = [index.add(key(1, 2 + i), parent, 0, 4096 * (i + 1), 100, 0) for i in range(3)]
    index.hold(parent)
    assert index.remove(parent) == (0, 4096)
    assert [index.parent(child) for child in children] == [-1] * 3
    assert len(index) == 3 and index.total_bytes == 3 * 4096
    index.check_invariants()


def test_bad_arguments_are_refused():
    index = DiskIndex()
    rid = index.add(key(1, 1), -1, 0, 0, 1, 0)
    for args in [(-1, 1), (MAX_SALTS, 1), (0, 0), (0, 1 << 32)]:
        with pytest.raises(ValueError):
            index.add(key(2, 2), -1, args[0], 4096, args[1], 0)
    with pytest.raises(ValueError):
        index.add(key(2, 2), -1, 0, 100, 1, 0)  # not aligned
    with pytest.raises(ValueError):
        index.unhold(rid)
    index.remove(rid)
    for call in (index.remove, index.hold, index.touch):
        with pytest.raises(ValueError):
            call(rid)
    with pytest.raises(ValueError):
        index.add(key(2, 2), rid, 0, 0, 1, 0)  # a parent that is gone
    index.load(Replayed.empty(), np.zeros(0, np.int64))
    index.add(key(3, 3), -1, 0, 0, 1, 0)
    with pytest.raises(ValueError):
        index.load(Replayed.empty(), np.zeros(0, np.int64))


def synthetic(chunks: int, prompt_chunks: int = 8, salts: int = 4, seed: int = 0) -> Replayed:
    """A journal's worth of prompts of `prompt_chunks` chunks each, 512 KiB apiece."""
    rng = np.random.default_rng(seed)
    keys = rng.integers(0, 2**63, size=(chunks, 2), dtype=np.int64).astype(np.uint64)
    parents = np.zeros_like(keys)
    follows = np.arange(chunks) % prompt_chunks != 0
    parents[follows] = keys[np.flatnonzero(follows) - 1]
    size = 512 * 1024
    salt_ids = (np.arange(chunks) // prompt_chunks % salts).astype(np.uint64)
    return Replayed(keys, parents, salt_ids,
                    np.arange(chunks, dtype=np.int64) * size, np.full(chunks, size, np.int64),
                    np.zeros(chunks, np.uint32))


def loaded(chunks: int) -> tuple[DiskIndex, Replayed, float]:
    replayed = synthetic(chunks)
    index = DiskIndex()
    started = time.perf_counter()
    index.load(replayed, replayed.salts.astype(np.int64))
    return index, replayed, time.perf_counter() - started


def test_a_chunk_costs_under_128_bytes_and_load_finds_every_parent():
    index, replayed, _ = loaded(300_000)
    assert index.memory_bytes() / len(index) <= 128
    assert index.find(replayed.keys[7].tobytes()) == 7
    assert index.parent(7) == 6 and index.parent(8) == -1
    assert index.victim() == 7 and index.victim(1) == 15  # each prompt's end, oldest first
    rid = index.add(key(1, 1), 7, 0, 1 << 40, 100, 0)
    assert index.victim() == 15 and index.parent(rid) == 7


def test_adds_cost_as_little_as_a_load():
    index = DiskIndex()
    replayed = synthetic(50_000)
    for row in range(len(replayed)):
        index.add(replayed.keys[row].tobytes(), row - 1 if row % 8 else -1, row % 4,
                  int(replayed.offsets[row]), int(replayed.nbytes[row]), 0)
    index.check_invariants()
    assert index.memory_bytes() / len(index) <= 128


def measure(chunks: int, lookups: int = 200_000) -> dict[str, float]:
    """Bytes a chunk, µs a find() of a stored key, seconds of load(), live() and of a
    remove() of a parent (the pass over the parent column), at `chunks`."""
    index, replayed, load_s = loaded(chunks)
    rng = np.random.default_rng(1)
    probes = [replayed.keys[row].tobytes() for row in rng.integers(0, chunks, lookups)]
    find = index.find
    passes = []
    for _ in range(3):  # the best of three: the machine's other work only slows one down
        started = time.perf_counter()
        for probe in probes:
            find(probe)
        passes.append((time.perf_counter() - started) / lookups * 1e6)
    find_us = min(passes)
    started = time.perf_counter()
    index.live(np.arange(4, dtype=np.uint64))
    live_s = time.perf_counter() - started
    started = time.perf_counter()
    index.remove(0)
    remove_parent_s = time.perf_counter() - started
    return {"chunks": chunks, "bytes_per_chunk": index.memory_bytes() / chunks,
            "find_us": find_us, "load_s": load_s, "live_s": live_s,
            "remove_parent_s": remove_parent_s}


if __name__ == "__main__":
    for count in [int(arg) for arg in sys.argv[1:]] or [100_000, 1_000_000, 10_000_000]:
        print(measure(count), flush=True)
