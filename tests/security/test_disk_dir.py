"""The disk tier's directory against another local user, a second server and a stuck disk:
a --disk-dir reached through a link, or below a directory another user can change, is
refused before anything is made there; two servers never share one; and a disk that never
finishes a write cannot keep a SIGTERM from ending the server."""

from __future__ import annotations

import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest
import torch

from lmcache_mp.client import CacheClient, StoreStatus
from lmcache_mp.server.faults import ENV as FAULT_ENV

from ..utils import run_server, server_process, started_process, wait_for
from ..workers import (
    BLOCKS_PER_CHUNK,
    Job,
    chunk_blocks,
    expected_blocks,
    prompt,
    retrieve_worker,
    run,
    store_worker,
)
from .agents import NOBODY

PROMPT_CHUNKS = 4
NUM_BLOCKS = PROMPT_CHUNKS * BLOCKS_PER_CHUNK
DISK = ("--disk-size", "64MiB", "--disk-prefetch-wait", "30")
SHUTDOWN_TIMEOUT_S = 2
EXIT_BOUND_S = 60  # only ends a test whose server would hang: the exit takes ~3 s


def refusal(disk_dir: Path) -> str:
    """Start a server on `disk_dir`, which must refuse (exit 2); its log."""
    server = server_process(None, ["--cpu-size", "4MiB", "--disk-dir", str(disk_dir), *DISK])
    with pytest.raises(RuntimeError, match="exited with 2"):
        server.start()
    server.close()
    return server.output()


def stats(server):
    with CacheClient(server.url, timeout=10, admin=True, token=server.token(admin=True)) as c:
        return c.stats()


def store(server, hashes, seed: int) -> None:
    assert run(store_worker, Job(server.url, NUM_BLOCKS, seed, hashes,
                                 chunk_blocks(list(range(len(hashes)))))) == [
        bytes([StoreStatus.STORED] * len(hashes))]


def served(server, hashes, seed: int) -> int:
    """RETRIEVE what a LOOKUP finds of the prompt; every byte must be the stored one."""
    result = run(retrieve_worker, Job(server.url, NUM_BLOCKS, None, hashes,
                                      chunk_blocks(list(range(len(hashes))))))
    assert result.retrieved == result.hit
    if result.hit:
        assert torch.equal(result.blocks, expected_blocks(
            NUM_BLOCKS, seed, chunk_blocks(list(range(result.hit)))))
    return result.hit


@pytest.fixture
def in_tmp():
    """A fresh name in /tmp (root's, sticky: anyone may add a name there); whatever is
    left under it is removed."""
    place = Path("/tmp") / f"lmcache-mp-dirtest-{uuid.uuid4().hex[:12]}"
    yield place
    if place.is_symlink() or place.is_file():
        place.unlink()
    else:
        shutil.rmtree(place, ignore_errors=True)


def plant_link(state, link: str, target: str) -> None:
    os.symlink(target, link)


def plant_directory_with_link(state, directory: str, target: str) -> None:
    os.mkdir(directory, 0o755)
    os.symlink(target, os.path.join(directory, "tier"))


@pytest.mark.parametrize("layout", ["nobody's link in /tmp", "nobody's directory holding a link",
                                    "root's own link"])
def test_a_link_or_another_users_directory_on_the_way_is_refused(tmp_path, in_tmp, agents,
                                                                 layout):
    """A victim server's tier lies in a directory of root's; nobody points a name the
    operator gave at it. The server refuses to start, naming the component and its owner,
    and makes nothing where the link points."""
    victim = tmp_path / "victim"
    victim.mkdir(mode=0o700)
    (victim / "disk").mkdir(mode=0o700)
    before = sorted(os.listdir(victim))
    if layout == "root's own link":
        in_tmp.symlink_to(victim)
        disk_dir, named, owner = in_tmp / "disk", in_tmp, "uid 0 (root)"
    else:
        attacker = agents("attacker", uid=NOBODY)
        if layout == "nobody's link in /tmp":
            attacker.run(plant_link, str(in_tmp), str(victim))
            disk_dir, named = in_tmp / "disk", in_tmp
        else:
            attacker.run(plant_directory_with_link, str(in_tmp), str(victim))
            disk_dir, named = in_tmp / "tier" / "disk", in_tmp
        owner = f"uid {NOBODY} (nobody)"
    log = refusal(disk_dir)
    assert f"cannot use the disk tier: {named} " in log and owner in log
    assert ("symbolic link" in log) == (layout != "nobody's directory holding a link")
    assert sorted(os.listdir(victim)) == before and not os.listdir(victim / "disk")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another uid's needs root")
@pytest.mark.parametrize("parent", ["another uid's", "writable by all, not sticky",
                                    "group-writable"])
def test_a_parent_another_user_could_change_is_refused(tmp_path, parent):
    place = tmp_path / "parent"
    place.mkdir(mode=0o755)
    if parent == "another uid's":
        os.chown(place, NOBODY, NOBODY)
        expected = f"{place} belongs to uid {NOBODY} (nobody)"
    elif parent == "writable by all, not sticky":
        place.chmod(0o777)
        expected = f"{place} has mode 777"
    else:
        place.chmod(0o775)
        expected = f"{place} has mode 775"
    log = refusal(place / "disk")
    assert expected in log and "could replace what is below it" in log
    assert not (place / "disk").exists()


def test_a_file_at_the_disk_dir_is_not_a_directory(tmp_path):
    (tmp_path / "disk").write_text("not a tier")
    log = refusal(tmp_path / "disk")
    assert f"{tmp_path / 'disk'} is not a directory (a regular file of uid" in log
    assert "not a tier" not in log


def test_a_second_server_on_the_same_directory_is_refused_and_the_first_serves_on(tmp_path):
    hashes, later = prompt(tag=4301, num_chunks=PROMPT_CHUNKS), prompt(4302, PROMPT_CHUNKS)
    disk_dir = tmp_path / "disk"
    with run_server("--cpu-size", "4MiB", "--disk-dir", str(disk_dir), *DISK) as first:
        store(first, hashes, seed=91)
        wait_for(lambda: stats(first).disk_chunks_written == PROMPT_CHUNKS, "the writes")
        log = refusal(disk_dir)
        assert f"cannot use the disk tier: {disk_dir} is in use by another server " \
               f"(pid {started_process(first).pid})" in log
        assert served(first, hashes, 91) == PROMPT_CHUNKS
        store(first, later, seed=92)
        wait_for(lambda: stats(first).disk_chunks_written == 2 * PROMPT_CHUNKS, "the writes")
        assert served(first, later, 92) == PROMPT_CHUNKS


def stuck_server(monkeypatch, fault: str, disk_dir: Path, runtime: Path):
    """A server whose disk write (or read) thread blocks for good on its first piece of
    work (faults.py): a write, or the journal's replay at start-up."""
    monkeypatch.setenv(FAULT_ENV, fault)
    server = server_process(None, ["--cpu-size", "4MiB", "--disk-dir", str(disk_dir), *DISK,
                                   "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
                                   "--log-level", "info"], str(runtime))
    server.start()
    monkeypatch.delenv(FAULT_ENV)
    return server


@pytest.mark.parametrize("fault,signals", [("disk-write-stuck", 1), ("disk-write-stuck", 2),
                                           ("disk-read-stuck", 1)])
def test_sigterm_ends_a_server_whose_disk_never_returns(tmp_path, monkeypatch, fault, signals):
    """A disk thread is stuck (as on a frozen filesystem): one SIGTERM ends the server
    after the shutdown timeout and a second of grace, exit 0; a second SIGTERM at once,
    exit 1. The chunks of the stuck write are not counted as written, and a restart on
    the directory finds none of them, and nothing damaged."""
    disk_dir, runtime = tmp_path / "disk", tmp_path / "run"
    runtime.mkdir(mode=0o700)
    hashes = prompt(tag=4303, num_chunks=PROMPT_CHUNKS)
    server = stuck_server(monkeypatch, fault, disk_dir, runtime)
    try:
        if fault == "disk-write-stuck":
            wait_for(lambda: stats(server).disk_loaded, "the disk index")
        store(server, hashes, seed=93)
        figures = stats(server)
        assert figures.disk_chunks_written == 0 and figures.disk_queue_chunks == PROMPT_CHUNKS
        assert figures.disk_loaded == (fault == "disk-write-stuck")
        server.proc.send_signal(signal.SIGTERM)
        if signals == 2:
            wait_for(lambda: "shutdown: writing the disk tier's queue" in server.output(),
                     "the drain")
            server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(EXIT_BOUND_S)  # the bound on the exit: TimeoutExpired
    finally:
        server.close()
    log = server.output()
    if signals == 1:
        what = "write" if fault == "disk-write-stuck" else "read"
        assert code == 0 and f"a disk {what} under way at shutdown has not returned" in log
        assert ("it is abandoned (its chunks are not written)" in log) == (what == "write")
        assert "shutdown: done" in log
    else:
        assert code == 1 and "second SIGTERM: exiting now" in log
    with run_server("--cpu-size", "4MiB", "--disk-dir", str(disk_dir), *DISK,
                    runtime_dir=str(runtime)) as restarted:
        after = wait_for(lambda: (s := stats(restarted)).disk_loaded and s, "the disk index")
        assert after.disk_loaded_chunks == 0 and after.disk_corrupt == 0
        assert served(restarted, hashes, 93) == 0
        store(restarted, hashes, seed=93)  # the tier works: the prompt is written now
        wait_for(lambda: stats(restarted).disk_chunks_written == PROMPT_CHUNKS, "the writes")
