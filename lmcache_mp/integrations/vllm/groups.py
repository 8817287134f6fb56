"""vLLM's KV cache groups (its hybrid KV cache manager): which blocks of each group a chunk holds.

vLLM's hybrid KV cache manager (HMA) splits a hybrid model's layers into KV cache groups
of equal size, each with its own block table: full attention keeps every block of a
request, sliding-window attention only those of its window (vLLM frees the older ones
while the request runs and puts its null block, id 0, in their place), chunked-local
attention only those of the current attention chunk. Each group is registered with the
server apart, as a kv worker of its own (GroupShard), under the engine's one model name,
which lists every group (model_name): one LOOKUP then finds a chunk only when every group
of every rank holds it (a recurrent group: see below), and holds them all until each
group's RETRIEVE.

A chunk of a window group stores, of its blocks, those that a later hit can need (KVGroup
.kept_blocks): a hit ends at a chunk boundary, where vLLM keeps of that group only the
blocks of the tokens the next one attends to; the chunk's other positions are filled with
the null block (the server stores whole chunks: their bytes are never loaded). A load
writes only the blocks vLLM keeps for the hit point (the rest are its null block).

A recurrent group (vLLM's MambaSpec in mamba_cache_mode "align": Mamba, Gated DeltaNet,
linear attention) keeps one block per position, the state after that block's last token,
and only at the positions where a step ended. It registers with the server's "state"
layout, one block per chunk: a chunk stores the block at its last position (the state at
its end) where vLLM keeps one, as a root of its own (a snapshot of the prefix there,
stored whether or not the states before it are), while the attention groups store every
chunk. Its kv workers are a LOOKUP's snapshot_workers: a hit ends at a chunk boundary
whose state is stored, and a load writes the state at the hit point alone.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...client.parallel import ParallelStrategy
from ...client.tracker import ChunkLayout, RetrieveSpec, StoreSpec
from ...protocol import SKIP_BLOCK, TransferItem

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

NULL_BLOCK = 0  # vLLM's null block: a window group's block table holds it where it keeps no KV


class GroupKind(enum.Enum):
    """How a group's attention reads the tokens before the one it computes."""

    FULL = "full"  # every token: every block is kept
    SLIDING = "sw"  # the last `window` tokens
    CHUNKED = "local"  # the tokens of the current attention chunk of `window` tokens
    STATE = "state"  # none: a recurrent state of `window` bytes sums up every token before


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups, as the connector serves it."""

    index: int
    kind: GroupKind
    layer_names: tuple[str, ...]  # empty: every layer (an engine without a KVCacheConfig)
    # SLIDING: vLLM's sliding_window and extra_retained_tokens (tokens it keeps for spec
    # decoding); CHUNKED: attention_chunk_size; STATE: the state's bytes in a block (each
    # layer's); FULL: 0
    window: int = 0

    @property
    def layout(self) -> str | None:
        """The server layout the group registers with, when it is not the attention one."""
        return "state" if self.kind is GroupKind.STATE else None

    def first_needed_token(self, end: int) -> int:
        """The first token whose KV a hit ending at chunk boundary `end` (or later) may need
        in this group: vLLM keeps, for a request with `computed` tokens, those from
        get_num_skipped_tokens(computed) on, and a hit of a whole prompt computes end - 1."""
        if self.kind is GroupKind.SLIDING:
            return max(0, end - self.window)
        if self.kind is GroupKind.CHUNKED:
            return (end - 1) // self.window * self.window if end else 0
        return 0

    def kept_blocks(self, chunk_index: int, layout: ChunkLayout) -> list[bool]:
        """Per block of the chunk, whether a later hit can need it (every block, under full
        attention). A hit at a later boundary needs no earlier token than one at this
        chunk's end (first_needed_token grows with `end`), so these cover every hit."""
        start = chunk_index * layout.chunk_size
        first = self.first_needed_token(start + layout.chunk_size)
        return [start + (j + 1) * layout.block_size > first
                for j in range(layout.blocks_per_chunk)]

    def describe(self) -> str:
        """The group in the model name: its kind, window and number of layers."""
        window = f"{self.window}" if self.kind is not GroupKind.FULL else ""
        return f"{self.kind.value}{window}:{len(self.layer_names)}"


def kv_groups(kv_cache_config: KVCacheConfig | None, block_size: int, use_mla: bool,
              chunk_size: int) -> tuple[KVGroup, ...]:
    """The engine's KV cache groups, from the KVCacheConfig vLLM gives the connector (both
    roles get the same); one full-attention group without one. Raises ValueError at
    start-up, naming the group, for a group the connector cannot serve (cross attention,
    sinks, ..., a recurrent state it cannot restore: _check_state), and for several
    groups under MLA."""
    if kv_cache_config is None or not kv_cache_config.kv_cache_groups:
        return (KVGroup(0, GroupKind.FULL, ()),)
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        names = tuple(group.layer_names)
        kind, window = _kind_of(spec)
        shown = (f"{type(spec).__name__}: layers "
                 + ", ".join(names[:4]) + (", ..." if len(names) > 4 else ""))
        if kind is None:
            raise ValueError(
                f"lmcache-mp cannot serve vLLM's KV cache group {index} ({shown}): it stores "
                f"and loads the KV of full, sliding-window and chunked-local attention and "
                f"the state of Mamba and linear-attention layers only. Serve this model "
                f"without the lmcache-mp connector")
        if kind is GroupKind.STATE:
            _check_state(spec, f"vLLM's KV cache group {index} ({shown})", use_mla, chunk_size,
                         kv_cache_config.cache_hit_alignment_tokens)
        if getattr(spec, "block_size", block_size) != block_size:
            raise ValueError(f"vLLM's KV cache group {index} has blocks of {spec.block_size} "
                             f"tokens, not vLLM's --block-size {block_size}: lmcache-mp needs "
                             f"one block size for every group")
        groups.append(KVGroup(index, kind, names, window))
    if use_mla and len(groups) > 1:
        raise ValueError(f"lmcache-mp serves MLA models with one KV cache group; this one has "
                         f"{len(groups)}: start vLLM with --disable-hybrid-kv-cache-manager")
    if all(group.kind is GroupKind.STATE for group in groups):
        # vLLM takes a failed load of one group as blocks to recompute, which a state is not
        raise ValueError("lmcache-mp cannot save and restore the recurrent state of a model "
                         "without attention layers (every KV cache group is MambaSpec)")
    return tuple(groups)


def _check_state(spec, group: str, use_mla: bool, chunk_size: int,
                 hit_alignment: int | None) -> None:
    """Refuses, naming the case, a recurrent group whose state at a chunk boundary vLLM
    cannot give or take: only "align" mode keeps a state per block position (prefix
    caching); speculative blocks, and prefill checkpoints at hits finer than a block
    (partial hash hits), hold states off those positions."""
    cases = [
        (spec.mamba_cache_mode != "align", f"mamba_cache_mode is "
         f"{spec.mamba_cache_mode!r}, not \"align\" (start vLLM with prefix caching on)"),
        (spec.num_speculative_blocks > 0, f"num_speculative_blocks is "
         f"{spec.num_speculative_blocks} (speculative decoding keeps states past the boundary)"),
        (hit_alignment is not None and hit_alignment < spec.block_size,
         f"prefix-cache hits land every {hit_alignment} tokens, within its blocks of "
         f"{spec.block_size} (its checkpoints keep states off block positions)"),
        (use_mla, "the model uses MLA beside it"),
        (chunk_size % spec.block_size != 0, f"its block size {spec.block_size} does not "
         f"divide lmcache-mp's chunk_size {chunk_size}"),
    ]
    for refused, why in cases:
        if refused:
            raise ValueError(f"lmcache-mp cannot save and restore the recurrent state of "
                             f"{group}: {why}")


def _kind_of(spec) -> tuple[GroupKind | None, int]:
    # Exact types: subclasses (sinks, ring buffers, hidden states, ...) keep other blocks.
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )
    if type(spec) in (FullAttentionSpec, MLAAttentionSpec):
        return GroupKind.FULL, 0
    if type(spec) in (SlidingWindowSpec, SlidingWindowMLASpec):
        return GroupKind.SLIDING, spec.sliding_window + getattr(spec, "extra_retained_tokens", 0)
    if type(spec) is ChunkedLocalAttentionSpec:
        return GroupKind.CHUNKED, spec.attention_chunk_size
    if type(spec) is MambaSpec:
        return GroupKind.STATE, spec.state_content_size_bytes
    return None, 0


def groups_suffix(groups: Sequence[KVGroup]) -> str:
    """What the model name adds for a hybrid engine (nothing for one full-attention group,
    so that such engines keep their keys): every group, in vLLM's order."""
    if len(groups) == 1 and groups[0].kind is GroupKind.FULL:
        return ""
    return "-groups[" + ",".join(group.describe() for group in groups) + "]"


@dataclass(frozen=True)
class GroupShard(ParallelStrategy):
    """The ParallelStrategy of one group's registration on one rank: each group of each
    kv worker is a kv worker of its own to the server, so that one LOOKUP (kv_world_size
    of them) counts a chunk only where every group holds it (a recurrent group's kv
    workers: at the hit's last chunk only, snapshot_workers)."""

    group: int = 0
    num_groups: int = 1

    @property
    def kv_world_size(self) -> int:
        return super().kv_world_size * self.num_groups

    @property
    def kv_worker_id(self) -> int:
        return self.group * super().kv_world_size + super().kv_worker_id


def sharded(parallel: ParallelStrategy, group: int, num_groups: int) -> GroupShard:
    return GroupShard(parallel.use_mla, parallel.world_size, parallel.worker_id,
                      parallel.tp_size, parallel.pp_size, group, num_groups)


def snapshot_workers(parallel: ParallelStrategy, groups: Sequence[KVGroup]) -> tuple[int, ...]:
    """The kv workers (GroupShard's ids) of the recurrent groups' registrations on every
    rank: their chunks are states, each a snapshot of the prefix at its chunk's end (a
    LOOKUP's snapshot_workers)."""
    per_group = parallel.kv_world_size
    return tuple(group.index * per_group + worker for group in groups
                 if group.kind is GroupKind.STATE for worker in range(per_group))


def store_items(spec: StoreSpec, groups: Sequence[KVGroup], block_ids: Sequence[Sequence[int]],
                layout: ChunkLayout, current: Sequence[Sequence[int]] | None = None
                ) -> tuple[int, tuple[tuple[TransferItem, ...], ...]]:
    """The STORE items of `spec` (planned on group 0's blocks), per group (GroupStores),
    and how many of its leading chunks they carry: they end before the first chunk one of
    whose blocks a later hit needs is no longer in a window group's table (vLLM's null
    block in `block_ids`, or another block in `current`, vLLM's table now, where the
    scheduler can read it). A recurrent group stores the state at the end of each of those
    chunks where vLLM keeps one, an item of its own per state."""
    rows: list[list[int]] = [[] for _ in groups]
    states: list[list[TransferItem]] = [[] for _ in groups]
    storable = 0
    for offset, chunk_hash in enumerate(spec.chunk_hashes):
        chunk = spec.first_chunk_index + offset
        chunk_rows = [_stored_row(group, chunk, block_ids[group.index], layout,
                                  None if current is None else current[group.index])
                      for group in groups]
        if any(row is None and group.kind is not GroupKind.STATE
               for group, row in zip(groups, chunk_rows)):
            break
        for group, row, group_rows, group_states in zip(groups, chunk_rows, rows, states):
            if group.kind is not GroupKind.STATE:
                group_rows.extend(row or ())
            elif row is not None:  # a root: no parent_hash
                group_states.append(TransferItem.build(spec.request_id, [chunk_hash], row,
                                                       spec.cache_salt))
        storable += 1
    hashes = list(spec.chunk_hashes[:storable])
    return storable, tuple(
        tuple(group_states) if group.kind is GroupKind.STATE
        else (TransferItem.build(spec.request_id, hashes, group_rows, spec.cache_salt,
                                 spec.parent_hash),)
        for group, group_rows, group_states in zip(groups, rows, states))


def _stored_row(group: KVGroup, chunk: int, ids: Sequence[int], layout: ChunkLayout,
                current: Sequence[int] | None) -> list[int] | None:
    """One group's block ids for one chunk's STORE; None when a needed block is gone."""
    first = chunk * layout.blocks_per_chunk
    row = list(ids[first:first + layout.blocks_per_chunk])
    if group.kind is GroupKind.FULL:
        return row
    if group.kind is GroupKind.STATE:
        # the state at the chunk's end, if a step ended there and vLLM still holds it
        last = first + layout.blocks_per_chunk - 1
        state = ids[last] if last < len(ids) else NULL_BLOCK
        if state == NULL_BLOCK or (current is not None and (
                last >= len(current) or current[last] != state)):
            return None
        return [state]
    for j, kept in enumerate(group.kept_blocks(chunk, layout)):
        if not kept:
            row[j] = NULL_BLOCK  # bytes no hit reads: the null block fills the chunk
        elif row[j] == NULL_BLOCK or (current is not None and (
                first + j >= len(current) or current[first + j] != row[j])):
            return None
    return row


def retrieve_items(spec: RetrieveSpec, groups: Sequence[KVGroup],
                   block_ids: Sequence[Sequence[int]], layout: ChunkLayout
                   ) -> tuple[TransferItem, ...]:
    """The RETRIEVE items of `spec` (planned on group 0's blocks), one per group: each
    writes the blocks vLLM allocated for the hit, skipping those the engine holds already
    and, in window groups, those vLLM keeps no KV in (its null block); a state group's
    names the hit's last chunk alone and writes the state at its end (state_target)."""
    start = spec.first_chunk_index * layout.blocks_per_chunk
    count = len(spec.block_ids)
    items = []
    for group in groups:
        if group.kind is GroupKind.STATE:
            last = list(spec.chunk_hashes[-1:])
            targets = [state_target(spec, block_ids[group.index], layout)] if last else []
            items.append(TransferItem.build(spec.request_id, last, targets, spec.cache_salt))
            continue
        ids = block_ids[group.index][start:start + count]
        targets = [SKIP_BLOCK] * spec.skip_leading_blocks
        targets += [block if group.kind is GroupKind.FULL or block != NULL_BLOCK
                    else SKIP_BLOCK for block in ids[spec.skip_leading_blocks:]]
        targets += [SKIP_BLOCK] * spec.skip_trailing_blocks
        items.append(TransferItem.build(spec.request_id, list(spec.chunk_hashes), targets,
                                        spec.cache_salt))
    return tuple(items)


def state_target(spec: RetrieveSpec, ids: Sequence[int], layout: ChunkLayout) -> int:
    """Where a state group's RETRIEVE writes the state at the hit point (the end of the
    last chunk of `spec`): the block vLLM allocated for it, or SKIP_BLOCK when it gave
    none (missing_state: the load must fail)."""
    end = (spec.first_chunk_index + len(spec.chunk_hashes)) * layout.blocks_per_chunk
    state = ids[end - 1] if 0 < end <= len(ids) else NULL_BLOCK
    if not spec.chunk_hashes or state == NULL_BLOCK or spec.skip_trailing_blocks:
        return SKIP_BLOCK
    return state


def missing_state(spec: RetrieveSpec, groups: Sequence[KVGroup],
                  block_ids: Sequence[Sequence[int]], layout: ChunkLayout) -> bool:
    """Whether a recurrent group has no block for the state at the hit point: then the
    attention KV alone would be loaded without its state, and the load must fail."""
    return any(group.kind is GroupKind.STATE and spec.chunk_hashes
               and state_target(spec, block_ids[group.index], layout) == SKIP_BLOCK
               for group in groups)
