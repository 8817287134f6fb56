"""Disk admission policies (server/lower/admission.py) against a simple model: a dict from
slot to the fingerprint last offered there; the write budget by the bytes it lets through
on an injected clock, and through a real server flooded past it."""

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_mp.server.config import Config
from lmcache_mp.server.lower.admission import (
    MAX_SLOTS,
    MIN_SLOTS,
    Reused,
    WriteAll,
    WriteBudget,
    admission_policy,
)

from ...utils import wait_for
from .test_disk_tier import CHUNK_BYTES, PROMPT_CHUNKS, disk_server, stats, store
from .test_disk_tier import prompt as disk_prompt


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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("offered_per_second", [1, 10, 100])
def test_a_flood_gets_the_budget_and_no_more_whatever_its_rate(offered_per_second):
    """Two hours of 1 MiB chunks offered at 10 to 1,000 times the budget (360 MiB an hour):
    the bytes let through are the budget's, within a minute's and one chunk."""
    clock, chunk, hours = Clock(), 1 << 20, 2
    budget = WriteBudget(360 * chunk, clock)
    taken = 0
    for _ in range(hours * 3600 * offered_per_second):
        clock.now += 1 / offered_per_second
        taken += chunk * budget.take(chunk, continues=True)
    assert hours * 360 * chunk - chunk <= taken <= hours * 360 * chunk + 6 * chunk + chunk


def test_below_half_full_only_chunks_that_continue_the_disk_are_written():
    clock = Clock()
    budget = WriteBudget(3600 * 100, clock)  # 100 bytes a second; a minute: 6000
    assert [budget.take(1000, continues=False) for _ in range(4)] == [True] * 3 + [False]
    assert [budget.take(1000, continues=True) for _ in range(4)] == [True] * 3 + [False]
    clock.now += 10  # 1000 bytes back: a continuing chunk, not another
    assert not budget.take(1000, continues=False) and budget.take(1000, continues=True)
    assert WriteBudget(None, clock).take(1 << 40, continues=False)
    with pytest.raises(ValueError, match="positive"):
        WriteBudget(0)


def test_the_budget_flag_needs_the_disk_tier():
    assert Config().disk_write_budget is None
    config = Config.from_args(["--disk-dir", "d", "--disk-size", "1GiB",
                               "--disk-write-budget", "320GiB"], env={})
    assert config.disk_write_budget == 320 << 30
    with pytest.raises(SystemExit):
        Config.from_args(["--disk-write-budget", "1GiB"], env={})


def test_a_server_flooded_past_its_write_budget_writes_the_budget_and_counts_the_rest(
        tmp_path):
    # 1 MiB an hour: the bucket holds 17,476 bytes, and a 512 KiB chunk takes it far below
    # empty (29 minutes of budget): of six prompts of 4 chunks, the first chunk is written,
    # the 23 others are over the budget.
    with disk_server(tmp_path / "disk", "--disk-write-budget", "1MiB") as server:
        for tag in range(6):
            store(server, disk_prompt(tag=4800 + tag, num_chunks=PROMPT_CHUNKS), 90 + tag)
        done = wait_for(lambda: (s := stats(server)).disk_queue_chunks == 0 and s,
                        "the disk tier's queue")
        assert done.disk_chunks_written == 1 and done.disk_bytes_written == CHUNK_BYTES
        assert done.disk_over_budget == 6 * PROMPT_CHUNKS - 1 and done.disk_dropped == 0


def test_l2_takes_the_same_policies_by_its_own_flag():
    assert Config().l2_admission == "write-all"
    assert Config.from_args(["--l2-admission", "reused"]).l2_admission == "reused"
    with pytest.raises(ValueError, match="unknown L2 admission policy"):
        admission_policy("lfu", 1 << 30, tier="L2")
