"""The disk tier against a local attacker and a crash, each against a real server process:
bytes planted in its data file with a valid CRC-32 are refused; a crash in the window where
an evicted chunk's extent holds another salt's unsynced bytes serves nothing of them, nor
does one while a batch's commit runs beside the next batch's writes; chunks
of 256 bytes are written and read back; a CLEAR and a shrunk quota last across a restart;
a padded journal costs no more memory at start-up than a valid one; the key lives outside
the disk directory (issue 43): in the runtime directory, or in --disk-key-file, which keeps
the tier across a reboot that empties the runtime directory, and is refused inside the
disk directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from lmcache_mp.client import StoreStatus, chunk_hashes
from lmcache_mp.server.disk.tier import key_name

from ..server.disk.test_disk_tier import (
    CHUNK_BYTES,
    DISK_FLAGS,
    NUM_BLOCKS,
    PROMPT_CHUNKS,
    PROMPTS,
    SMALL_POOL,
    assert_prefix_served,
    disk_server,
    loaded,
    stats,
    store,
    stored_and_stopped,
    written,
)
from ..utils import run_server, server_process, started_process, wait_for
from ..workers import (
    Job,
    WorkerProcess,
    abandoned_store_worker,
    chunk_blocks,
    expected_blocks,
    prompt,
    retrieve_worker,
    run,
    store_worker,
)


def crc_forged(length: int, crc: int, seed: int) -> bytes:
    """`length` random bytes whose CRC-32 is `crc`: the last 4 are solved for, as CRC-32 is
    affine in them over GF(2)."""
    head = torch.randint(0, 256, (length - 4,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).numpy().tobytes()
    start = zlib.crc32(head)
    base = zlib.crc32(bytes(4), start)
    columns = [zlib.crc32((1 << bit).to_bytes(4, "little"), start) ^ base for bit in range(32)]
    # Gaussian elimination: rows (column value, the bits of the tail it stands for).
    rows = [(value, 1 << bit) for bit, value in enumerate(columns)]
    want, tail = crc ^ base, 0
    for bit in range(32):
        pivot = next(i for i in range(bit, 32) if rows[i][0] >> bit & 1)
        rows[bit], rows[pivot] = rows[pivot], rows[bit]
        for i in range(32):
            if i != bit and rows[i][0] >> bit & 1:
                rows[i] = (rows[i][0] ^ rows[bit][0], rows[i][1] ^ rows[bit][1])
    for bit in range(32):
        if want >> bit & 1:
            tail ^= rows[bit][1]
    forged = head + tail.to_bytes(4, "little")
    assert zlib.crc32(forged) == crc
    return forged


def test_a_planted_chunk_with_a_valid_crc_is_refused(tmp_path):
    """Bytes written into chunks.dat at a chunk's extent, with the CRC-32 of the chunk they
    replace (what format 1 checked): the chunk's MAC fails, so it is a miss, counted in
    disk_corrupt, and the server goes on serving."""
    directory = tmp_path / "disk"
    with disk_server(directory) as server:
        for hashes, seed in PROMPTS:
            store(server, hashes, seed)
        written(server, len(PROMPTS) * PROMPT_CHUNKS)
        # The first chunk written (the first prompt's first, out of the pool by now) is at 0.
        with open(directory / "chunks.dat", "r+b") as data:
            original = data.read(CHUNK_BYTES)
            data.seek(0)
            data.write(crc_forged(CHUNK_BYTES, zlib.crc32(original), seed=5))
        before = stats(server).disk_corrupt
        assert assert_prefix_served(server, *PROMPTS[0]) == 0
        assert stats(server).disk_corrupt == before + 1
        assert assert_prefix_served(server, *PROMPTS[1]) == PROMPT_CHUNKS


def killed_under_a_store(server, tag: int, tokens, salt: str) -> None:
    """A worker STOREs one chunk and never talks to the server again; the server's fault
    point kills it (SIGKILL) while that chunk is on its way to the disk."""
    with WorkerProcess(abandoned_store_worker, Job(server.url, NUM_BLOCKS, tag, tokens,
                                                   chunk_blocks([0]), cache_salt=salt)) \
            as worker:
        worker.receive()
        started_process(server).wait(timeout=60)


def test_a_crash_while_an_evicted_chunks_extent_holds_new_bytes_serves_none_of_them(
        tmp_path, monkeypatch):
    """A tier of two chunks holds tenant a's prompt; tenant b's chunk evicts a's last one and
    takes its extent; the server is SIGKILLed (a fault point) once b's bytes are written
    there, before they are synced or recorded. After a restart a's last chunk is a miss
    because its removal was recorded first (disk_corrupt 0: no record named b's bytes),
    a's first chunk is served byte for byte, and b's chunk is not there."""
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    first, second = prompt(tag=4300, num_chunks=2), prompt(tag=4301, num_chunks=1)
    flags = [*SMALL_POOL, "--disk-dir", str(directory), "--disk-size", "1MiB",
             "--disk-prefetch-wait", "30"]
    monkeypatch.setenv("LMCACHE_MP_TEST_FAULT", "disk-reuse-unsynced")
    server = server_process(None, flags, str(runtime))
    server.start()
    try:
        store(server, first, 11, salt="a")
        written(server, 2)
        killed_under_a_store(server, 12, second, "b")
    finally:
        assert server.close() == -9, server.output()
    monkeypatch.delenv("LMCACHE_MP_TEST_FAULT")
    with run_server(*flags, runtime_dir=str(runtime)) as server:
        assert loaded(server).disk_loaded_chunks == 1
        assert assert_prefix_served(server, first, 11, "a") == 1
        assert assert_prefix_served(server, second, 12, "b") == 0
        assert stats(server).disk_corrupt == 0


def test_a_crash_while_a_commit_runs_beside_the_next_batchs_writes_serves_nothing_wrong(
        tmp_path, monkeypatch):
    """A tier of three chunks holds tenant a's prompt of two; tenant b's chunk is written and
    its commit, running beside the writes, has synced b's record (the journal grew) when a
    fault point holds it there; tenant c's chunk then evicts a's last one and is written
    into its extent beside that commit, and the server is SIGKILLed once c's bytes are out.
    After a restart: b's chunk is served (its record was durable, its bytes synced
    first), a's last chunk is a miss (its removal was recorded before c's bytes), a's first
    is served, c's is not there, and no chunk failed its MAC (no record names c's bytes)."""
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    first = prompt(tag=4310, num_chunks=2)
    second, third = prompt(tag=4311, num_chunks=1), prompt(tag=4312, num_chunks=1)
    flags = [*SMALL_POOL, "--disk-dir", str(directory), "--disk-size", "1536KiB",
             "--disk-prefetch-wait", "30"]
    monkeypatch.setenv("LMCACHE_MP_TEST_FAULT", "disk-kill-beside-commit")
    server = server_process(None, flags, str(runtime))
    server.start()
    try:
        store(server, first, 11, salt="a")
        written(server, 2)  # its commit ran with no chunk on disk: the fault let it be
        journal = directory / "journal"
        before = journal.stat().st_size
        store(server, second, 12, salt="b", settle=False)
        wait_for(lambda: journal.stat().st_size > before, "b's record in the journal")
        killed_under_a_store(server, 13, third, "c")
    finally:
        assert server.close() == -9, server.output()
    monkeypatch.delenv("LMCACHE_MP_TEST_FAULT")
    with run_server(*flags, runtime_dir=str(runtime)) as server:
        assert loaded(server).disk_loaded_chunks == 2
        assert assert_prefix_served(server, second, 12, "b") == 1
        assert assert_prefix_served(server, first, 11, "a") == 1
        assert assert_prefix_served(server, third, 13, "c") == 0
        assert stats(server).disk_corrupt == 0


# 256-byte chunks: 16 tokens of one layer of one head of 4 float16 values, K and V.
TINY = dict(layout="mha", num_layers=1, block_size=16, heads=1, head_dim=4,
            dtype=torch.float16)
TINY_CHUNKS = 2100  # more than IOV_MAX (1024) one-extent buffers in one run


def test_chunks_of_256_bytes_are_written_and_read_back(tmp_path):
    """2,100 chunks of 256 bytes, a 4096-byte extent each: a run of 2,048 of them is more
    buffers than one pwritev takes. Every chunk is written without an error, and after a
    restart (the pool empty) read back from disk byte for byte."""
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    flags = ["--chunk-size", "16", "--disk-dir", str(directory), *DISK_FLAGS]
    tokens = [(4400 * 7919 + i) % 50000 for i in range(16 * TINY_CHUNKS)]
    hashes = chunk_hashes(tokens, 16)
    blocks = list(range(TINY_CHUNKS))
    with run_server(*flags, runtime_dir=str(runtime)) as server:
        assert run(store_worker, Job(server.url, TINY_CHUNKS, 21, hashes, blocks,
                                     shape=TINY)) == [bytes([StoreStatus.STORED] * TINY_CHUNKS)]
        written(server, TINY_CHUNKS)
        assert stats(server).disk_write_errors == 0
    with run_server(*flags, runtime_dir=str(runtime)) as server:
        assert loaded(server).disk_loaded_chunks == TINY_CHUNKS
        result = run(retrieve_worker, Job(server.url, TINY_CHUNKS, None, hashes, blocks,
                                          shape=TINY))
        assert result.hit == result.retrieved == TINY_CHUNKS
        assert torch.equal(result.blocks, expected_blocks(TINY_CHUNKS, 21, blocks, TINY))
        assert stats(server).disk_hits == TINY_CHUNKS


def test_a_write_the_kernel_refuses_drops_its_batch_and_the_tier_writes_on(tmp_path,
                                                                           monkeypatch):
    """The first batch's write fails with EINVAL (a fault point: the error a buffer set the
    kernel refuses gives): that batch is dropped and counted, and the tier does not stop
    (no 30 s back-off dropping what follows): every later chunk is written."""
    monkeypatch.setenv("LMCACHE_MP_TEST_FAULT", "disk-einval-once")
    with disk_server(tmp_path / "disk") as server:
        store(server, *PROMPTS[0])
        store(server, *PROMPTS[1])
        figures = stats(server)
        assert figures.disk_write_errors == 1 and figures.disk_writing
        assert figures.disk_chunks_written == 2 * PROMPT_CHUNKS - figures.disk_dropped
        assert figures.disk_dropped <= PROMPT_CHUNKS  # the first batch's, at most


@pytest.mark.parametrize("stop", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("cleared", ["gone", None])
def test_a_clear_lasts_across_a_restart(tmp_path, cleared, stop):
    """CLEAR of one salt (or of everything), answered, then SIGKILL (or SIGTERM): the
    restarted server serves none of the cleared chunks, and every other one. CLEAR counts
    each chunk once, in memory and on disk alike."""
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    gone, kept = PROMPTS[0], PROMPTS[1]
    server = server_process(None, [*SMALL_POOL, "--disk-dir", str(directory), *DISK_FLAGS],
                            str(runtime))
    server.start()
    try:
        store(server, *gone, salt="gone")
        store(server, *kept, salt="kept")
        written(server, 2 * PROMPT_CHUNKS)
        with server.client(admin=True) as admin:
            removed = admin.clear(cleared)
        assert removed == PROMPT_CHUNKS * (1 if cleared else 2)
        if stop == "SIGKILL":
            started_process(server).kill()
    finally:
        assert server.close() == (-9 if stop == "SIGKILL" else 0)
    with disk_server(directory, runtime_dir=str(runtime)) as server:
        assert loaded(server).disk_loaded_chunks == (PROMPT_CHUNKS if cleared else 0)
        assert assert_prefix_served(server, *gone, "gone") == 0
        assert assert_prefix_served(server, *kept, "kept") == (PROMPT_CHUNKS if cleared else 0)


def test_a_shrunk_quota_lasts_across_a_sigkill(tmp_path):
    """QUOTA_SET lowers a salt's cap to 2 of its 4 chunks on disk, answered, then SIGKILL:
    the restarted server (the run-time quota gone with the killed one) holds 2 of them."""
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    server = server_process(None, [*SMALL_POOL, "--disk-dir", str(directory), *DISK_FLAGS],
                            str(runtime))
    server.start()
    try:
        store(server, *PROMPTS[0], salt="capped")
        written(server, PROMPT_CHUNKS)
        with server.client(admin=True) as admin:
            admin.quota_set("capped", 2 * CHUNK_BYTES)
        assert stats(server).tenants["capped"].disk_chunks == 2
        started_process(server).kill()
    finally:
        assert server.close() == -9
    with disk_server(directory, runtime_dir=str(runtime)) as server:
        assert loaded(server).disk_loaded_chunks == 2
        assert assert_prefix_served(server, *PROMPTS[0], "capped") == 2


def peak_rss(pid: int) -> int:
    """The process's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def started_peak(directory: Path, runtime: str) -> int:
    with disk_server(directory, runtime_dir=runtime) as server:
        loaded(server)
        return peak_rss(server.proc.pid)


def test_a_padded_journal_costs_no_more_memory_than_a_valid_one(tmp_path):
    """The journal grown to 1 GiB (a hole: zeros) under a tier of 64 MiB: replay reads at
    most what a valid journal of that tier could hold, in blocks, so the server's peak
    memory at start-up is within 64 MiB of a start from the valid journal."""
    directory, runtime = stored_and_stopped(tmp_path)
    valid = started_peak(directory, runtime)
    os.truncate(directory / "journal", 1024**3)
    padded = started_peak(directory, runtime)
    assert padded < valid + 64 * 1024**2, (valid, padded)


def test_the_key_lives_in_the_runtime_directory_and_an_old_one_is_not_trusted(tmp_path):
    """The tier's key is made 0600 in the runtime directory, named for the disk directory,
    and none is left in the disk directory; a disk.key planted there (where format 1 kept
    it) is removed, and the chunks signed before are served again after a restart."""
    directory, runtime = stored_and_stopped(tmp_path)
    key = Path(runtime) / key_name(directory)
    assert os.stat(key).st_mode & 0o777 == 0o600
    assert "disk.key" not in os.listdir(directory)
    (directory / "disk.key").write_bytes(bytes(32))
    os.chmod(directory / "disk.key", 0o600)
    with disk_server(directory, runtime_dir=runtime) as server:
        assert loaded(server).disk_loaded_chunks == PROMPT_CHUNKS
        assert assert_prefix_served(server, *PROMPTS[0]) == PROMPT_CHUNKS
    assert "disk.key" not in os.listdir(directory)
    # Another runtime directory holds no key for it: nothing the first key signed is used.
    with disk_server(directory) as server:
        assert loaded(server).disk_loaded_chunks == 0


KEY_WARNING = "set --disk-key-file to a file on a persistent filesystem"


def test_a_key_file_keeps_the_tier_across_a_reboot_that_empties_the_runtime_directory(
        tmp_path):
    """--disk-key-file K: the tier written, the server stopped, its runtime directory
    removed whole (what a reboot does to a tmpfs): a server with the same --disk-dir and K
    serves every chunk from disk, byte for byte. K is made 0600 in a directory made 0700,
    and the runtime directory never held a key for the tier."""
    directory, runtime = tmp_path / "disk", tmp_path / "run"
    key = tmp_path / "state" / "disk.key"
    with disk_server(directory, "--disk-key-file", str(key), runtime_dir=str(runtime)) as server:
        store(server, *PROMPTS[0])
        written(server, PROMPT_CHUNKS)
    assert os.stat(key).st_mode & 0o777 == 0o600
    assert os.stat(key.parent).st_mode & 0o777 == 0o700
    assert key_name(directory) not in os.listdir(runtime)
    shutil.rmtree(runtime)
    with disk_server(directory, "--disk-key-file", str(key), runtime_dir=str(runtime)) as server:
        assert loaded(server).disk_loaded_chunks == PROMPT_CHUNKS
        assert assert_prefix_served(server, *PROMPTS[0]) == PROMPT_CHUNKS
        assert stats(server).disk_hits == PROMPT_CHUNKS  # the restarted pool held none
    assert KEY_WARNING not in server.output()


def test_a_tier_moves_to_a_key_file_with_its_key_copied_there(tmp_path):
    """The runtime directory's key for the tier, copied (0600) to the file --disk-key-file
    names: the runtime directory gone, a server with the flag serves the tier's chunks."""
    directory, runtime = stored_and_stopped(tmp_path)
    key = tmp_path / "state" / "disk.key"
    key.parent.mkdir(mode=0o700)
    shutil.copyfile(Path(runtime) / key_name(directory), key)
    key.chmod(0o600)
    shutil.rmtree(runtime)
    with disk_server(directory, "--disk-key-file", str(key), runtime_dir=runtime) as server:
        assert loaded(server).disk_loaded_chunks == PROMPT_CHUNKS
        assert assert_prefix_served(server, *PROMPTS[0]) == PROMPT_CHUNKS


def test_a_reboot_that_empties_the_runtime_directory_empties_the_tier_and_says_why(tmp_path):
    """Without --disk-key-file the key is in the runtime directory: removed whole (a reboot
    on a tmpfs), the next server has a new key, finds none of the journal's records signed
    with it, starts the tier empty, and logs one warning naming the cause and the flag."""
    directory, runtime = stored_and_stopped(tmp_path)
    shutil.rmtree(runtime)
    with disk_server(directory, runtime_dir=runtime) as server:
        assert loaded(server).disk_loaded_chunks == 0
        assert assert_prefix_served(server, *PROMPTS[0]) == 0
    warnings = [line for line in server.output().splitlines() if KEY_WARNING in line]
    assert len(warnings) == 1, server.output()
    assert f"none of its journal's {PROMPT_CHUNKS} records is signed with the key in " \
           f"{Path(runtime) / key_name(directory)}" in warnings[0]


@pytest.mark.parametrize("inside", ["a file in it", "through a link to it", "a name of one"])
def test_a_key_file_inside_the_disk_directory_is_refused(tmp_path, inside):
    """--disk-key-file in --disk-dir (written so, reached through a link to the directory,
    or naming one of the tier's files) stops the start-up, exit 2, with a line that says
    so; no key is made and the directory is not touched."""
    directory = tmp_path / "disk"
    directory.mkdir(mode=0o700)
    (tmp_path / "alias").symlink_to(directory, target_is_directory=True)
    key = {"a file in it": directory / "disk.key", "through a link to it":
           tmp_path / "alias" / "disk.key", "a name of one": directory / "journal"}[inside]
    result = subprocess.run(
        [sys.executable, "-m", "lmcache_mp.server", "--cpu-size", "4MiB", "--disk-dir",
         str(directory), "--disk-size", "8MiB", "--disk-key-file", str(key),
         "--runtime-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"--disk-key-file {key} is inside --disk-dir {directory}" in result.stderr
    assert os.listdir(directory) == []


def test_a_key_file_in_a_directory_others_may_write_is_refused(tmp_path):
    """Whoever could write the key's directory could swap the key: a directory open to
    others stops the start-up, exit 2, naming it; no key is made there."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    result = subprocess.run(
        [sys.executable, "-m", "lmcache_mp.server", "--cpu-size", "4MiB", "--disk-dir",
         str(tmp_path / "disk"), "--disk-size", "8MiB", "--disk-key-file",
         str(shared / "disk.key"), "--runtime-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"cannot use the disk tier: --disk-key-file's directory: {shared} has mode 777" \
        in result.stderr
    assert os.listdir(shared) == []
