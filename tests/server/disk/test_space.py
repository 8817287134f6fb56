"""The disk tier's rules of room and of salts: caps and eviction make space, a reservation
sends eviction to the salt furthest over its own, a salt with nothing on disk gives its id
back (and, every id taken, the salt with the fewest chunks does), choosing costs the same
at 100 salts and at 16,384, and a failed write shrinks the tier (out of room) or stops its
writes (anything else) for a while, then it tries again."""

from __future__ import annotations

import errno
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_mp.server.disk import space as space_module
from lmcache_mp.server.disk.index import MAX_SALTS
from lmcache_mp.server.disk.space import RETRY_S, DiskCounters, DiskSpace

from ...utils import FakeClock, lines_run

CHUNK = 512 * 1024
PAGE = 4096


def space(capacity: int = 8 * CHUNK, reserves: dict[str, int] | None = None
          ) -> tuple[DiskSpace, FakeClock]:
    clock = FakeClock()
    table = {} if reserves is None else reserves
    return DiskSpace(capacity, DiskCounters(), "/disk", lambda salt: table.get(salt, 0),
                     clock), clock


def key(*parts: int) -> bytes:
    return b"".join(part.to_bytes(4, "little") for part in parts).ljust(16, b"\0")


def fill(disk: DiskSpace, chunks: int, salt: str = "salt-0", parent: bytes | None = None,
         nbytes: int = CHUNK, tag: int = 0) -> list[bytes]:
    """A prompt of `chunks` chunks of `salt`, written."""
    keys = []
    for i in range(chunks):
        chunk_key = key(tag, len(disk.index), i, hash(salt) & 0xFFFF)
        placed = disk.allocate(salt, nbytes, None)
        assert placed is not None
        disk.written(chunk_key, parent, *placed, nbytes, 0)
        parent = chunk_key
        keys.append(chunk_key)
    return keys


def test_room_is_made_from_the_end_of_the_least_recent_prompt():
    disk, _ = space(4 * CHUNK)
    first = fill(disk, 2)
    second = fill(disk, 2, salt="salt-1")
    assert disk.allocate("salt-2", CHUNK, None) is not None  # evicts one chunk
    index = disk.index
    assert index.find(first[1]) < 0 and index.find(first[0]) >= 0
    assert all(index.find(key) >= 0 for key in second)
    assert disk.counters.evictions == 1


def test_room_for_others_is_not_made_from_a_salts_reservation():
    disk, _ = space(4 * CHUNK, reserves={"salt-0": 2 * CHUNK})
    reserved = fill(disk, 2)  # the least recent chunks, within salt-0's reservation
    other = fill(disk, 2, salt="salt-1")
    placed = disk.allocate("salt-2", CHUNK, None)
    assert placed is not None
    index = disk.index
    assert all(index.find(key) >= 0 for key in reserved)
    assert index.find(other[1]) < 0 and index.find(other[0]) >= 0
    # Salt 0 itself may make room from its own reserved chunks, once no other's is left.
    assert disk.allocate("salt-0", CHUNK, None) is not None  # other[0], least recent, goes
    assert index.find(other[0]) < 0 and all(index.find(key) >= 0 for key in reserved)
    disk.not_written(placed[0], placed[1], CHUNK)  # salt 2's write failed: its room is free
    assert disk.allocate("salt-0", CHUNK, None) is not None
    assert disk.allocate("salt-0", CHUNK, None) is not None
    assert index.find(reserved[1]) < 0


def test_the_salt_furthest_over_its_reservation_gives_room_first():
    disk, _ = space(6 * CHUNK, reserves={"held": 2 * CHUNK, "big": CHUNK})
    fill(disk, 2, salt="held")  # least recent, within its reservation
    big = fill(disk, 3, salt="big")  # 2 chunks over its reservation
    small = fill(disk, 1, salt="small")  # 1 chunk over none
    assert disk.allocate("new", CHUNK, None) is not None
    assert disk.index.find(big[2]) < 0 and disk.index.find(small[0]) >= 0
    assert disk.allocate("new", CHUNK, None) is not None  # big and small are 1 over: a tie
    assert disk.counters.evictions == 2


def test_a_salts_cap_counts_its_writes_in_flight():
    disk, _ = space()
    assert disk.allocate("salt-0", CHUNK, 2 * CHUNK) is not None
    assert disk.allocate("salt-0", CHUNK, 2 * CHUNK) is not None
    # Nothing of salt 0 is on disk yet to make room with: the third is refused.
    assert disk.allocate("salt-0", CHUNK, 2 * CHUNK) is None
    assert disk.allocate("salt-1", CHUNK, 2 * CHUNK) is not None


def test_a_salt_with_nothing_on_disk_gives_its_id_back():
    disk, _ = space(4 * CHUNK)
    keys = fill(disk, 2, salt="gone")
    sid = disk.salt_ids["gone"]
    placed = disk.allocate("gone", CHUNK, None)
    assert placed is not None and placed == (sid, placed[1])
    for chunk_key in reversed(keys):
        disk.drop(disk.index.find(chunk_key))
    assert disk.salt_ids["gone"] == sid  # a write in flight keeps it
    disk.not_written(*placed, CHUNK)
    assert "gone" not in disk.salt_ids and disk.usage("gone") == (0, 0)
    fill(disk, 1, salt="next")
    assert disk.salt_ids["next"] == sid and disk.usage("next") == (CHUNK, 1)
    assert disk.usage("gone") == (0, 0) and disk.snapshot().salts == 1
    # A salt refused room holds nothing: it keeps no id either.
    assert disk.allocate("capped", CHUNK, 0) is None and "capped" not in disk.salt_ids


def test_every_id_taken_the_salt_with_fewest_chunks_gives_its_id_back():
    """65,536 salts of one chunk each, a few with more, one reserved, one writing: a new
    salt's chunk is written, and the id it takes is that of a one-chunk salt."""
    disk, _ = space(MAX_SALTS * PAGE + 8 * PAGE, reserves={"reserved": PAGE})
    fill(disk, 1, salt="reserved", nbytes=PAGE)
    writing = disk.allocate("writing", PAGE, None)
    assert writing is not None
    for n in range(3):
        fill(disk, 2, salt=f"big-{n}", nbytes=PAGE)
    while len(disk.salt_names) < MAX_SALTS:
        fill(disk, 1, salt=f"made-up-{len(disk.salt_names)}", nbytes=PAGE)
    assert disk.counters.salts_reclaimed == 0 and disk.snapshot().salts == MAX_SALTS
    before = dict(disk.salt_ids)
    new = fill(disk, 1, salt="new-tenant", nbytes=PAGE)
    assert disk.index.find(new[0]) >= 0
    gone = set(before) - set(disk.salt_ids)
    assert len(gone) == 1 and gone.pop().startswith("made-up-")
    assert {"reserved", "writing", "big-0"} <= set(disk.salt_ids)
    assert disk.counters.salts_reclaimed == 1 and disk.counters.salts_examined == 1
    # Once no salt may give its id back, chunks of new salts are not written.
    disk, _ = space(MAX_SALTS * PAGE, reserves={f"r{n}": PAGE for n in range(MAX_SALTS)})
    for n in range(MAX_SALTS):
        fill(disk, 1, salt=f"r{n}", nbytes=PAGE)
    assert disk.allocate("one-too-many", PAGE, None) is None
    assert "one-too-many" not in disk.salt_ids and disk.index.salt_chunks(0) == 1


def salt_scan_work(salts: int, chunks: int = 128) -> tuple[float, float]:
    """The salt-scan attack on a full tier: one tiny chunk under each of `salts` salts, the
    least recent chunks a reserved salt's, then `chunks` chunks under salts not seen yet.
    Lines run per chunk placed, and salts examined per chunk."""
    disk, _ = space((salts + 8) * PAGE, reserves={"reserved": 8 * PAGE})
    fill(disk, 8, salt="reserved", nbytes=PAGE)
    for n in range(salts):
        fill(disk, 1, salt=f"made-up-{n}", nbytes=PAGE)
    examined = disk.counters.salts_examined

    def attack() -> None:
        for n in range(chunks):
            placed = disk.allocate(f"unseen-{n}", PAGE, None)
            assert placed is not None
            disk.written(key(9, n), None, *placed, PAGE, 0)
    _, lines = lines_run(attack)
    assert disk.index.salt_chunks(disk.salt_ids["reserved"]) == 8
    assert disk.counters.evictions == chunks
    return lines / chunks, (disk.counters.salts_examined - examined) / chunks


def test_choosing_a_victim_past_a_reservation_costs_the_same_at_16384_salts():
    """Issue 43: the walk over every salt ever seen took a bystander's PING to seconds."""
    few_lines, few_examined = salt_scan_work(100)
    many_lines, many_examined = salt_scan_work(16_384)
    assert few_examined == many_examined == 1
    assert many_lines <= 1.1 * few_lines + 5, (few_lines, many_lines)


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
    fill(disk, 1, salt="salt-1")
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


# ---------------------------------------------------------------------------
# The rules against a model: chunks of one size, no prompts, four salt ids for five salts.

NAMES = ["a", "b", "c", "d", "e"]
MODEL_IDS = 4
MODEL_CHUNKS = 4


class SpaceModel:
    """What the doc says: chunks least recent first, writes in flight, reservations."""

    def __init__(self) -> None:
        self.chunks: list[tuple[bytes, str]] = []  # least recent first
        self.pending: Counter[str] = Counter()
        self.reserves: dict[str, int] = {}

    def count(self, salt: str, chunks: list[tuple[bytes, str]]) -> int:
        return sum(1 for _, owner in chunks if owner == salt)

    def outcomes(self, salt: str, cap: int | None) -> set[tuple[bool, frozenset[bytes]]]:
        """Every (placed, chunks evicted) allocate() may give: ties go either way."""
        holders = {owner for _, owner in self.chunks} | {s for s, n in self.pending.items() if n}
        results: set[tuple[bool, frozenset[bytes]]] = set()
        if salt in holders or len(holders) < MODEL_IDS:
            self._place(salt, cap, list(self.chunks), results)
            return results
        idle = [s for s in holders if not self.pending[s] and not self.reserves.get(s)]
        if not idle:
            return {(False, frozenset())}
        fewest = min(self.count(s, self.chunks) for s in idle)
        for giver in idle:
            if self.count(giver, self.chunks) == fewest:
                self._place(salt, cap, [c for c in self.chunks if c[1] != giver], results)
        return results

    def _place(self, salt: str, cap: int | None, chunks: list[tuple[bytes, str]],
               results: set) -> None:
        gone = frozenset(k for k, _ in self.chunks) - {k for k, _ in chunks}
        mine = self.count(salt, chunks) + self.pending[salt]
        if cap is not None and (mine + 1) * CHUNK > cap:
            own = [c for c in chunks if c[1] == salt]
            if not own:
                results.add((False, gone))
                return
            chunks.remove(own[0])
            self._place(salt, cap, chunks, results)
            return
        if len(chunks) + sum(self.pending.values()) < MODEL_CHUNKS:
            results.add((True, gone))
            return
        for victim in self._victims(salt, chunks):
            self._place(salt, cap, [c for c in chunks if c != victim], results)
        if not chunks or not self._victims(salt, chunks):
            results.add((False, gone))

    def _victims(self, salt: str, chunks: list[tuple[bytes, str]]) -> list:
        if not chunks:
            return []
        if not self._reserved(chunks[0][1], salt, chunks):
            return [chunks[0]]
        own = [c for c in chunks if c[1] == salt]
        if own:
            return [own[0]]
        excess = {s: self.count(s, chunks) * CHUNK - self.reserves.get(s, 0)
                  for _, s in chunks}
        allowed = [s for s, over in excess.items()
                   if over > 0 and not self._reserved(s, salt, chunks)]
        if not allowed:
            return []
        furthest = max(excess[s] for s in allowed)
        return [next(c for c in chunks if c[1] == s) for s in allowed if excess[s] == furthest]

    def _reserved(self, owner: str, salt: str, chunks: list) -> bool:
        reserve = self.reserves.get(owner, 0)
        return owner != salt and bool(reserve) and \
            (self.count(owner, chunks) - 1) * CHUNK < reserve


class SpaceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.saved_max = space_module.MAX_SALTS
        space_module.MAX_SALTS = MODEL_IDS
        self.model = SpaceModel()
        self.disk, _ = space(MODEL_CHUNKS * CHUNK, self.model.reserves)
        self.in_flight: list[tuple[str, int, int, bytes]] = []
        self.serial = 0

    def teardown(self) -> None:
        space_module.MAX_SALTS = self.saved_max

    @rule(salt=st.sampled_from(NAMES), cap=st.sampled_from([None, None, CHUNK, 2 * CHUNK]),
          finish=st.booleans())
    def allocate(self, salt: str, cap: int | None, finish: bool) -> None:
        expected = self.model.outcomes(salt, cap)
        placed = self.disk.allocate(salt, CHUNK, cap)
        present = {k for k, _ in self.model.chunks if self.disk.index.find(k) >= 0}
        gone = frozenset(k for k, _ in self.model.chunks) - present
        assert (placed is not None, gone) in expected
        self.model.chunks = [c for c in self.model.chunks if c[0] in present]
        if placed is None:
            return
        assert self.disk.salt_names[placed[0]] == salt
        self.serial += 1
        self.model.pending[salt] += 1
        self.in_flight.append((salt, *placed, key(7, self.serial)))
        if finish:
            self.finish(len(self.in_flight) - 1, True)

    @precondition(lambda self: self.in_flight)
    @rule(which=st.integers(0, 10), ok=st.booleans())
    def finish(self, which: int, ok: bool) -> None:
        salt, sid, offset, chunk_key = self.in_flight.pop(which % len(self.in_flight))
        assert self.disk.salt_ids[salt] == sid  # a write in flight keeps its salt's id
        self.model.pending[salt] -= 1
        if ok:
            self.disk.written(chunk_key, None, sid, offset, CHUNK, 0)
            self.model.chunks.append((chunk_key, salt))
        else:
            self.disk.not_written(sid, offset, CHUNK)

    @precondition(lambda self: self.model.chunks)
    @rule(which=st.integers(0, 10))
    def drop(self, which: int) -> None:
        chunk_key, _ = self.model.chunks.pop(which % len(self.model.chunks))
        self.disk.drop(self.disk.index.find(chunk_key))

    @rule(salt=st.sampled_from(NAMES),
          reserve=st.sampled_from([0, CHUNK // 2, CHUNK, 3 * CHUNK // 2, 2 * CHUNK]))
    def reserve(self, salt: str, reserve: int) -> None:
        self.model.reserves[salt] = reserve
        self.disk.quota_changed(salt)

    @invariant()
    def agrees(self) -> None:
        disk, model = self.disk, self.model
        holders = {s for _, s in model.chunks} | {s for s, n in model.pending.items() if n}
        assert set(disk.salt_ids) == holders
        assert len(set(disk.salt_ids.values())) == len(holders) <= MODEL_IDS
        for sid in disk._free_ids:
            assert not disk.index.salt_chunks(sid) and not disk.pending[sid]
        for salt in NAMES:
            count = model.count(salt, model.chunks)
            assert disk.usage(salt) == (count * CHUNK, count)
        order = [disk.index.find(k) for k, _ in model.chunks]
        assert disk.index.victim() == (order[0] if order else -1)
        for chunk_key, salt in model.chunks:
            assert disk.salt_names[disk.index.salt(disk.index.find(chunk_key))] == salt


TestSpaceAgainstModel = SpaceMachine.TestCase
TestSpaceAgainstModel.settings = settings(max_examples=200, stateful_step_count=40,
                                          deadline=None)

