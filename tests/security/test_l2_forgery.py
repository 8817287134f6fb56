"""Forged L2 values: an attacker of another uid who can reach Redis, but neither the servers'
sockets nor their key file, overwrites a tenant's value there. With --l2-key-file no forgery
is loaded (a miss, counted in l2_corrupt); without one the forgery is served, and the
server said so at start-up. Key rotation, and key files a server refuses to start with."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import zlib

import pytest
import torch

from lmcache_mp.client import CacheClient

from ..redis_servers import redis, redis_server
from ..server.l2.test_shared_tier import (
    L2_FLAGS,
    NUM_BLOCKS,
    retrieve_through,
    store_through,
    written,
)
from ..utils import run_server, server_process, started_process
from ..workers import Job, chunk_blocks, expected_blocks, prompt, retrieve_worker, run
from .agents import NOBODY

KEY, OLD_KEY, ATTACKERS_KEY = (secrets.token_hex(32) for _ in range(3))
FORGED_BYTE = 0x5A
NO_KEY_WARNING = "L2 values are not signed: anyone who can write to"


def key_file(directory, name: str, *keys: str, mode: int = 0o600) -> str:
    path = directory / name
    path.write_text("".join(key + "\n" for key in keys))
    path.chmod(mode)
    return str(path)


def l2_stats(server):
    with CacheClient(server.url, timeout=10) as client:
        return client.stats()


# Steps the attacker (uid nobody) runs.

def try_to_read(state, path: str) -> str:
    try:
        open(path).close()
    except OSError as exc:
        return type(exc).__name__
    return "read it"


def plant(state, port: int, chunk_hash: bytes, how: str, source_hash: bytes = b"") -> None:
    """Overwrite the L2 value of the chunk of `chunk_hash` with a forgery made `how`. Keys
    are computable, but the attacker needs none of that: it lists them."""
    if "redis" not in state:
        state["redis"] = redis.Redis(host="127.0.0.1", port=port, socket_timeout=10)
    client = state["redis"]

    def key_of(hash_: bytes) -> bytes:
        (key,) = [k for k in client.keys("lmcache-mp:1:*") if k.endswith(hash_.hex().encode())]
        return key
    key = key_of(chunk_hash)
    if key not in state:  # what the server wrote, kept to put back at the end
        state[key] = client.get(key)
    genuine = state[key]
    size = int.from_bytes(genuine[8:16], "little")  # both formats state it there
    payload = bytes([FORGED_BYTE]) * size
    if how == "crc":  # format 1, checksum recomputed: what a keyless server takes
        value = struct.pack("<4sHHQI", b"LMCV", 1, 0, size,
                            zlib.crc32(payload, zlib.crc32(key))) + payload
    elif how in ("mac under their key id", "mac under its own key id"):
        key_id = (genuine[16:24] if how == "mac under their key id" else
                  hashlib.sha256(b"lmcache-mp L2 key id\0" + ATTACKERS_KEY.encode()).digest()[:8])
        signed = struct.pack("<4sHHQ8s", b"LMCV", 2, 0, size, key_id)
        value = signed + hmac.new(ATTACKERS_KEY.encode(), signed + key + payload,
                                  "sha256").digest() + payload
    elif how == "another tenant's value copied":
        value = client.get(key_of(source_hash))
    else:  # "genuine": the server's own value, put back
        value = genuine
    client.set(key, value, keepttl=True)


def test_with_a_key_no_forged_value_is_loaded(tmp_path, agents):
    path = key_file(tmp_path, "l2.key", KEY)
    flags = ("--l2-key-file", path, *L2_FLAGS)
    with redis_server() as store, run_server("--l2", store.url, *flags) as node_a, \
            run_server("--l2", store.url, *flags) as node_b:
        victim, other = prompt(tag=3401, num_chunks=4), prompt(tag=3402, num_chunks=1)
        store_through(node_a, victim, seed=81, salt="tenant-b")
        store_through(node_a, other, seed=82, salt="tenant-a")
        written(node_a, 5)
        attacker = agents("attacker", uid=NOBODY)
        assert attacker.run(try_to_read, path) == "PermissionError"
        forgeries = ("crc", "mac under their key id", "mac under its own key id",
                     "another tenant's value copied")
        for corrupt, how in enumerate(forgeries, 1):
            attacker.run(plant, store.port, victim[2], how, other[0])
            result = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, victim,
                                              chunk_blocks([4, 5, 6, 7]), cache_salt="tenant-b"))
            # B's first two chunks land byte-exact; the run ends before the forged one, and
            # no byte of it reaches B's cache.
            assert (result.hit, result.retrieved, result.untouched_all_zero) == (2, 2, True), how
            assert torch.equal(result.blocks,
                               expected_blocks(NUM_BLOCKS, 81, chunk_blocks([0, 1])))
            stats = l2_stats(node_b)
            assert (stats.l2_corrupt, stats.l2_hits) == (corrupt, 2), how
        attacker.run(plant, store.port, victim[2], "genuine")
        retrieve_through(node_b, victim, seed=81, salt="tenant-b")
        assert l2_stats(node_b).l2_hits == 4
    assert NO_KEY_WARNING not in node_a.output() + node_b.output()


def test_without_a_key_a_forged_value_is_served_and_the_server_warns(agents):
    with redis_server() as store, run_server("--l2", store.url, *L2_FLAGS) as node_a, \
            run_server("--l2", store.url, *L2_FLAGS) as node_b:
        victim = prompt(tag=3403, num_chunks=4)
        store_through(node_a, victim, seed=83, salt="tenant-b")
        written(node_a, 4)
        agents("attacker", uid=NOBODY).run(plant, store.port, victim[2], "crc")
        result = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, victim,
                                          chunk_blocks([4, 5, 6, 7]), cache_salt="tenant-b"))
        assert (result.hit, result.retrieved) == (4, 4)
        forged = run(retrieve_worker, Job(node_b.url, NUM_BLOCKS, None, victim[2:3],
                                          chunk_blocks([3]), cache_salt="tenant-b"))
        # B loads the attacker's bytes as its own KV.
        assert forged.hit == 1 and bool((forged.blocks == FORGED_BYTE).all())
        assert l2_stats(node_b).l2_corrupt == 0
    for node in (node_a, node_b):
        (line,) = [line for line in node.output().splitlines() if NO_KEY_WARNING in line]
        assert "WARNING" in line and "--l2-key-file" in line


def test_key_rotation(tmp_path):
    """The documented procedure: the new key goes out as line 2, the lines are swapped, the
    old key is dropped. A value signed by either key verifies wherever both are listed."""
    old = key_file(tmp_path, "old", OLD_KEY)
    rolled_in = key_file(tmp_path, "rolled-in", OLD_KEY, KEY)
    swapped = key_file(tmp_path, "swapped", KEY, OLD_KEY)
    new = key_file(tmp_path, "new", KEY)
    before, after = prompt(tag=3404, num_chunks=2), prompt(tag=3405, num_chunks=2)
    with redis_server() as store:
        def node(path: str):
            return run_server("--l2", store.url, "--l2-key-file", path, *L2_FLAGS)
        with node(old) as signer:
            store_through(signer, before, seed=84)
            written(signer, 2)
        with node(swapped) as signer:  # signs with the new key, still takes the old one's
            retrieve_through(signer, before, seed=84)
            store_through(signer, after, seed=85)
            written(signer, 2)
        with node(rolled_in) as reader:  # not signing with the new key yet, but it takes it
            retrieve_through(reader, after, seed=85)
        with node(new) as reader:  # the old key dropped: what it signed is a miss
            missed = run(retrieve_worker, Job(reader.url, NUM_BLOCKS, None, before,
                                              chunk_blocks([6, 7])))
            assert (missed.hit, missed.retrieved) == (0, 0)
            retrieve_through(reader, after, seed=85)
            stats = l2_stats(reader)
            assert (stats.l2_corrupt, stats.l2_hits) == (1, 2)


def bad_key_files(tmp_path) -> dict[str, tuple[str, str]]:
    """label: (path, words the refusal says)."""
    good = key_file(tmp_path, "good", KEY)
    link = tmp_path / "link"
    link.symlink_to(good)
    others = key_file(tmp_path, "others", KEY)
    os.chown(others, NOBODY, NOBODY)
    return {
        "a symlink": (str(link), "a symbolic link, which is not followed"),
        "mode 0644": (key_file(tmp_path, "readable", KEY, mode=0o644),
                      "has mode 644: others could read the L2 key"),
        "mode 0660": (key_file(tmp_path, "writable", KEY, mode=0o660),
                      "has mode 660: others could change the L2 key"),
        "another user's": (others, f"belongs to uid {NOBODY}"),
        "a short key": (key_file(tmp_path, "short", KEY[:31]), "line 1 holds 31 characters"),
        "a blank line": (key_file(tmp_path, "blank", KEY, ""), "line 2 holds 0 characters"),
        "three keys": (key_file(tmp_path, "three", KEY, OLD_KEY, ATTACKERS_KEY),
                       "holds 3 lines"),
        "no file": (str(tmp_path / "missing"), "No such file"),
    }


def test_unsafe_key_files_are_refused_at_start_up(tmp_path):
    refusals = {}
    for label, (path, words) in bad_key_files(tmp_path).items():
        server = server_process(args=["--cpu-size", "64MiB", "--l2", "redis://127.0.0.1:1",
                                      "--l2-key-file", path])
        with pytest.raises(RuntimeError):
            server.start()
        refusals[label] = (started_process(server).returncode, words in server.output())
    assert refusals == {label: (2, True) for label in refusals}
