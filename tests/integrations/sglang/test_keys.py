"""SGLang page keys as chunk hashes: a key that spells a SHA-256 digest (what SGLang makes) is
stored under the digest's first 16 bytes, any other key under BLAKE2b-128 of its text (with
the backend's personalization), and the server finds the pages under exactly those hashes."""

import hashlib

import pytest

from lmcache_mp.client import LookupItem
from lmcache_mp.integrations.sglang.keys import chunk_hash, packed_hashes

from .hostpools import mha_pool
from .test_backend import backend, filled, page_keys, tokens_of


def other_hash(key):
    return hashlib.blake2b(key.encode(), digest_size=16, person=b"lmcache-mp-sgl").digest()


def test_a_sha256_key_is_its_digests_first_16_bytes_and_any_other_key_is_hashed():
    digests = page_keys(3)
    others = ["page-0", digests[0].upper(), digests[1][:63], " " + digests[2][1:],
              digests[2][:62] + "  ", digests[0][:63] + "g", "é" * 64, "",
              digests[1][:10] + "A" + digests[1][11:], digests[0][:32] + "\t" + digests[0][33:],
              digests[2][:31] + "\n" + digests[2][32:]]
    assert [chunk_hash(key) for key in digests] == [bytes.fromhex(k)[:16] for k in digests]
    assert [chunk_hash(key) for key in others] == [other_hash(key) for key in others]
    # A batch is the keys' hashes back to back, whatever it mixes.
    # A 63-digit key beside a 65-digit one joins to two digests' length: each is hashed.
    cut = [digests[0][:63], digests[1] + "0"]
    # A 63-digit key before a key that starts with a space: a space where one is expected.
    shifted = [digests[0][:63], " " + digests[1]]
    # 62 digits and 66: whole bytes each, two digests' worth, cut in the wrong place.
    even_cut = [digests[0][:62], digests[1] + "00"]
    for keys in (digests, others, [digests[0], "page-0", digests[1]], cut, shifted, even_cut,
                 []):
        assert packed_hashes(keys) == b"".join(chunk_hash(key) for key in keys)
    assert len({chunk_hash(key) for key in digests + others}) == len(digests + others)


@pytest.mark.parametrize("kind", ["sglang", "other"])
def test_the_server_finds_the_pages_under_those_hashes(server, kind):
    pool = filled(mha_pool, "layer_first")
    storage = backend(pool, server.url, salt="keys")
    keys = page_keys(4) if kind == "sglang" else [f"page-{n}" for n in range(4)]
    assert storage.batch_set_v1(keys, tokens_of(0, 4)) == [True] * 4
    expected = [bytes.fromhex(key)[:16] if kind == "sglang" else other_hash(key)
                for key in keys]
    space = storage.link.space
    with server.client() as client:
        item = LookupItem.build("probe", expected, "keys")
        assert client.lookup(space.model, space.kv_world_size, [item]) == [4]
    storage.close()
