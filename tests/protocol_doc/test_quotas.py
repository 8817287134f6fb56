"""The quota model of docs/protocol.md holds on a real server: the layers (default, --quota,
--quota-file, QUOTA_SET), SIGHUP reloads, usage in 4096-byte units, OVER_QUOTA and STATS
`tenants`; the QUOTA_SET error examples replay."""

from __future__ import annotations

import re
import signal
import struct
from pathlib import Path
from typing import Any

from lmcache_mp import protocol
from lmcache_mp.client import SharedKVCache, chunk_hashes
from lmcache_mp.server.cache.pool import ALIGNMENT, aligned

from ..utils import started_process, wait_for
from .document import (
    doc_operations,
    fenced_blocks,
    parse_exchange,
    section,
)
from .wire import (
    SERVER_CPU_SIZE,
    call,
    fd_socket,
    replay,
    running_server,
    session,
    wire_handles,
)

# ---------------------------------------------------------------------------
# Quotas.

def test_quota_set_error_examples_replay_against_a_real_server() -> None:
    lines = doc_operations()["QUOTA_SET"]
    (block,) = fenced_blocks(lines, "text")
    messages = parse_exchange(block)
    assert {m[2] for m in messages[0::2]} == {"QUOTA_SET"}
    assert {(m[2], m[3]["code"]) for m in messages[1::2]} == {("err", "bad_request")}
    # The examples name the pool size they were made on: the one these servers have, and
    # the admin session they need.
    prose = re.sub(r"\s+", " ", " ".join(lines))
    assert f"started with `--cpu-size {SERVER_CPU_SIZE}`, from an admin session" in prose
    with running_server() as running, session(running, admin=True) as sock:
        replay(sock, messages)
        # Nothing was applied.
        assert call(sock, 100, "QUOTA_LIST", {}) == {"default_cap": None, "quotas": []}
        assert call(sock, 101, "STATS", {})["capacity_bytes"] == 64 * 1024**2


def _mla_cache() -> SharedKVCache:
    """An MLA cache whose chunk_bytes (1 layer x 256 tokens x 9 x 2 bytes = 4608) is not aligned."""
    return SharedKVCache("mla", num_layers=1, num_blocks=16, block_size=128, heads=1, head_dim=9)


def _quota(salt: str, cap: int | None, reserve: int, own: bool, used: int) -> dict[str, Any]:
    return {"cache_salt": salt, "cap": cap, "reserve": reserve, "own": own, "bytes_used": used}


def test_the_quota_model_holds_on_a_real_server(tmp_path: Path) -> None:
    """Layers, usage in 4096-byte units, caps, OVER_QUOTA, SIGHUP and STATS `tenants`."""
    quotas_section = re.sub(r"\s+", " ", " ".join(section("## Quotas")))
    assert ALIGNMENT == 4096 and f"multiple of {ALIGNMENT} bytes" in quotas_section
    assert aligned(16384) == 16384 and aligned(10000) == 12288
    assert "A chunk of 16384 bytes counts 16384, one of 10000 bytes counts 12288" in quotas_section
    for flag in ("--default-quota", "--quota", "--quota-file", "SIGHUP"):
        assert flag in quotas_section, flag
    KiB, MiB = 1024, 1024**2
    quota_file = tmp_path / "quotas.toml"
    quota_file.write_text('[quotas]\n"team-f" = "32KiB"\n"team-r" = {cap = "unlimited", '
                          'reserve = "1MiB"}\n')
    kv = _mla_cache()
    try:
        with running_server("--default-quota", "1MiB", "--quota", "team-a=64KiB:16KiB",
                            "--quota", "team-f=2MiB", "--quota-file", str(quota_file)) as running, \
                session(running, admin=True) as sock:
            # Layers: the file wins over the flags; salts nobody names get the default.
            assert call(sock, 1, "QUOTA_LIST", {}) == {"default_cap": MiB, "quotas": [
                _quota("team-a", 64 * KiB, 16 * KiB, True, 0),
                _quota("team-f", 32 * KiB, 0, True, 0),
                _quota("team-r", None, MiB, True, 0)]}
            assert call(sock, 2, "QUOTA_GET", {"cache_salt": "nobody"}) == \
                _quota("nobody", MiB, 0, False, 0)
            # QUOTA_SET is the top layer; QUOTA_DELETE removes only it.
            assert call(sock, 3, "QUOTA_SET", {"cache_salt": "team-a", "cap": None}) == \
                _quota("team-a", None, 0, True, 0)
            assert call(sock, 4, "QUOTA_DELETE", {"cache_salt": "team-a"}) == \
                _quota("team-a", 64 * KiB, 16 * KiB, True, 0)
            assert call(sock, 5, "QUOTA_DELETE", {"cache_salt": "team-a"}) == \
                _quota("team-a", 64 * KiB, 16 * KiB, True, 0)
            assert call(sock, 6, "QUOTA_SET", {"cache_salt": "nobody", "cap": 0, "reserve": 0}) \
                == _quota("nobody", 0, 0, True, 0)
            assert call(sock, 7, "QUOTA_DELETE", {"cache_salt": "nobody"}) == \
                _quota("nobody", MiB, 0, False, 0)

            # Usage: 4608-byte chunks count 8192 bytes each, so a 32 KiB cap takes 4 of them;
            # the fifth chunk of the same STORE cannot evict chunks being stored: OVER_QUOTA.
            reg = call(sock, 8, "REGISTER_KV_CACHE", {
                "model": "quota-model", "kv_world_size": 1, "kv_worker_id": 0, "layout": "mla",
                "block_size": 128, "layers": wire_handles(kv, fd_socket(running))})
            assert reg["chunk_bytes"] == 4608
            footprint = 8192
            hashes = chunk_hashes(list(range(256 * 6)), 256)

            def store(n: int, first: int, count: int) -> bytes:
                reply = call(sock, n, "STORE", {"instance_id": reg["instance_id"], "items": [{
                    "request_id": "w", "chunk_hashes": b"".join(hashes[first:first + count]),
                    "block_ids": struct.pack(f"<{2 * count}i", *range(2 * count)),
                    "cache_salt": "team-f"}]})
                (statuses,) = reply["results"]
                return statuses

            S = protocol.StoreStatus
            assert store(9, 0, 5) == bytes([S.STORED] * 4 + [S.OVER_QUOTA])
            assert call(sock, 10, "QUOTA_GET", {"cache_salt": "team-f"}) == \
                _quota("team-f", 32 * KiB, 0, True, 4 * footprint)
            # A later chunk evicts the salt's own least recently used chunk instead.
            assert store(11, 5, 1) == bytes([S.STORED])
            lookup = {"model": "quota-model", "kv_world_size": 1, "items": [
                {"request_id": "q", "chunk_hashes": b"".join(hashes), "cache_salt": "team-f"}]}
            # A STORE commits its last chunk first, so chunk 3 was the oldest: it went.
            assert call(sock, 12, "LOOKUP", lookup) == {"hits": [3]}

            stats = call(sock, 13, "STATS", {})
            assert stats["tenants"]["team-f"] == {
                "bytes_used": 4 * footprint, "chunks": 4, "cap": 32 * KiB, "reserve": 0,
                "hits": 3, "misses": 3, "evictions": 1, "refused": 1, "disk_bytes": 0,
                "disk_chunks": 0}
            # "nobody" was only looked up: it holds nothing and has no quota, so it is not listed.
            assert set(stats["tenants"]) == {"team-a", "team-f", "team-r"}
            assert stats["tenants"]["team-r"] == {
                "bytes_used": 0, "chunks": 0, "cap": None, "reserve": MiB, "hits": 0,
                "misses": 0, "evictions": 0, "refused": 0, "disk_bytes": 0, "disk_chunks": 0}
            for total in ("chunks", "bytes_used"):
                assert stats[total] == sum(t[total] for t in stats["tenants"].values()), total
            for total in ("hits", "misses", "evictions"):  # unlisted salts count here too
                assert stats[total] >= sum(t[total] for t in stats["tenants"].values()), total

            # SIGHUP reloads the file as a whole; a lower cap evicts at once.
            quota_file.write_text('[quotas]\n"team-f" = "16KiB"\n')
            started_process(running).send_signal(signal.SIGHUP)
            info = wait_for(lambda: (reply := call(sock, 14, "QUOTA_GET", {
                "cache_salt": "team-f"}))["cap"] == 16 * KiB and reply, "the reload")
            assert info == _quota("team-f", 16 * KiB, 0, True, 2 * footprint)
            assert call(sock, 15, "QUOTA_GET", {"cache_salt": "team-r"}) == \
                _quota("team-r", MiB, 0, False, 0)  # gone from the file: the default again
            # A file that breaks the rules changes nothing.
            quota_file.write_text('[quotas]\n"team-f" = "1MiB:2MiB"\n')
            started_process(running).send_signal(signal.SIGHUP)
            # Its error in the log says the reload was tried (and refused).
            wait_for(lambda: "SIGHUP: quotas not reloaded" in running.output(), "the refusal")
            assert call(sock, 16, "QUOTA_GET", {"cache_salt": "team-f"})["cap"] == 16 * KiB
            # Without the file's entry, the flag's quota applies again.
            quota_file.write_text("[quotas]\n")
            started_process(running).send_signal(signal.SIGHUP)
            wait_for(lambda: call(sock, 17, "QUOTA_GET", {"cache_salt": "team-f"})["cap"]
                     == 2 * MiB, "the second reload")
            assert call(sock, 18, "UNREGISTER_KV_CACHE", {"instance_id": reg["instance_id"]}) == {}
    finally:
        kv.close()
