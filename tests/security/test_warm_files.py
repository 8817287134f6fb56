"""Warm-restart files another local user (or a process without the snapshot key) plants or
squats: nothing of them is adopted, read past its checks, or able to stall or stop a start.

Each server here keeps its runtime directory (so its snapshot key) across restarts. The
attacks are planted both where this server keeps its files (a private directory only root
can write to: the tests play a process of the server's uid that lacks the key) and where
servers before it kept them, in world-writable /dev/shm."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import stat
import uuid
import zlib
from pathlib import Path

import msgpack
import pytest

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus
from lmcache_mp.server.warm.segment import SHM_DIR, segment_dir

from .. import workers
from ..utils import run_server, server_process, started_process
from ..workers import MODEL, Job, chunk_blocks, prompt, retrieve_worker, run, store_worker
from .agents import NOBODY

NUM_BLOCKS = 4 * workers.BLOCKS_PER_CHUNK
CAPACITY = 64 * 1024**2


@pytest.fixture
def name(tmp_path):
    """A fresh segment name; what is left under it (here or in /dev/shm) is removed."""
    segment = f"lmcache-mp-attack-{uuid.uuid4().hex[:12]}"
    yield segment
    for directory in (segment_dir(), SHM_DIR):
        for leftover in (segment, f"{segment}.snapshot"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / leftover)


def stored(server, hashes, seed: int, salt: str) -> None:
    assert run(store_worker, Job(server.url, NUM_BLOCKS, seed, hashes, chunk_blocks(
        list(range(len(hashes)))), cache_salt=salt)) == [
            bytes([StoreStatus.STORED] * len(hashes))]


def hit(server, hashes, salt: str) -> int:
    with CacheClient(server.url, timeout=10) as client:
        (found,) = client.lookup(MODEL, 1, [LookupItem.build("probe", hashes, salt)])
    return found


def forged_old_snapshot(victim_hash: bytes) -> bytes:
    """The attack of issue 34 in the format servers before signatures read: 2,047 zero
    slots with their true CRC-32, and the slot at offset 0 (where the victim's first chunk
    lay) as a chunk of salt `evil` with a made-up one, which a 32-chunk sample misses 98
    times in 100."""
    geometry = [workers.W2["layout"], workers.W2["num_layers"],
                [2, workers.W2["block_size"], workers.W2["heads"], workers.W2["head_dim"]],
                "float16", workers.BLOCKS_PER_CHUNK]
    chunk_bytes = 512 * 1024
    zero_crc = zlib.crc32(bytes(chunk_bytes))
    entries = [[MODEL, 1, 0, "evil", victim_hash, 0, chunk_bytes, geometry, 12345, None]]
    entries += [[MODEL, 1, 0, "evil", bytes([n % 251, n // 251]) * 8, n * chunk_bytes,
                 chunk_bytes, geometry, zero_crc, None] for n in range(1, 2048)]
    return msgpack.packb({"format": 2, "capacity": CAPACITY, "chunk_size": 256,
                          "chunks": entries[:CAPACITY // chunk_bytes]}, use_bin_type=True)


def test_a_forged_snapshot_is_never_adopted(name, tmp_path, outsider_agent):
    """Tenant A's chunk lies at the pool's offset 0; a forgery names that slot as salt
    `evil`'s. Planted in /dev/shm as nobody (who cannot write the server's directory), and
    in the server's directory unsigned: neither is adopted, and `evil` loads nothing."""
    victim = prompt(tag=3401, num_chunks=2)
    runtime = str(tmp_path / "run")
    server = server_process(None, ["--cpu-size", "64MiB", "--pool-segment", name], runtime)
    with server:
        stored(server, victim, seed=71, salt="tenant-a")
        started_process(server).kill()  # a crash: no snapshot of its own
        started_process(server).wait()
    forgery = forged_old_snapshot(victim[0])
    planted = outsider_agent.run(plant_as_outsider, str(SHM_DIR / f"{name}.snapshot"),
                                 str(segment_dir() / f"{name}.snapshot"), forgery)
    assert planted == ["planted", "PermissionError"]
    private = segment_dir() / f"{name}.snapshot"
    private.write_bytes(forgery)  # as a process of the server's uid without the key would
    private.chmod(0o600)
    with run_server("--pool-segment", name, "--log-level", "info", runtime_dir=runtime) as server:
        assert "cold start" in server.output() and "not a snapshot" in server.output()
        assert hit(server, victim[:1], "evil") == 0 and hit(server, victim, "tenant-a") == 0
        result = run(retrieve_worker, Job(server.url, NUM_BLOCKS, None, victim[:1],
                                          chunk_blocks([0]), "evil"))
        assert (result.hit, result.retrieved) == (0, 0)
    assert os.stat(SHM_DIR / f"{name}.snapshot").st_uid == NOBODY  # left alone, not read


def plant_as_outsider(state, legacy: str, private: str, data: bytes) -> list[str]:
    outcomes = []
    for path in (legacy, private):
        try:
            with open(path, "wb") as out:
                out.write(data)
            outcomes.append("planted")
        except OSError as exc:
            outcomes.append(type(exc).__name__)
    return outcomes


@pytest.fixture
def outsider_agent(agents):
    return agents("outsider", uid=NOBODY)


SECRET = "root-only secret 3402: never in a log"


def plant(kind: str, path: Path, secret: Path) -> None:
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "symlink to a root-only file":
        path.symlink_to(secret)
    elif kind == "/dev/zero":
        os.mknod(path, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    elif kind == "world-readable":
        path.write_text(SECRET)
        path.chmod(0o644)
    elif kind == "directory":
        path.mkdir()
    elif kind == "larger than any snapshot":
        with open(path, "wb") as big:
            big.truncate(1024**4)  # sparse: a terabyte the server must not read
        path.chmod(0o600)


@pytest.mark.parametrize("kind", ["fifo", "symlink to a root-only file", "/dev/zero",
                                  "world-readable", "directory", "larger than any snapshot"])
def test_what_is_not_a_private_file_is_refused_before_a_byte_is_read(name, tmp_path, kind):
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    runtime = str(tmp_path / "run")
    hashes = prompt(tag=3402, num_chunks=1)
    with run_server("--pool-segment", name, runtime_dir=runtime) as server:
        stored(server, hashes, seed=72, salt="")
    (segment_dir() / f"{name}.snapshot").unlink()
    for directory in (segment_dir(), SHM_DIR):  # the servers before this one read /dev/shm
        plant(kind, directory / f"{name}.snapshot", secret)
    try:
        with run_server("--pool-segment", name, "--log-level", "info",
                        runtime_dir=runtime) as server:
            log = server.output()
            assert "cold start" in log and f"{name}.snapshot" in log and "uid 0 (root)" in log
            assert SECRET not in log and hit(server, hashes, "") == 0
        assert secret.read_text() == SECRET
    finally:
        for directory in (segment_dir(), SHM_DIR):
            path = directory / f"{name}.snapshot"
            if path.is_dir() and not path.is_symlink():
                path.rmdir()


def test_a_squatted_or_shared_segment_directory_stops_the_start_naming_its_owner(tmp_path,
                                                                                 agents):
    squatter = agents("squatter", uid=NOBODY)
    place = SHM_DIR / f"lmcache-mp-squat-{uuid.uuid4().hex[:12]}"

    def refusal() -> str:
        server = server_process(None, ["--cpu-size", "64MiB", "--pool-segment", "pool",
                                       "--pool-segment-dir", str(place)])
        with pytest.raises(RuntimeError, match="exited with 2"):
            server.start()
        server.close()
        return server.output()
    try:
        squatter.run(make_directory, str(place))
        assert "belongs to uid 65534 (nobody)" in refusal()
        shutil.rmtree(place)
        place.mkdir(mode=0o777)
        place.chmod(0o777)  # root's, but anyone may put files in it
        assert "has mode 777" in refusal()
    finally:
        shutil.rmtree(place, ignore_errors=True)


def make_directory(state, path: str) -> None:
    os.mkdir(path, 0o755)


def test_a_name_squatted_in_dev_shm_does_not_keep_the_server_from_starting(name, tmp_path,
                                                                           agents):
    """Servers before this one kept segments in /dev/shm: nobody creating and locking that
    name there stopped them (exit 2). Now it is not where the segment lives."""
    squatter = agents("squatter", uid=NOBODY)
    squatter.run(create_and_lock, str(SHM_DIR / name))
    runtime = str(tmp_path / "run")
    hashes = prompt(tag=3403, num_chunks=2)
    with run_server("--pool-segment", name, runtime_dir=runtime) as server:
        stored(server, hashes, seed=73, salt="")
    with run_server("--pool-segment", name, runtime_dir=runtime) as server:
        assert hit(server, hashes, "") == 2


def create_and_lock(state, path: str) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    state["lock"] = os.fdopen(fd)
