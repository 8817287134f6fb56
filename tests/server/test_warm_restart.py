"""Warm restart: a server stopped with SIGTERM leaves its pool segment and an index snapshot,
and the next one serves every committed chunk again byte for byte; after SIGKILL, a bad
checksum, an unknown snapshot format or another pool size it starts cold and leaves no
stale segment; two servers never share a segment."""

from __future__ import annotations

import contextlib
import uuid

import msgpack
import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus
from lmcache_mp.spawn import ServerProcess
from lmcache_mp.server.warm import SHM_DIR

from ..utils import run_server
from ..workers import (
    BLOCKS_PER_CHUNK, MODEL, Job, chunk_blocks, expected_blocks, prompt, retrieve_worker, run,
    store_worker,
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
    server = ServerProcess(None, ["--cpu-size", "64MiB", "--pool-segment", segment])
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
    cold = ServerProcess(None, ["--cpu-size", "64MiB", "--pool-segment", segment,
                                "--adopt", "require"])
    with pytest.raises(RuntimeError, match="exited with 2"):
        cold.start()
    assert "--adopt require" in cold.output()
    cold.close()
    with run_server("--pool-segment", segment):
        twin = ServerProcess(None, ["--cpu-size", "64MiB", "--pool-segment", segment])
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
