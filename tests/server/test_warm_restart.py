"""Warm restart: a server stopped with SIGTERM leaves its pool segment and an index snapshot,
and the next one serves every committed chunk again byte for byte, with the chunks'
parent links, so a squeeze still leaves prefixes; after SIGKILL, a bad checksum, an
unknown (or parentless, older) snapshot format or another pool size it starts cold and
leaves no stale segment; two servers never share a segment."""

from __future__ import annotations

import contextlib
import uuid

import msgpack
import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus, TransferItem
from lmcache_mp.server.warm import SHM_DIR

from ..utils import run_server, server_process
from ..workers import (
    BLOCKS_PER_CHUNK, MODEL, Job, chunk_blocks, expected_blocks, make_cache, prompt,
    retrieve_worker, run, store_worker,
)

NUM_BLOCKS = 8 * BLOCKS_PER_CHUNK


@pytest.fixture
def segment():
    """A fresh segment name; whatever the servers leave in /dev/shm under it is removed."""
    name = f"lmcache-mp-test-{uuid.uuid4().hex[:12]}"
    yield name
    for path in (SHM_DIR / name, SHM_DIR / f"{name}.snapshot"):
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
    with run_server("--pool-segment", segment) as server:
        store(server, first, seed=21)
        store(server, second, seed=22, salt="tenant-b")
    snapshot = SHM_DIR / f"{segment}.snapshot"
    assert snapshot.exists() and (SHM_DIR / segment).stat().st_mode & 0o777 == 0o600
    with run_server("--pool-segment", segment) as server:
        assert not snapshot.exists()  # used once: a crash now would start cold
        retrieves_byte_exact(server, first, seed=21)
        retrieves_byte_exact(server, second, seed=22, salt="tenant-b")
        assert hits(server, second) == 0  # salts stay apart
        with CacheClient(server.url, timeout=10) as client:
            assert client.stats().chunks == 6
        # A third life: what the second one stored is kept too.
        third = prompt(tag=1603, num_chunks=1)
        store(server, third, seed=23)
    with run_server("--pool-segment", segment) as server:
        assert hits(server, first) == 4 and hits(server, third) == 1


def test_sigkill_then_start_again_is_cold_with_no_stale_segment(segment):
    hashes = prompt(tag=1610, num_chunks=2)
    server = server_process(None, ["--cpu-size", "64MiB", "--pool-segment", segment])
    with server:
        store(server, hashes, seed=31)
        inode = (SHM_DIR / segment).stat().st_ino
        server.proc.kill()
        server.proc.wait()
    assert not (SHM_DIR / f"{segment}.snapshot").exists()
    with run_server("--pool-segment", segment, "--log-level", "info") as server:
        assert hits(server, hashes) == 0
        assert (SHM_DIR / segment).stat().st_ino != inode  # the stale one was removed
        assert "cold start" in server.output() and "did not stop cleanly" in server.output()
    assert sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(segment)) == [
        segment, f"{segment}.snapshot"]


def flip_chunk_byte(segment: str) -> None:
    snapshot = msgpack.unpackb((SHM_DIR / f"{segment}.snapshot").read_bytes())
    offset = snapshot["chunks"][0][5]
    with open(SHM_DIR / segment, "r+b") as pool:
        pool.seek(offset + 1000)
        byte = pool.read(1)
        pool.seek(offset + 1000)
        pool.write(bytes([byte[0] ^ 0xFF]))


def rewrite_snapshot(segment: str, **changes) -> None:
    path = SHM_DIR / f"{segment}.snapshot"
    snapshot = msgpack.unpackb(path.read_bytes())
    snapshot.update(changes)
    path.write_bytes(msgpack.packb(snapshot, use_bin_type=True))


@pytest.mark.parametrize("spoil, restart_args, reason", [
    (flip_chunk_byte, (), "do not match their checksums"),
    (lambda name: rewrite_snapshot(name, format=99), (), "snapshot format 99"),
    # Format 1 named no parents: adopting its chunks as roots would break prefixes.
    (lambda name: rewrite_snapshot(name, format=1, chunks=[
        entry[:9] for entry in msgpack.unpackb(
            (SHM_DIR / f"{name}.snapshot").read_bytes())["chunks"]]),
     (), "snapshot format 1 is not one this server reads"),
    (lambda name: (SHM_DIR / f"{name}.snapshot").write_bytes(b"\xc1garbage"), (),
     "malformed"),
    (lambda name: None, ("--cpu-size", "32MiB"), "pool"),
    (lambda name: None, ("--adopt", "never"), "--adopt never"),
])
def test_a_snapshot_that_does_not_match_starts_cold(segment, spoil, restart_args, reason):
    hashes = prompt(tag=1620, num_chunks=3)
    with run_server("--pool-segment", segment) as server:
        store(server, hashes, seed=41)
    spoil(segment)
    with run_server("--pool-segment", segment, "--log-level", "info",
                    *restart_args) as server:
        assert hits(server, hashes) == 0
        assert "cold start" in server.output() and reason in server.output()
        store(server, hashes, seed=42)  # the new segment takes chunks


def test_adopt_require_refuses_to_start_cold_and_segments_are_not_shared(segment):
    cold = server_process(None, ["--cpu-size", "64MiB", "--pool-segment", segment,
                                "--adopt", "require"])
    with pytest.raises(RuntimeError, match="exited with 2"):
        cold.start()
    assert "--adopt require" in cold.output()
    cold.close()
    with run_server("--pool-segment", segment):
        twin = server_process(None, ["--cpu-size", "64MiB", "--pool-segment", segment])
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


def test_adopting_takes_exactly_the_saved_extents():
    from lmcache_mp.server.pool import ExtentAllocator
    from lmcache_mp.server.store import ChunkKey, ChunkStore

    allocator = ExtentAllocator(16 * 4096)
    store = ChunkStore(allocator, lease_timeout=60)
    key = ChunkKey(MODEL, 1, 0, "", bytes(16))
    assert store.adopt(key, 4 * 4096, 2 * 4096, "g")
    assert not store.adopt(key, 8 * 4096, 4096, "g")  # the key is taken
    assert not store.adopt(key._replace(chunk_hash=bytes([1] * 16)), 5 * 4096, 4096, "g")
    assert store.lookup(MODEL, 1, "", [bytes(16)]) == 1 and store.num_chunks == 1
    store.check_invariants()
    assert not allocator.take(100, 4096)  # not aligned
    assert not allocator.take(15 * 4096, 2 * 4096)  # past the end
    assert allocator.take(0, 4096) and allocator.take(15 * 4096, 4096)
    assert [allocator.allocate(4096) for _ in range(3)] == [4096, 2 * 4096, 3 * 4096]
    assert allocator.allocate(4096) == 6 * 4096


def test_adopt_needs_the_parent_adopted_first():
    from lmcache_mp.server.pool import ExtentAllocator
    from lmcache_mp.server.quotas import Quota
    from lmcache_mp.server.store import ChunkKey, ChunkStore

    allocator = ExtentAllocator(16 * 4096)
    store = ChunkStore(allocator, lease_timeout=60)
    first, second = (ChunkKey(MODEL, 1, 0, "", bytes([n] * 16)) for n in (1, 2))
    assert not store.adopt(second, 4096, 4096, "g", parent=first)
    assert store.bytes_used == 0  # its extent was not taken
    assert store.adopt(first, 0, 4096, "g") and store.adopt(second, 4096, 4096, "g", first)
    assert store.enforce_cap("") == 0
    store.quotas.set("", Quota(cap=4096))
    assert store.enforce_cap("") == 1  # the child, though adopted last
    assert store.lookup(MODEL, 1, "", [first.chunk_hash, second.chunk_hash]) == 1
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
        with run_server("--pool-segment", segment) as server, \
                CacheClient(server.url, timeout=10) as client:
            prompts.store(client)
        with run_server("--pool-segment", segment) as server, \
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


def test_chunks_after_one_the_snapshot_lacks_are_dropped_and_their_room_freed(segment):
    with make_cache(NUM_BLOCKS, 52) as cache:
        prompts = ChunkedPrompts(cache)
        with run_server("--pool-segment", segment) as server, \
                CacheClient(server.url, timeout=10) as client:
            prompts.store(client)
            chunk_bytes = client.stats().bytes_used // 5
        # Prompt a's first chunk leaves the snapshot, as a GPU-tier chunk would.
        first_of_a = prompts.hashes["a"][0]
        rewrite_snapshot(segment, chunks=[
            entry for entry in msgpack.unpackb(
                (SHM_DIR / f"{segment}.snapshot").read_bytes())["chunks"]
            if entry[4] != first_of_a])
        with run_server("--pool-segment", segment, "--log-level", "info") as server, \
                CacheClient(server.url, timeout=10) as client:
            assert "adopted 2 chunks" in server.output()
            assert "dropped 2 chunks" in server.output()
            assert (prompts.hit(client, "a"), prompts.hit(client, "b")) == (0, 2)
            stats = client.stats()
            assert (stats.chunks, stats.bytes_used) == (2, 2 * chunk_bytes)
            prompts.retrieves_byte_exact(client, "b", 2)


def test_a_snapshot_keeps_parent_links_and_leaves_out_orphans(tmp_path):
    """save() and adopt() on stores of their own: links survive, and a chunk whose parent
    CLEAR took while it was held is not saved, so the next store never has it."""
    from lmcache_mp.server.pool import ExtentAllocator
    from lmcache_mp.server.quotas import Quota
    from lmcache_mp.server.registry import Geometry
    from lmcache_mp.server.store import ChunkKey, ChunkStore
    from lmcache_mp.server.warm import WarmStart

    geometry = Geometry("mha", 1, (2, 16, 1, 64), "float16", 1)  # 4 KiB chunks
    capacity = 64 * geometry.chunk_bytes

    def chunk_key(n: int, salt: str = "") -> ChunkKey:
        return ChunkKey(MODEL, 1, 0, salt, bytes([n] * 16))

    def stored(store, keys) -> None:
        for k, parent in zip(keys, [None, *keys[:-1]]):
            store.commit(store.reserve(k, geometry.chunk_bytes, geometry, parent=parent).chunk)

    first = WarmStart("seg", capacity, 256, directory=tmp_path)
    first.open()
    store = ChunkStore(ExtentAllocator(capacity), lease_timeout=60)
    kept = [chunk_key(n) for n in range(3)]
    orphaned = [chunk_key(n, "t") for n in range(3)]
    stored(store, kept)
    stored(store, orphaned)
    assert store.hold_if_stored(orphaned[1], geometry) is not None  # as a read would
    assert store.clear("t") == 2  # chunks 0 and 2 of the salt go; chunk 1, held, is orphaned
    assert first.save(store) == 3
    first.close()

    second = WarmStart("seg", capacity, 256, directory=tmp_path)
    second.open()
    assert second.cold_reason is None
    adopted = ChunkStore(ExtentAllocator(capacity), lease_timeout=60)
    assert second.adopt(adopted) == 3
    second.close()
    adopted.check_invariants()
    assert adopted.num_chunks == 3 and "t" not in adopted.tenants
    assert [adopted._chunks[k].parent for k in kept[1:]] == [adopted._chunks[k] for k in kept[:2]]
    adopted.quotas.set("", Quota(cap=geometry.chunk_bytes))
    assert adopted.enforce_cap("") == 2
    assert adopted.lookup(MODEL, 1, "", [k.chunk_hash for k in kept]) == 1
