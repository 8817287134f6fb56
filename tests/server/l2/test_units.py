"""The L2 tier's parts on their own: URLs, keys and checked values, and the ledger that keeps
the byte budget, the salts' caps, the TTL and what needs no writing again."""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from lmcache_mp.server.cache.chunk import ChunkKey
from lmcache_mp.server.config import Config
from lmcache_mp.server.l2.base import L2Counters, L2Error, L2Refused
from lmcache_mp.server.l2.codec import (
    CrcFormat,
    MacFormat,
    ValueFormat,
    key_id,
    l2_key,
    value_format,
)
from lmcache_mp.server.l2.health import Health
from lmcache_mp.server.l2.keyfile import L2Keys, read_key_file
from lmcache_mp.server.l2.ledger import Ledger
from lmcache_mp.server.l2.urls import MooncakeUrl, check_url, parse_cluster_url, parse_mooncake_url
from lmcache_mp.server.lower.names import namespace

from ...utils import FakeClock


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


MOONCAKE = "mooncake://10.0.0.5:50051?local=10.0.0.7&metadata=http://10.0.0.5:8080/metadata"


def test_a_mooncake_url_names_the_master_metadata_and_what_this_server_lends():
    assert parse_mooncake_url(MOONCAKE) == MooncakeUrl(
        master="10.0.0.5:50051", local="10.0.0.7", metadata="http://10.0.0.5:8080/metadata",
        protocol="tcp", devices="", segment=1024**3, buffer=128 * 1024**2)
    rdma = parse_mooncake_url(MOONCAKE.replace("http://10.0.0.5:8080/metadata",
                                               "etcd://10.0.0.5:2379")
                              + "&protocol=rdma&devices=mlx5_0,mlx5_1&segment=16GiB&buffer=1GiB")
    assert (rdma.metadata, rdma.protocol, rdma.devices, rdma.segment, rdma.buffer) == (
        "etcd://10.0.0.5:2379", "rdma", "mlx5_0,mlx5_1", 16 * 1024**3, 1024**3)
    assert parse_mooncake_url(MOONCAKE + "&segment=0").segment == 0  # lends nothing


@pytest.mark.parametrize(("url", "says"), [
    ("mooncake://10.0.0.5?local=a&metadata=http://m", "expected host:port"),
    ("mooncake://10.0.0.5:0?local=a&metadata=http://m", "out of range"),
    ("mooncake://u:p@10.0.0.5:1?local=a&metadata=http://m", "no user or password"),
    ("mooncake://10.0.0.5:1/db?local=a&metadata=http://m", "no path"),
    ("mooncake://10.0.0.5:1?metadata=http://m", "local= is required"),
    ("mooncake://10.0.0.5:1?local=a", "metadata= is required"),
    ("mooncake://10.0.0.5:1?local=a b&metadata=http://m", "host name or address"),
    ("mooncake://10.0.0.5:1?local=a&metadata=ftp://m", "metadata= must start with"),
    (MOONCAKE + "&protocol=udp", "tcp or rdma"),
    (MOONCAKE + "&devices=mlx5_0", "needs protocol=rdma"),
    (MOONCAKE + "&protocol=rdma&devices=mlx5_0;rm", "RDMA device names"),
    (MOONCAKE + "&segment=lots", "segment: invalid size"),
    (MOONCAKE + "&segment=8MiB", "segment must be 0 (lend nothing) or at least"),
    (MOONCAKE + "&buffer=1MiB", "buffer must be at least"),
    (MOONCAKE + "&local=b", "local given twice"),
    (MOONCAKE + "&replicas=2", "unknown option 'replicas'"),
    (MOONCAKE + "&&", "name=value pairs"),
])
def test_mooncake_urls_it_refuses_and_why(url, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        check_url(url)


def test_config_takes_a_mooncake_url_and_refuses_a_password_file_with_it(tmp_path, capsys):
    pytest.importorskip("mooncake")
    assert Config.from_args(["--l2", MOONCAKE], env={}).l2 == MOONCAKE
    password = tmp_path / "pw"
    password.write_text("secret\n")
    with pytest.raises(SystemExit):
        Config.from_args(["--l2", MOONCAKE, "--l2-password-file", str(password)], env={})
    assert "a Mooncake master takes none" in capsys.readouterr().err


def test_config_checks_l2_flags(tmp_path, capsys):
    config = Config.from_args(["--l2", "redis+cluster://a:7000,b:7000", "--l2-budget", "1GiB",
                               "--l2-prefetch-wait", "0"], env={})
    assert (config.l2_budget, config.l2_prefetch_wait, config.l2_ttl) == (1024**3, 0.0, 86400)
    key = tmp_path / "key"
    key.write_text("k" * 32 + "\n")
    key.chmod(0o600)
    for argv in (["--l2", "memcached://a:1"], ["--l2-password-file", str(tmp_path / "pw")],
                 ["--l2-key-file", str(key)],
                 ["--l2", "redis://a:1", "--l2-password-file", str(tmp_path / "missing")],
                 ["--l2", "redis://a:1", "--l2-prefetch-wait", "-1"]):
        with pytest.raises(SystemExit):
            Config.from_args(argv, env={})
        assert "error:" in capsys.readouterr().err


def test_key_files_it_reads_and_refuses(tmp_path):
    path = tmp_path / "key"
    path.write_text(f"  {'n' * 32}  \r\n{'o' * 40}\n")
    path.chmod(0o640)  # a group of servers may share it
    assert read_key_file(str(path)) == L2Keys(b"n" * 32, b"o" * 40)
    path.write_text("n" * 64)
    assert read_key_file(str(path)) == L2Keys(b"n" * 64, None)
    config = Config.from_args(["--l2", "redis://a:1", "--l2-key-file", str(path)], env={})
    assert config.l2_key_file == str(path) and f'l2_key_file = "{path}"' in config.to_toml()
    os.mkfifo(tmp_path / "fifo", 0o600)  # refused at once, not waited on for a writer
    (tmp_path / "empty").touch(0o600)
    path.write_bytes(b"\xff" * 40)
    for bad, words in ((tmp_path / "fifo", "is not a regular file"),
                       (path, "is not text"), (tmp_path / "empty", "holds 0 lines")):
        with pytest.raises(ValueError, match=words):
            read_key_file(str(bad))


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


def opened(values: ValueFormat, key: bytes, value: bytes, size: int) -> bytes:
    """The payload of a value the format must vouch for."""
    payload = values.payload(key, value, size)
    assert payload is not None, "not vouched for"
    return bytes(payload)


def sealed(values: ValueFormat, key: bytes, payload: bytes) -> bytes:
    value = values.buffer(len(payload))
    value[values.header_bytes:] = payload
    values.seal(key, value)
    return bytes(value)


OLD, NEW, OTHER = (bytes([c]) * 64 for c in b"onx")
FORMATS = {"crc": CrcFormat(), "mac": MacFormat(L2Keys(NEW, None))}


@pytest.mark.parametrize("name", FORMATS)
def test_values_verify_and_anything_else_is_a_miss(name):
    values = FORMATS[name]
    key, payload = b"k", bytes(range(256)) * 8
    value = sealed(values, key, payload)
    assert opened(values, key, value, len(payload)) == payload
    flipped = bytearray(value)
    flipped[values.header_bytes + 100] ^= 1
    for wrong_key, bad, size in [(b"k2", value, len(payload)),  # copied under another key
                                 (key, bytes(flipped), len(payload)),
                                 (key, value[:-1], len(payload)),  # truncated
                                 (key, value + b"x", len(payload)),
                                 (key, value, len(payload) - 1),  # another geometry's size
                                 (key, b"XXXX" + value[4:], len(payload)),  # not our magic
                                 (key, b"", len(payload))]:
        assert values.payload(wrong_key, bad, size) is None


@pytest.mark.parametrize("name", FORMATS)
def test_a_header_sealed_apart_from_its_payload_is_the_values_own(name):
    """A direct put sends the header and the chunk's pool extent as two buffers of one
    value; a direct get checks them where they landed: the same bytes and checks."""
    values = FORMATS[name]
    key, payload = b"k", bytes(range(256)) * 8
    header = bytearray(values.header_bytes)
    values.seal_header(key, header, memoryview(payload))
    assert bytes(header) == sealed(values, key, payload)[:values.header_bytes]
    assert values.vouches(key, header, memoryview(payload))
    flipped = bytearray(payload)
    flipped[100] ^= 1
    assert not values.vouches(key, header, memoryview(flipped))
    assert not values.vouches(b"k2", header, memoryview(payload))
    assert not values.vouches(key, header, memoryview(payload)[:-1])


def test_the_formats_and_their_headers():
    key, payload = b"lmcache-mp:1:k", b"\x07" * 1000
    crc = sealed(CrcFormat(), key, payload)
    assert (len(crc), crc[:8]) == (20 + 1000, b"LMCV\x01\x00\x00\x00")
    assert int.from_bytes(crc[8:16], "little") == 1000
    mac = sealed(MacFormat(L2Keys(NEW, None)), key, payload)
    assert (len(mac), mac[:8]) == (56 + 1000, b"LMCV\x02\x00\x00\x00")
    assert int.from_bytes(mac[8:16], "little") == 1000
    assert mac[16:24] == key_id(NEW) and NEW not in mac
    assert mac[24:56] == hmac.new(NEW, mac[:24] + key + payload, "sha256").digest()
    assert value_format(None).version == 1 and value_format(L2Keys(NEW, OLD)).version == 2


def test_a_keyed_server_takes_only_values_signed_by_its_keys():
    key, payload = b"k", bytes(range(256)) * 4
    signed_old = sealed(MacFormat(L2Keys(OLD, None)), key, payload)
    signed_new = sealed(MacFormat(L2Keys(NEW, OLD)), key, payload)
    rotating = MacFormat(L2Keys(NEW, OLD))  # new signs, old still verifies
    assert opened(rotating, key, signed_old, len(payload)) == payload
    assert opened(rotating, key, signed_new, len(payload)) == payload
    rolled_in = MacFormat(L2Keys(OLD, NEW))  # the first step: old signs, new verifies
    assert opened(rolled_in, key, signed_new, len(payload)) == payload
    done = MacFormat(L2Keys(NEW, None))  # the old key dropped
    assert done.payload(key, signed_old, len(payload)) is None
    assert opened(done, key, signed_new, len(payload)) == payload
    # The key id names the key: another key's MAC under it, or an unknown id, is no chunk.
    forged = bytearray(sealed(MacFormat(L2Keys(OTHER, None)), key, payload))
    assert done.payload(key, bytes(forged), len(payload)) is None
    forged[16:24] = key_id(NEW)
    assert done.payload(key, bytes(forged), len(payload)) is None
    # Neither format reads the other: a CRC value is no chunk to a keyed server, nor the
    # reverse (a keyless server cannot check a MAC).
    crc = sealed(CrcFormat(), key, payload)
    assert done.payload(key, crc, len(payload)) is None
    assert CrcFormat().payload(key, signed_new, len(payload)) is None


def test_ledger_budget_deletes_the_oldest_values():
    ledger = Ledger(budget=300, ttl_s=60, clock=FakeClock(0.0))
    for name in (b"a", b"b", b"c"):
        assert ledger.make_room("s", 100, None) == []
        ledger.add(name, "s", 100)
    assert ledger.make_room("t", 150, None) == [b"a", b"b"]
    ledger.add(b"d", "t", 150)
    assert ledger.bytes_held == 250 and not ledger.known(b"a") and ledger.known(b"c")
    assert ledger.make_room("t", 301, None) is None  # never fits: nothing forgotten
    assert ledger.bytes_held == 250


def test_ledger_caps_a_salt_by_its_own_oldest_values_first():
    ledger = Ledger(budget=None, ttl_s=60, clock=FakeClock(0.0))
    ledger.add(b"other", "t", 100)
    ledger.add(b"a", "s", 100)
    ledger.add(b"b", "s", 100)
    assert ledger.make_room("s", 100, cap=200) == [b"a"]
    assert ledger.known(b"other") and ledger.by_salt["s"] == 100
    assert ledger.make_room("s", 300, cap=200) is None


def test_ledger_forgets_expired_values_and_failed_writes():
    clock = FakeClock(0.0)
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


def test_health_backs_off_after_a_failure_but_not_after_a_refusal():
    """A store that answered "no room" is up: nothing backs off, nothing is counted."""
    clock = FakeClock()
    counters = L2Counters()
    health = Health(counters, "test", timeout_s=5, clock=clock)

    async def fails(error: L2Error) -> None:
        raise error

    with pytest.raises(L2Refused):
        asyncio.run(health.call("SET", fails(L2Refused("full"))))
    assert (counters.errors, counters.up, health.available()) == (0, True, True)
    with pytest.raises(L2Error):
        asyncio.run(health.call("SET", fails(L2Error("down"))))
    assert (counters.errors, counters.up, health.available()) == (1, False, False)
    clock.now += 0.5  # the first back-off
    assert health.available()


@pytest.mark.parametrize("outcome", ["stalls", "fails"])
def test_pool_memory_of_a_transfer_is_let_go_only_once_its_thread_is_done(outcome):
    """A direct transfer's extents stay its own until its thread returns, also when the
    tier stopped waiting (a stalled master): only then does if_abandoned() give them back."""
    health = Health(L2Counters(), "test", timeout_s=0.05)
    released = []

    async def scenario() -> None:
        let_go = threading.Event()
        executor = ThreadPoolExecutor(1)

        def transfer() -> None:
            assert let_go.wait(60)  # a hang's end only
            if outcome == "fails":
                raise L2Error("transfer failed")
        future = asyncio.wrap_future(executor.submit(transfer))
        if outcome == "fails":
            let_go.set()
        with pytest.raises(L2Error):
            await health.call_on_pool("GET", future, lambda: released.append(True))
        if outcome == "stalls":  # timed out: the thread still has the extents
            await asyncio.sleep(0)
            assert released == []
            let_go.set()
        await asyncio.gather(future, return_exceptions=True)
        await asyncio.sleep(0)
        assert released == [True]
        executor.shutdown()
    asyncio.run(scenario())
