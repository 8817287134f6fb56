"""Disk admission policies (server/disk/admission.py) against a simple model: a dict from
slot to the fingerprint last offered there."""

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.server.config import Config
from lmcache_mp.server.disk.admission import (
    MAX_SLOTS,
    MIN_SLOTS,
    Reused,
    WriteAll,
    admission_policy,
)


def key(number: int) -> bytes:
    return hashlib.blake2b(number.to_bytes(8, "little"), digest_size=16).digest()


def test_write_all_admits_everything():
    policy = WriteAll()
    assert all(policy.admit(key(n)) for n in range(100)) and policy.refused == 0


def test_reused_admits_a_chunk_on_its_second_offer_only():
    policy = Reused(1024)
    assert not policy.admit(key(1))
    assert policy.admit(key(1))
    assert not policy.admit(key(1))  # admitted: the next offer starts again
    assert policy.refused == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=200), st.sampled_from([1, 2, 8, 64]))
def test_reused_is_its_model(offers, slots):
    policy = Reused(slots)
    model: dict[int, bytes] = {}
    refused = 0
    for number in offers:
        chunk = key(number)
        slot = int.from_bytes(chunk[8:16], "little") % slots
        admitted = model.get(slot) == chunk[:8]
        if admitted:
            del model[slot]
        else:
            model[slot] = chunk[:8]
            refused += 1
        assert policy.admit(chunk) == admitted
    assert policy.refused == refused


def test_the_flag_picks_the_policy_and_sizes_its_memory():
    assert Config().disk_admission == "write-all"
    assert isinstance(admission_policy("write-all", 1 << 30), WriteAll)
    small = admission_policy("reused", 1 << 20)
    large = admission_policy("reused", 1 << 50)
    assert isinstance(small, Reused) and isinstance(large, Reused)
    assert small._fingerprints.size == MIN_SLOTS and large._fingerprints.size == MAX_SLOTS
    middle = admission_policy("reused", 3 << 30)
    assert isinstance(middle, Reused) and middle._fingerprints.size == 1 << 19  # 393,216 up
    with pytest.raises(ValueError, match="unknown disk admission policy"):
        admission_policy("lfu", 1 << 30)
    with pytest.raises(ValueError, match="power of two"):
        Reused(3)
