"""ParallelStrategy: where a worker sits in vLLM's TP × PP layout, and which KV shard it owns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelStrategy:
    """The parallel layout of one engine worker, in one place; every worker builds its own.

    vLLM numbers ranks rank = pp_rank * tp_size + tp_rank: a TP group is contiguous and
    its leader is the rank with rank % tp_size == 0.

    Without MLA every rank holds its own shard of the KV cache, so each rank stores and
    retrieves its own chunks: kv_world_size = world_size, kv_worker_id = rank. With MLA
    the latent cache is identical on every rank of a TP group (and so are its block
    ids), so a TP group is one shard: kv_world_size = pp_size, kv_worker_id =
    rank // tp_size, and only the TP leader sends STORE and RETRIEVE; the server writes
    retrieved chunks into every registered rank of the group.

    Raises ValueError at construction when the numbers contradict each other.
    """

    use_mla: bool
    world_size: int
    worker_id: int  # the real rank, 0 .. world_size - 1
    tp_size: int
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.use_mla, bool):
            raise ValueError(f"use_mla must be a bool, got {self.use_mla!r}")
        for name in ("world_size", "worker_id", "tp_size", "pp_size"):
            value = getattr(self, name)
            # bool is an int subclass; True as a size is always a caller's mistake.
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an int, got {value!r}")
        for name in ("world_size", "tp_size", "pp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.world_size != self.tp_size * self.pp_size:
            raise ValueError(f"world_size {self.world_size} must equal tp_size {self.tp_size} "
                             f"× pp_size {self.pp_size} = {self.tp_size * self.pp_size}")
        if not 0 <= self.worker_id < self.world_size:
            raise ValueError(f"worker_id {self.worker_id} is not a rank of a world of "
                             f"{self.world_size} (0 .. {self.world_size - 1})")

    @property
    def tp_rank(self) -> int:
        return self.worker_id % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.worker_id // self.tp_size

    @property
    def is_tp_leader(self) -> bool:
        return self.tp_rank == 0

    @property
    def kv_world_size(self) -> int:
        """How many KV shards a chunk is split into: the server keys each shard apart."""
        return self.pp_size if self.use_mla else self.world_size

    @property
    def kv_worker_id(self) -> int:
        """Which of the kv_world_size shards this worker's KV cache is."""
        return self.pp_rank if self.use_mla else self.worker_id

    @property
    def sends_transfers(self) -> bool:
        """Whether this worker sends STORE and RETRIEVE (with MLA, only TP leaders do)."""
        return self.is_tp_leader or not self.use_mla
