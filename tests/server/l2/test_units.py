"""The L2 tier's parts on their own: URLs, keys and checked values, and the ledger that keeps
the byte budget, the salts' caps, the TTL and what needs no writing again."""

from __future__ import annotations

import pytest

from lmcache_mp.server.config import Config
from lmcache_mp.server.l2.codec import (
    HEADER_BYTES, l2_key, namespace, value_buffer, verified_payload, write_header,
)
from lmcache_mp.server.l2.ledger import Ledger
from lmcache_mp.server.l2.urls import check_url, parse_cluster_url
from lmcache_mp.server.store import ChunkKey


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379", "redis://cache:6380/3", "rediss://user:pw@cache.example:6379/0",
    "redis+cluster://10.0.0.1:7000,10.0.0.2:7000", "rediss+cluster://:pw@[::1]:7000",
])
def test_urls_it_accepts(url):
    check_url(url)


@pytest.mark.parametrize("url", [
    "http://cache:6379", "redis://", "redis://cache:port", "redis://cache:6379/one",
    "redis+cluster://", "redis+cluster://cache", "redis+cluster://a:7000/2",
])
def test_urls_it_refuses(url):
    with pytest.raises(ValueError):
        check_url(url)


def test_a_cluster_url_names_seed_nodes_and_credentials():
    assert parse_cluster_url("rediss+cluster://app:s%40cret@a:7000,[::1]:7001") == (
        [("a", 7000), ("::1", 7001)], "app", "s@cret", True)
    assert parse_cluster_url("redis+cluster://a:7000") == ([("a", 7000)], None, None, False)


def test_config_checks_l2_flags(tmp_path, capsys):
    config = Config.from_args(["--l2", "redis+cluster://a:7000,b:7000", "--l2-budget", "1GiB",
                               "--l2-prefetch-wait", "0"], env={})
    assert (config.l2_budget, config.l2_prefetch_wait, config.l2_ttl) == (1024**3, 0.0, 86400)
    for argv in (["--l2", "memcached://a:1"], ["--l2-password-file", str(tmp_path / "pw")],
                 ["--l2", "redis://a:1", "--l2-password-file", str(tmp_path / "missing")],
                 ["--l2", "redis://a:1", "--l2-prefetch-wait", "-1"]):
        with pytest.raises(SystemExit):
            Config.from_args(argv, env={})
        assert "error:" in capsys.readouterr().err


KEY = ChunkKey("m", 2, 1, "tenant", bytes(range(16)))


def test_keys_keep_models_geometries_ranks_and_salts_apart():
    space = namespace("m", ("mha", 4))
    key = l2_key(space, KEY)
    assert key.startswith(b"lmcache-mp:1:") and key.endswith(KEY.chunk_hash.hex().encode())
    assert b"tenant" not in key and b"{" not in key
    others = {l2_key(namespace("m2", ("mha", 4)), KEY), l2_key(namespace("m", ("mha", 8)), KEY),
              l2_key(space, KEY._replace(cache_salt="other")),
              l2_key(space, KEY._replace(kv_worker_id=0)),
              l2_key(space, KEY._replace(kv_world_size=4)),
              l2_key(space, KEY._replace(chunk_hash=bytes(16)))}
    assert key not in others and len(others) == 6


def sealed(key: bytes, payload: bytes) -> bytes:
    value = value_buffer(len(payload))
    value[HEADER_BYTES:] = payload
    write_header(key, value)
    return bytes(value)


def test_values_verify_and_anything_else_is_a_miss():
    key, payload = b"k", bytes(range(256)) * 8
    value = sealed(key, payload)
    assert bytes(verified_payload(key, value, len(payload))) == payload
    flipped = bytearray(value)
    flipped[HEADER_BYTES + 100] ^= 1
    for wrong_key, bad, size in [(b"k2", value, len(payload)),  # copied under another key
                                 (key, bytes(flipped), len(payload)),
                                 (key, value[:-1], len(payload)),  # truncated
                                 (key, value + b"x", len(payload)),
                                 (key, value, len(payload) - 1),  # another geometry's size
                                 (key, b"XXXX" + value[4:], len(payload)),  # not our magic
                                 (key, b"", len(payload))]:
        assert verified_payload(wrong_key, bad, size) is None


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ledger_budget_deletes_the_oldest_values():
    ledger = Ledger(budget=300, ttl_s=60, clock=Clock())
    for name in (b"a", b"b", b"c"):
        assert ledger.make_room("s", 100, None) == []
        ledger.add(name, "s", 100)
    assert ledger.make_room("t", 150, None) == [b"a", b"b"]
    ledger.add(b"d", "t", 150)
    assert ledger.bytes_held == 250 and not ledger.known(b"a") and ledger.known(b"c")
    assert ledger.make_room("t", 301, None) is None  # never fits: nothing forgotten
    assert ledger.bytes_held == 250


def test_ledger_caps_a_salt_by_its_own_oldest_values_first():
    ledger = Ledger(budget=None, ttl_s=60, clock=Clock())
    ledger.add(b"other", "t", 100)
    ledger.add(b"a", "s", 100)
    ledger.add(b"b", "s", 100)
    assert ledger.make_room("s", 100, cap=200) == [b"a"]
    assert ledger.known(b"other") and ledger.by_salt["s"] == 100
    assert ledger.make_room("s", 300, cap=200) is None


def test_ledger_forgets_expired_values_and_failed_writes():
    clock = Clock()
    ledger = Ledger(budget=None, ttl_s=10, clock=clock)
    ledger.add(b"a", "s", 100)
    clock.now = 5
    ledger.add(b"b", "s", 100)
    ledger.seen(b"theirs")
    ledger.discard(b"b")
    assert ledger.bytes_held == 100 and ledger.known(b"theirs")
    clock.now = 10
    assert ledger.bytes_held == 0 and not ledger.known(b"a") and ledger.known(b"theirs")
    clock.now = 15
    assert not ledger.known(b"theirs") and not ledger.by_salt
