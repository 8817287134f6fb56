"""ParallelStrategy: vLLM's rank layout mapped to KV shards, with and without MLA."""

import pytest

from lmcache_mp.client.parallel import ParallelStrategy


def layout(use_mla: bool, tp_size: int, pp_size: int = 1) -> list[ParallelStrategy]:
    world_size = tp_size * pp_size
    return [ParallelStrategy(use_mla, world_size, rank, tp_size, pp_size)
            for rank in range(world_size)]


def test_without_mla_every_rank_is_its_own_shard():
    ranks = layout(use_mla=False, tp_size=2)
    assert [r.kv_world_size for r in ranks] == [2, 2]
    assert [r.kv_worker_id for r in ranks] == [0, 1]
    assert [r.tp_rank for r in ranks] == [0, 1]
    assert [r.is_tp_leader for r in ranks] == [True, False]
    assert [r.sends_transfers for r in ranks] == [True, True]


def test_with_mla_a_tp_group_is_one_shard_and_only_its_leader_sends():
    ranks = layout(use_mla=True, tp_size=2)
    assert [r.kv_world_size for r in ranks] == [1, 1]
    assert [r.kv_worker_id for r in ranks] == [0, 0]
    assert [r.is_tp_leader for r in ranks] == [True, False]
    assert [r.sends_transfers for r in ranks] == [True, False]


def test_with_mla_tp2_pp2_each_pipeline_stage_is_a_shard():
    ranks = layout(use_mla=True, tp_size=2, pp_size=2)
    assert [r.kv_world_size for r in ranks] == [2, 2, 2, 2]
    assert [r.kv_worker_id for r in ranks] == [0, 0, 1, 1]
    assert [r.worker_id for r in ranks if r.is_tp_leader] == [0, 2]
    assert [(r.pp_rank, r.tp_rank) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [r.sends_transfers for r in ranks] == [True, False, True, False]


def test_without_mla_tp2_pp2_every_rank_is_a_shard():
    ranks = layout(use_mla=False, tp_size=2, pp_size=2)
    assert [(r.kv_world_size, r.kv_worker_id) for r in ranks] == [(4, 0), (4, 1), (4, 2), (4, 3)]
    assert [r.worker_id for r in ranks if r.is_tp_leader] == [0, 2]


def test_a_single_worker_is_its_own_leader_and_shard():
    (only,) = layout(use_mla=True, tp_size=1)
    assert (only.kv_world_size, only.kv_worker_id, only.is_tp_leader) == (1, 0, True)


def test_frozen():
    strategy = ParallelStrategy(False, 2, 0, 2)
    with pytest.raises(AttributeError):
        strategy.worker_id = 1  # type: ignore[misc]  # read-only: the refusal under test


@pytest.mark.parametrize("kwargs, message", [
    (dict(use_mla=False, world_size=4, worker_id=0, tp_size=2, pp_size=1),
     r"world_size 4 must equal tp_size 2 × pp_size 1 = 2"),
    (dict(use_mla=True, world_size=2, worker_id=2, tp_size=2),
     r"worker_id 2 is not a rank of a world of 2 \(0 .. 1\)"),
    (dict(use_mla=True, world_size=2, worker_id=-1, tp_size=2),
     r"worker_id -1 is not a rank"),
    (dict(use_mla=False, world_size=0, worker_id=0, tp_size=0),
     r"world_size must be at least 1, got 0"),
    (dict(use_mla=False, world_size=2, worker_id=0, tp_size=2, pp_size=0),
     r"pp_size must be at least 1, got 0"),
    (dict(use_mla=False, world_size=2, worker_id=0, tp_size=2.0),
     r"tp_size must be an int, got 2.0"),
    (dict(use_mla=False, world_size=True, worker_id=0, tp_size=1),
     r"world_size must be an int, got True"),
    (dict(use_mla="yes", world_size=1, worker_id=0, tp_size=1),
     r"use_mla must be a bool"),
])
def test_inconsistent_layouts_are_refused_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelStrategy(**kwargs)
