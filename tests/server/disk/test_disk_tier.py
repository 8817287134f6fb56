"""The disk tier with real servers, real workers and real files: more than the pool holds is
found and retrieved byte for byte from disk; SIGKILL and a restart serve every chunk whose
write completed and nothing torn; corrupt, truncated and foreign files are misses (a run
of adjacent chunks cut short still serves those before the cut); a full
or read-only disk degrades without a failed request; salts stay apart; eviction from disk
keeps prefixes."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcache_mp.client import CacheClient, LookupItem, StoreStatus

from ...utils import run_server, server_process, started_process, wait_for
from ...workers import (
    BLOCKS_PER_CHUNK,
    MODEL,
    Job,
    chunk_blocks,
    expected_blocks,
    prompt,
    retrieve_worker,
    run,
    store_worker,
)

CHUNK_BYTES = 512 * 1024  # W2
PROMPT_CHUNKS = 4
NUM_BLOCKS = PROMPT_CHUNKS * BLOCKS_PER_CHUNK
# A pool of 4 MiB holds 8 chunks; the prompts below are 6 of 4 chunks (24 chunks, 12 MiB).
SMALL_POOL = ("--cpu-size", "4MiB")
DISK_FLAGS = ("--disk-size", "64MiB", "--disk-prefetch-wait", "30")


def disk_server(directory: Path, *extra: str, runtime_dir: str | None = None):
    return run_server(*SMALL_POOL, "--disk-dir", str(directory), *DISK_FLAGS, *extra,
                      runtime_dir=runtime_dir)


def store(server, hashes, seed: int, salt: str = "", settle: bool = True) -> None:
    """STORE a prompt; with `settle`, wait until the disk tier has dealt with its chunks
    (written, or dropped for a reason the test makes), so that the next STORE cannot push
    them out of the pool before their turn, however slow the machine."""
    statuses = run(store_worker, Job(server.url, NUM_BLOCKS, seed, hashes,
                                     chunk_blocks(list(range(len(hashes)))), cache_salt=salt))
    assert statuses == [bytes([StoreStatus.STORED] * len(hashes))]
    if settle:  # the STORE queued its chunks before it answered
        wait_for(lambda: stats(server).disk_queue_chunks == 0, "the disk tier's queue")


def retrieve(server, hashes, salt: str = ""):
    return run(retrieve_worker, Job(server.url, NUM_BLOCKS, None, hashes,
                                    chunk_blocks(list(range(len(hashes)))), cache_salt=salt))


def assert_prefix_served(server, hashes, seed: int, salt: str = "") -> int:
    """RETRIEVE what a LOOKUP finds of the prompt: every byte is the stored one."""
    result = retrieve(server, hashes, salt)
    assert result.retrieved == result.hit
    if result.hit:
        assert torch.equal(result.blocks, expected_blocks(
            NUM_BLOCKS, seed, chunk_blocks(list(range(result.hit)))))
    return result.hit


def stats(server):
    with CacheClient(server.url, timeout=10, admin=True, token=server.token(admin=True)) as c:
        return c.stats()


def written(server, chunks: int) -> None:
    wait_for(lambda: stats(server).disk_chunks_written >= chunks, f"{chunks} chunks on disk")


def loaded(server):
    return wait_for(lambda: (s := stats(server)).disk_loaded and s, "the disk index")


PROMPTS = [(prompt(tag=3600 + i, num_chunks=PROMPT_CHUNKS), 70 + i) for i in range(6)]


def stored_and_stopped(tmp_path: Path, prompts=PROMPTS[:1]) -> tuple[Path, str]:
    """A disk directory holding `prompts` (on disk, then the server stopped), and the
    runtime directory to start the next server in."""
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    with disk_server(directory, runtime_dir=str(runtime)) as server:
        for hashes, seed in prompts:
            store(server, hashes, seed)
        written(server, len(prompts) * PROMPT_CHUNKS)
    return directory, str(runtime)


def test_more_than_the_pool_holds_is_found_and_retrieved_from_disk(tmp_path):
    with disk_server(tmp_path / "disk") as server:
        for hashes, seed in PROMPTS:
            store(server, hashes, seed)
        written(server, len(PROMPTS) * PROMPT_CHUNKS)
        before = stats(server)
        assert before.chunks < len(PROMPTS) * PROMPT_CHUNKS  # the pool could not keep them
        assert before.disk_chunks == len(PROMPTS) * PROMPT_CHUNKS
        for hashes, seed in PROMPTS:
            assert assert_prefix_served(server, hashes, seed) == PROMPT_CHUNKS
        after = stats(server)
        assert after.disk_hits >= len(PROMPTS) * PROMPT_CHUNKS - before.chunks
        assert after.disk_corrupt == after.disk_read_errors == after.disk_write_errors == 0
        assert after.disk_read_time is not None and sum(after.disk_read_time.counts) > 0
    info = os.stat(tmp_path / "disk")
    assert info.st_mode & 0o777 == 0o700
    for name in os.listdir(tmp_path / "disk"):
        assert os.stat(tmp_path / "disk" / name).st_mode & 0o777 == 0o600


def test_a_restart_serves_every_chunk_whose_write_completed_before_sigkill(tmp_path):
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    server = server_process(None, [*SMALL_POOL, "--disk-dir", str(directory), *DISK_FLAGS],
                            str(runtime))
    server.start()
    try:
        for hashes, seed in PROMPTS[:3]:
            store(server, hashes, seed)
        written(server, 3 * PROMPT_CHUNKS)
        # More stores, killed while their writes may still be going on.
        for hashes, seed in PROMPTS[3:]:
            store(server, hashes, seed, settle=False)
        completed = stats(server).disk_chunks_written
        started_process(server).kill()
    finally:
        assert server.close() == -9
    with disk_server(directory, runtime_dir=str(runtime)) as server:
        found = loaded(server)
        assert found.disk_loaded_chunks >= completed
        served = 0
        for hashes, seed in PROMPTS:
            served += assert_prefix_served(server, hashes, seed)
        assert served >= completed
        assert stats(server).disk_corrupt == 0


def corrupt_first_chunk(directory: Path) -> None:
    with open(directory / "chunks.dat", "r+b") as data:
        data.seek(1000)
        byte = data.read(1)
        data.seek(1000)
        data.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["flipped byte", "truncated file", "foreign journal"])
def test_damaged_files_are_misses_never_errors(tmp_path, damage):
    directory, runtime = stored_and_stopped(tmp_path)
    hashes, seed = PROMPTS[0]
    if damage == "flipped byte":
        corrupt_first_chunk(directory)  # the first chunk written sits at offset 0
    elif damage == "truncated file":
        os.truncate(directory / "chunks.dat", CHUNK_BYTES // 2)
    else:  # another server's journal, under another key, planted in this directory
        other = tmp_path / "other"
        with disk_server(other) as server:
            store(server, hashes, seed)
            written(server, PROMPT_CHUNKS)
        (directory / "journal").write_bytes((other / "journal").read_bytes())
    with disk_server(directory, runtime_dir=runtime) as server:
        loaded(server)
        # Nothing of the prompt is in memory after a restart: what is found came from disk.
        assert assert_prefix_served(server, hashes, seed) == 0
        figures = stats(server)
        if damage == "foreign journal":
            assert figures.disk_loaded_chunks == 0
        else:
            assert figures.disk_corrupt >= 1
        # The tier works on: the prompt stored again is served again.
        store(server, hashes, seed)
        assert assert_prefix_served(server, hashes, seed) == PROMPT_CHUNKS


def test_a_run_cut_short_under_a_running_server_serves_the_chunks_before_the_cut(tmp_path):
    """The first prompt's four chunks sit in adjacent extents from offset 0, read back as
    one run; the data file cut under the server in the middle of the third: the run's
    read fails, and each of its chunks is read again alone, so the two before the cut are
    served byte for byte and the two after are misses, counted as corrupt."""
    with disk_server(tmp_path / "disk") as server:
        for hashes, seed in PROMPTS:
            store(server, hashes, seed)
        written(server, len(PROMPTS) * PROMPT_CHUNKS)
        # The pool holds the last two prompts: the first one comes from disk.
        os.truncate(tmp_path / "disk" / "chunks.dat", 2 * CHUNK_BYTES + CHUNK_BYTES // 2)
        before = stats(server)
        assert assert_prefix_served(server, *PROMPTS[0]) == 2
        figures = stats(server)
        assert figures.disk_hits - before.disk_hits == 2
        assert figures.disk_corrupt - before.disk_corrupt == 2
        assert figures.disk_read_errors == 0


def test_salts_stay_apart_on_disk(tmp_path):
    hashes = prompt(tag=3700, num_chunks=PROMPT_CHUNKS)
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    with disk_server(directory, runtime_dir=str(runtime)) as server:
        store(server, hashes, seed=81, salt="tenant-a")
        store(server, hashes, seed=82, salt="tenant-b")
        written(server, 2 * PROMPT_CHUNKS)
    with disk_server(directory, runtime_dir=str(runtime)) as server:
        loaded(server)
        assert assert_prefix_served(server, hashes, 81, "tenant-a") == PROMPT_CHUNKS
        assert assert_prefix_served(server, hashes, 82, "tenant-b") == PROMPT_CHUNKS
        assert assert_prefix_served(server, hashes, 0, "tenant-c") == 0
        tenants = stats(server).tenants
        assert tenants["tenant-a"].disk_chunks == tenants["tenant-b"].disk_chunks == \
            PROMPT_CHUNKS


def test_eviction_from_disk_keeps_prefixes_and_a_salts_cap(tmp_path):
    """A disk of 8 chunks takes 6 prompts of 4: what stays of each prompt is a prefix of it,
    and a salt capped at 2 chunks keeps at most 2 on disk."""
    with run_server("--cpu-size", "4MiB", "--disk-dir", str(tmp_path / "disk"),
                    "--disk-size", "4MiB", "--disk-prefetch-wait", "30",
                    "--quota", f"capped={2 * CHUNK_BYTES}") as server:
        for hashes, seed in PROMPTS:
            store(server, hashes, seed)
        written(server, len(PROMPTS) * PROMPT_CHUNKS)
        figures = stats(server)
        assert figures.disk_chunks <= 8 and figures.disk_evictions > 0
        for hashes, seed in PROMPTS:
            assert_prefix_served(server, hashes, seed)  # a prefix, byte for byte, maybe empty
        # Two prompts of two chunks under a cap of two: the first leaves memory and disk.
        for tag in (3800, 3801):
            store(server, prompt(tag=tag, num_chunks=2), tag, salt="capped")
        written(server, len(PROMPTS) * PROMPT_CHUNKS + 4)
        capped = stats(server).tenants["capped"]
        assert capped.disk_chunks == 2 and capped.disk_bytes == 2 * CHUNK_BYTES


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of `size` at `path` (root only: CI runs as root; elsewhere the test skips)."""
    path.mkdir()
    if os.geteuid() != 0:
        if os.environ.get("CI") == "true":
            pytest.fail("CI must run as root to mount a small tmpfs for the disk-full tests")
        pytest.skip("mounting a small tmpfs needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_shrinks_the_tier_and_fails_no_request(tmp_path):
    """A 3 MiB filesystem under a tier told it has 64 MiB: writes past it fail with ENOSPC,
    the tier keeps what it has, and every STORE, LOOKUP and RETRIEVE still succeeds."""
    with small_filesystem(tmp_path / "fs", "3m") as mount:
        with disk_server(mount / "disk") as server:
            for hashes, seed in PROMPTS:
                store(server, hashes, seed)
            wait_for(lambda: stats(server).disk_write_errors >= 1, "a failed write")
            figures = stats(server)
            assert figures.disk_chunks <= 6 and figures.disk_capacity_bytes < 64 * 1024**2
            for hashes, seed in PROMPTS:
                assert_prefix_served(server, hashes, seed)


def test_a_directory_turned_read_only_serves_what_it_holds_and_writes_nothing(tmp_path):
    """Linux refuses to remount a filesystem read-only while the server has files open on
    it for writing, so the directory turns read-only between two servers: the second one
    serves what the first wrote, and writes nothing, failing no STORE."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    with small_filesystem(tmp_path / "fs", "32m") as mount:
        with disk_server(mount / "disk", runtime_dir=str(runtime)) as server:
            store(server, *PROMPTS[0])
            written(server, PROMPT_CHUNKS)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        with disk_server(mount / "disk", runtime_dir=str(runtime)) as server:
            figures = loaded(server)
            assert not figures.disk_writing and figures.disk_loaded_chunks == PROMPT_CHUNKS
            for hashes, seed in PROMPTS[1:3]:
                store(server, hashes, seed)
            assert assert_prefix_served(server, *PROMPTS[0]) == PROMPT_CHUNKS
            figures = stats(server)
            assert figures.disk_chunks_written == 0 and figures.disk_dropped == 2 * PROMPT_CHUNKS


def test_the_disk_directory_must_be_the_servers_own(tmp_path):
    """A directory others may write to, a link, or a file in it that is a link, is refused
    at start-up, naming it; nothing of the linked file is read or logged."""
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    open_dir.chmod(0o777)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    planted = tmp_path / "planted"  # the server's own, but its journal is a link
    planted.mkdir(mode=0o700)
    (planted / "journal").symlink_to("/etc/passwd")
    for directory in (open_dir, link, planted):
        result = subprocess.run(
            [sys.executable, "-m", "lmcache_mp.server", "--cpu-size", "4MiB", "--disk-dir",
             str(directory), "--disk-size", "8MiB", "--runtime-dir",
             str(tmp_path / f"run-{directory.name}")],
            capture_output=True, text=True, timeout=120)
        assert result.returncode == 2
        assert f"cannot use the disk tier: {directory}" in result.stderr
        assert "root:" not in result.stderr


def test_lookup_reads_back_only_for_a_cache_that_can_load_the_chunks(tmp_path):
    """After a restart the chunks are on disk only: a LOOKUP from a scheduler of a model no
    worker here has registered finds nothing (no one could load them), and a worker's
    LOOKUP with a hold reads them back and RETRIEVEs every byte."""
    directory, runtime = stored_and_stopped(tmp_path)
    hashes, seed = PROMPTS[0]
    with disk_server(directory, runtime_dir=runtime) as server:
        loaded(server)
        with server.client() as client:
            assert client.lookup(MODEL, 1, [LookupItem.build("r", hashes, "", hold=False)]) \
                == [0]  # no worker registered: nothing on disk can be loaded by anyone
        assert assert_prefix_served(server, hashes, seed) == PROMPT_CHUNKS
        assert stats(server).disk_hits == PROMPT_CHUNKS


def test_a_data_file_truncated_or_removed_under_a_running_server(tmp_path):
    """Removed: the server's open file keeps its bytes, and they are served. Truncated: the
    chunks it no longer holds are misses, counted as corrupt, and nothing fails."""
    directory = tmp_path / "disk"
    with disk_server(directory) as server:
        for hashes, seed in PROMPTS:
            store(server, hashes, seed)
        written(server, len(PROMPTS) * PROMPT_CHUNKS)
        # The pool holds the last two prompts: the first ones come from disk.
        (directory / "chunks.dat").unlink()
        assert assert_prefix_served(server, *PROMPTS[0]) == PROMPT_CHUNKS
        with open(f"/proc/{server.proc.pid}/fd/{data_fd(server.proc.pid)}", "r+b") as data:
            data.truncate(0)
        assert assert_prefix_served(server, *PROMPTS[1]) == 0
        figures = stats(server)
        assert figures.disk_corrupt >= 1 and figures.disk_read_errors == 0


def data_fd(pid: int) -> str:
    """The server's descriptor of its (removed) data file."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if os.readlink(f"/proc/{pid}/fd/{fd}").endswith("chunks.dat (deleted)"):
            return fd
    raise AssertionError("the server has no data file open")


def test_clear_empties_the_disk_tier_of_the_salt(tmp_path):
    hashes = prompt(tag=3900, num_chunks=PROMPT_CHUNKS)
    with disk_server(tmp_path / "disk") as server:
        store(server, hashes, 91, salt="gone")
        store(server, hashes, 92, salt="kept")
        written(server, 2 * PROMPT_CHUNKS)
        with server.client(admin=True) as admin:
            # In memory and on disk, each chunk is one chunk: counted once.
            assert admin.clear("gone") == PROMPT_CHUNKS
        assert assert_prefix_served(server, hashes, 0, "gone") == 0
        assert assert_prefix_served(server, hashes, 92, "kept") == PROMPT_CHUNKS
        tenants = stats(server).tenants
        # "gone" holds no disk salt id any more: listed only while memory keeps its figures.
        assert "gone" not in tenants or tenants["gone"].disk_chunks == 0
        assert tenants["kept"].disk_chunks == PROMPT_CHUNKS
        assert stats(server).disk_salts == 1
