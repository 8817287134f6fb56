"""Warm restart: a server stopped with SIGTERM leaves its pool segment and a signed index
snapshot in its private directory, and the next one (same runtime directory, so the same
snapshot key) serves every committed chunk again byte for byte, with the chunks' parent
links and recency, so a squeeze still leaves prefixes; a chunk whose bytes changed is
dropped with what follows it; after SIGKILL, an unknown format, another key or another
pool size it starts cold and leaves no stale segment; two servers never share a segment."""

from __future__ import annotations

import contextlib
import gc
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.server.cache.chunk import SavedIndex
from lmcache_mp.server.memory.geometry import Geometry
from lmcache_mp.server.warm import snapshot
from lmcache_mp.server.warm.segment import KEY_NAME, segment_dir

from ...utils import run_server, server_process, started_process
from ...workers import (
    BLOCKS_PER_CHUNK,
    MODEL,
    Job,
    chunk_blocks,
    expected_blocks,
    make_cache,
    prompt,
    retrieve_worker,
    run,
    store_worker,
)

NUM_BLOCKS = 8 * BLOCKS_PER_CHUNK
CAPACITY = 64 * 1024**2  # run_server's --cpu-size


@dataclass
class Segment:
    """A fresh segment name and a runtime directory that outlives each server (its
    snapshot key with it)."""

    name: str
    runtime_dir: str

    @property
    def path(self) -> Path:
        return segment_dir() / self.name

    @property
    def snapshot(self) -> Path:
        return segment_dir() / f"{self.name}.snapshot"

    def key(self) -> bytes:
        return (Path(self.runtime_dir) / KEY_NAME).read_text().strip().encode()

    def server(self, *args: str):
        return run_server("--pool-segment", self.name, *args, runtime_dir=self.runtime_dir)

    def read(self) -> tuple[SavedIndex, np.ndarray]:
        return snapshot.decode([self.key()], self.snapshot.read_bytes(), CAPACITY, 256)

    def rewrite(self, index: SavedIndex, checksums: np.ndarray,
                key: bytes | None = None) -> None:
        self.snapshot.write_bytes(snapshot.encode(key or self.key(), CAPACITY, 256, index,
                                                  checksums))


@pytest.fixture
def segment(tmp_path):
    """A fresh segment; whatever the servers leave under its name is removed."""
    made = Segment(f"lmcache-mp-test-{uuid.uuid4().hex[:12]}", str(tmp_path))
    yield made
    for path in (made.path, made.snapshot):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def store(server, hashes, seed: int, salt: str = "") -> None:
    statuses = run(store_worker, Job(server.url, NUM_BLOCKS, seed, hashes,
                                     chunk_blocks(list(range(len(hashes)))), cache_salt=salt))
    assert statuses == [bytes([StoreStatus.STORED] * len(hashes))]


def hits(server, hashes, salt: str = "") -> int:
    with CacheClient(server.url, timeout=10) as client:
        (hit,) = client.lookup(MODEL, 1, [LookupItem.build("probe", hashes, salt)])
    return hit


def retrieves_byte_exact(server, hashes, seed: int, salt: str = "") -> None:
    result = run(retrieve_worker, Job(server.url, NUM_BLOCKS, None, hashes,
                                      chunk_blocks(list(range(8 - len(hashes), 8))), salt))
    assert (result.hit, result.retrieved) == (len(hashes), len(hashes))
    assert torch.equal(result.blocks, expected_blocks(
        NUM_BLOCKS, seed, chunk_blocks(list(range(len(hashes))))))


def test_sigterm_then_start_again_serves_every_chunk_byte_exact(segment):
    first, second = prompt(tag=1601, num_chunks=4), prompt(tag=1602, num_chunks=2)
    with segment.server() as server:
        store(server, first, seed=21)
        store(server, second, seed=22, salt="tenant-b")
    assert segment.snapshot.exists() and segment.path.stat().st_mode & 0o777 == 0o600
    assert segment_dir().stat().st_mode & 0o777 == 0o700
    with segment.server() as server:
        assert not segment.snapshot.exists()  # used once: a crash now would start cold
        retrieves_byte_exact(server, first, seed=21)
        retrieves_byte_exact(server, second, seed=22, salt="tenant-b")
        assert hits(server, second) == 0  # salts stay apart
        with CacheClient(server.url, timeout=10) as client:
            assert client.stats().chunks == 6
        # A third life: what the second one stored is kept too.
        third = prompt(tag=1603, num_chunks=1)
        store(server, third, seed=23)
    with segment.server() as server:
        assert hits(server, first) == 4 and hits(server, third) == 1


def test_sigkill_then_start_again_is_cold_with_no_stale_segment(segment):
    hashes = prompt(tag=1610, num_chunks=2)
    server = server_process(None, ["--cpu-size", "64MiB", "--pool-segment", segment.name],
                            segment.runtime_dir)
    with server:
        store(server, hashes, seed=31)
        inode = segment.path.stat().st_ino
        started_process(server).kill()
        started_process(server).wait()
    assert not segment.snapshot.exists()
    with segment.server("--log-level", "info") as server:
        assert hits(server, hashes) == 0
        assert segment.path.stat().st_ino != inode  # the stale one was removed
        assert "cold start" in server.output() and "did not stop cleanly" in server.output()
    assert sorted(p.name for p in segment_dir().iterdir() if p.name.startswith(segment.name)) \
        == [segment.name, f"{segment.name}.snapshot"]


def flip_chunk_byte(segment: Segment, chunk: int = 0) -> None:
    index, _ = segment.read()
    offset = int(index.offsets[chunk])
    with open(segment.path, "r+b") as pool:
        pool.seek(offset + 1000)
        byte = pool.read(1)
        pool.seek(offset + 1000)
        pool.write(bytes([byte[0] ^ 0xFF]))


def test_a_chunk_whose_bytes_changed_is_dropped_with_the_chunks_after_it(segment):
    first, other = prompt(tag=1615, num_chunks=3), prompt(tag=1616, num_chunks=2)
    with segment.server() as server:
        store(server, first, seed=35)
        store(server, other, seed=36, salt="b")
    index, _ = segment.read()
    second_of_first = index.hashes.index(first[1]) // 16
    flip_chunk_byte(segment, second_of_first)
    with segment.server("--log-level", "info") as server:
        assert "1 chunks do not match their checksums" in server.output()
        assert "dropped 1 chunks whose prompt's earlier chunks were not adopted" \
            in server.output()
        assert hits(server, first) == 1 and hits(server, other, "b") == 2
        retrieves_byte_exact(server, first[:1], seed=35)
        retrieves_byte_exact(server, other, seed=36, salt="b")
        with CacheClient(server.url, timeout=10) as client:
            assert client.stats().chunks == 3
        # The dropped chunks' room is free again.
        assert run(store_worker, Job(server.url, NUM_BLOCKS, 35, first, chunk_blocks(
            [0, 1, 2]))) == [bytes([StoreStatus.ALREADY_STORED, StoreStatus.STORED,
                                    StoreStatus.STORED])]
        retrieves_byte_exact(server, first, seed=35)


def resign(segment: Segment, **changes) -> None:
    """The snapshot again, with `changes` to its header fields, signed as a server would."""
    index, checksums = segment.read()
    segment.snapshot.write_bytes(snapshot.encode(
        segment.key(), changes.get("capacity", CAPACITY), changes.get("chunk_size", 256),
        index, checksums))


def wrong_format(segment: Segment) -> None:
    raw = bytearray(segment.snapshot.read_bytes())
    raw[4:6] = (99).to_bytes(2, "little")
    segment.snapshot.write_bytes(bytes(raw))


@pytest.mark.parametrize("spoil, restart_args, reason", [
    (wrong_format, (), "snapshot format 99"),
    (lambda seg: seg.rewrite(*seg.read(), key=b"another server's key, not ours"), (),
     "not signed with this server's snapshot key"),
    (lambda seg: seg.snapshot.write_bytes(b"\xc1garbage"), (), "not a snapshot"),
    (lambda seg: seg.snapshot.write_bytes(b"\xc1garbage" * 100), (), "not a snapshot"),
    (lambda seg: resign(seg, chunk_size=128), (), "chunks of 128 tokens"),
    (lambda seg: None, ("--cpu-size", "32MiB"), "pool"),
    (lambda seg: None, ("--adopt", "never"), "--adopt never"),
])
def test_a_snapshot_that_does_not_match_starts_cold(segment, spoil, restart_args, reason):
    hashes = prompt(tag=1620, num_chunks=3)
    with segment.server() as server:
        store(server, hashes, seed=41)
    spoil(segment)
    with segment.server("--log-level", "info", *restart_args) as server:
        assert hits(server, hashes) == 0
        assert "cold start" in server.output() and reason in server.output()
        store(server, hashes, seed=42)  # the new segment takes chunks


def test_another_runtime_directory_signs_with_another_key(segment, tmp_path_factory):
    hashes = prompt(tag=1621, num_chunks=2)
    with segment.server() as server:
        store(server, hashes, seed=43)
    with run_server("--pool-segment", segment.name, "--log-level", "info",
                    runtime_dir=str(tmp_path_factory.mktemp("elsewhere"))) as server:
        assert hits(server, hashes) == 0
        assert "not signed with this server's snapshot key" in server.output()


def test_adopt_require_refuses_to_start_cold_and_segments_are_not_shared(segment):
    cold = server_process(None, ["--cpu-size", "64MiB", "--pool-segment", segment.name,
                                "--adopt", "require"], segment.runtime_dir)
    with pytest.raises(RuntimeError, match="exited with 2"):
        cold.start()
    assert "--adopt require" in cold.output()
    cold.close()
    with segment.server():
        twin = server_process(None, ["--cpu-size", "64MiB", "--pool-segment", segment.name])
        with pytest.raises(RuntimeError, match="exited with 2"):
            twin.start()
        assert "in use by another server" in twin.output()
        twin.close()


def test_segment_names_are_checked(capsys):
    from lmcache_mp.server.config import Config
    for bad in ("../etc/passwd", "a/b", "", ".hidden"):
        with pytest.raises(SystemExit):
            Config.from_args(["--pool-segment", bad], env={})
        assert "error:" in capsys.readouterr().err


def saved_index(entries) -> SavedIndex:
    """A SavedIndex of (hash byte, offset, parent index, recency) entries of one scope."""

    shape = Geometry("mha", 1, (2, 16, 1, 64), "float16", 1)  # 4 KiB chunks
    return SavedIndex(
        [(MODEL, 1, 0, "")], [shape], np.zeros(len(entries), np.uint32),
        np.zeros(len(entries), np.uint32), np.array([e[1] for e in entries], np.uint64),
        b"".join(bytes([e[0]] * 16) for e in entries), np.array([e[2] for e in entries]),
        np.array([e[3] for e in entries], np.uint64))


def test_adopting_takes_exactly_the_saved_extents():
    from lmcache_mp.server.cache.pool import ExtentAllocator
    from lmcache_mp.server.cache.store import ChunkStore

    allocator = ExtentAllocator(16 * 4096)
    store = ChunkStore(allocator, lease_timeout=60)
    index = saved_index([(0, 4 * 4096, -1, 5), (1, 9 * 4096, -1, 6), (2, 12 * 4096, 1, 7)])
    assert store.adopt_run(index, np.ones(3, bool)) == 3
    assert store.lookup(MODEL, 1, "", [bytes(16)]) == 1 and store.num_chunks == 3
    store.check_invariants()
    with pytest.raises(ValueError):  # only into an empty store
        store.adopt_run(index, np.ones(3, bool))
    free = [allocator.allocate(4096) for _ in range(14)]
    assert free[-1] is None and sorted(page for page in free[:-1] if page is not None) == [
        page * 4096 for page in range(16) if page not in (4, 9, 12)]
    overlapping = saved_index([(0, 0, -1, 0), (1, 0, -1, 0)])
    with pytest.raises(ValueError):
        ChunkStore(ExtentAllocator(16 * 4096), lease_timeout=60).adopt_run(
            overlapping, np.ones(2, bool))


def test_adopt_drops_what_follows_a_chunk_that_is_not_intact():
    from lmcache_mp.server.cache.pool import ExtentAllocator
    from lmcache_mp.server.cache.quotas import Quota
    from lmcache_mp.server.cache.store import ChunkStore

    allocator = ExtentAllocator(16 * 4096)
    store = ChunkStore(allocator, lease_timeout=60)
    # Two prompts: 1 → 2 → 3 and 4 → 5; chunk 2 is damaged. Recency: 1 used last.
    index = saved_index([(1, 0, -1, 9), (2, 4096, 0, 2), (3, 2 * 4096, 1, 3),
                         (4, 3 * 4096, -1, 4), (5, 4 * 4096, 3, 5)])
    assert store.adopt_run(index, np.array([True, False, True, True, True])) == 3
    assert store.bytes_used == 3 * 4096  # the dropped chunks' extents stay free
    store.check_invariants()
    hashes = [bytes([n] * 16) for n in range(1, 6)]
    store.quotas.set("", Quota(cap=2 * 4096))
    # The least recently used chunk no other follows goes: 5, not 1 (used later), nor 4
    # (used before 5, but 5 follows it).
    assert store.enforce_cap("") == 1
    assert store.lookup(MODEL, 1, "", hashes[:3]) == 1
    assert store.lookup(MODEL, 1, "", hashes[3:]) == 1
    store.check_invariants()


class ChunkedPrompts:
    """Prompts stored through one registered cache the way vLLM stores them: a STORE per
    chunk, each naming the chunk before it; read back into other blocks and compared."""

    PROMPTS = {"a": (1630, 3, 0), "b": (1631, 2, 3)}  # name: (tag, chunks, first slot)

    def __init__(self, cache):
        self.cache = cache
        self.hashes = {name: prompt(tag, n) for name, (tag, n, _) in self.PROMPTS.items()}

    def register(self, client):
        return client.register_kv_cache(self.cache.handles(), model=MODEL, layout="mha",
                                        block_size=16)

    def store(self, client) -> None:
        registration = self.register(client)
        for name, (_, _, first) in self.PROMPTS.items():
            hashes = self.hashes[name]
            for i, chunk_hash in enumerate(hashes):
                (statuses,) = client.store(registration, [TransferItem.build(
                    "r", [chunk_hash], chunk_blocks([first + i]), "t",
                    parent_hash=hashes[i - 1] if i else b"")])
                assert statuses == bytes([StoreStatus.STORED])
        client.unregister(registration)

    def hit(self, client, name: str) -> int:
        (hit,) = client.lookup(MODEL, 1, [LookupItem.build("q", self.hashes[name], "t")])
        return hit

    def retrieves_byte_exact(self, client, name: str, count: int) -> None:
        """The prompt's first `count` chunks land in slots 5 on, equal to where they
        were stored from."""
        first = self.PROMPTS[name][2]
        registration = self.register(client)
        target = chunk_blocks(list(range(5, 5 + count)))
        assert client.retrieve(registration, [TransferItem.build(
            "q", self.hashes[name][:count], target, "t")]) == [count]
        assert torch.equal(
            self.cache.blocks(target).view(torch.uint8),
            self.cache.blocks(chunk_blocks(list(range(first, first + count)))).view(torch.uint8))
        client.unregister(registration)


def test_adopted_chunks_keep_their_parents_so_a_quota_cut_leaves_prefixes(segment):
    with make_cache(NUM_BLOCKS, 51) as cache:
        prompts = ChunkedPrompts(cache)
        with segment.server() as server, CacheClient(server.url, timeout=10) as client:
            prompts.store(client)
        with segment.server() as server, \
                CacheClient(server.url, admin=True, timeout=10) as client:
            for name, (_, chunks, _) in prompts.PROMPTS.items():
                assert prompts.hit(client, name) == chunks
                prompts.retrieves_byte_exact(client, name, chunks)
            # Each prompt's last chunk is used last: without their parents, the first
            # chunks would be the least recently used and go first.
            for hashes in prompts.hashes.values():
                assert client.lookup(MODEL, 1, [LookupItem.build("e", hashes[-1:], "t")]) \
                    == [1]
            stats = client.stats()
            chunk_bytes = stats.tenants["t"].bytes_used // stats.chunks
            client.quota_set("t", 2 * chunk_bytes)
            hits = {name: prompts.hit(client, name) for name in prompts.PROMPTS}
            assert sum(hits.values()) == client.stats().chunks == 2
            for name, hit in hits.items():
                if hit:
                    prompts.retrieves_byte_exact(client, name, hit)


def test_a_snapshot_keeps_parent_links_and_leaves_out_what_no_lookup_reaches(tmp_path):
    """save() and adopt() on stores of their own: links survive; a chunk whose parent
    CLEAR took while it was held is not saved, nor is a CPU chunk after one in the GPU
    tier (GPU memory does not outlive the server), so the next store never has them."""
    from lmcache_mp.server.cache.chunk import CPU_TIER, ChunkKey
    from lmcache_mp.server.cache.pool import CpuPool, ExtentAllocator
    from lmcache_mp.server.cache.quotas import Quota
    from lmcache_mp.server.cache.store import ChunkStore
    from lmcache_mp.server.memory.geometry import Geometry
    from lmcache_mp.server.warm.segment import WarmStart

    geometry = Geometry("mha", 1, (2, 16, 1, 64), "float16", 1)  # 4 KiB chunks
    capacity = 64 * geometry.chunk_bytes
    key = b"a snapshot key of thirty-two bytes or so"

    def chunk_key(n: int, salt: str = "") -> ChunkKey:
        return ChunkKey(MODEL, 1, 0, salt, bytes([n] * 16))

    def stored(store, keys, gpu_first: bool = False) -> None:
        for i, (k, parent) in enumerate(zip(keys, [None, *keys[:-1]])):
            chunk = store.reserve(k, geometry.chunk_bytes, geometry, on_gpu=gpu_first and not i,
                                  parent=parent).chunk
            if chunk.tier == CPU_TIER:
                pool.array[chunk.offset:chunk.offset + chunk.nbytes] = k.chunk_hash[0]
            store.commit(chunk)

    first = WarmStart("seg", capacity, 256, key, directory=tmp_path / "segments")
    pool = CpuPool(capacity, fd=first.open())
    store = ChunkStore(pool.allocator, lease_timeout=60,
                       gpu_allocator=ExtentAllocator(4 * geometry.chunk_bytes))
    kept = [chunk_key(n) for n in range(3)]
    orphaned = [chunk_key(n, "t") for n in range(3)]
    after_gpu = [chunk_key(n, "g") for n in range(3)]
    stored(store, kept)
    stored(store, orphaned)
    stored(store, after_gpu, gpu_first=True)
    assert store.hold_if_stored(orphaned[1], geometry) is not None  # as a read would
    assert store.clear("t") == 2  # chunks 0 and 2 of the salt go; chunk 1, held, is orphaned
    assert first.save(store, pool) == 3
    first.close()
    del pool, store  # its mapping holds the segment's lock, as the server's process does
    gc.collect()

    second = WarmStart("seg", capacity, 256, key, directory=tmp_path / "segments")
    pool = CpuPool(capacity, fd=second.open())
    assert second.cold_reason is None
    adopted = ChunkStore(pool.allocator, lease_timeout=60)
    assert second.adopt(adopted, pool) == 3
    second.close()
    adopted.check_invariants()
    assert adopted.num_chunks == 3 and "t" not in adopted.tenants and "g" not in adopted.tenants
    assert [adopted._chunks[k].parent for k in kept[1:]] == [adopted._chunks[k] for k in kept[:2]]
    assert all(pool.array[c.offset] == c.key.chunk_hash[0] for c in adopted.committed_chunks())
    adopted.quotas.set("", Quota(cap=geometry.chunk_bytes))
    assert adopted.enforce_cap("") == 2
    assert adopted.lookup(MODEL, 1, "", [k.chunk_hash for k in kept]) == 1
