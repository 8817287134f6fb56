"""What the scheduler tells the workers each step: StepMetadata and its LoadSpecs."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...protocol import TransferItem

# -- what the scheduler tells the workers ----------------------------------------------------

@dataclass(frozen=True)
class LoadSpec:
    """One request's load: workers copy the chunks of `items` (one per KV cache group, in
    vLLM's group order) into its blocks and report the request in finished_recving when
    they have landed. With no items nothing is read: the request is reported at once (vLLM
    still waits for it). `failed_block_ids` are blocks vLLM expects filled that no chunk
    covers: workers report them as load errors (with several groups, the request as a
    failed load). A `sync` load feeds this step's forward pass: workers wait for it before
    the pass and never report it in finished_recving (vLLM scheduled the request in this
    step, waiting for nothing)."""

    request_id: str
    items: tuple[TransferItem, ...] = ()
    failed_block_ids: tuple[int, ...] = ()
    sync: bool = False


@dataclass(frozen=True)
class GroupStores:
    """One request's STORE in a step: per KV cache group, in vLLM's group order, its
    items. An attention group's is one item; a recurrent group's, one per state chunk
    stored, each the root of a prefix of its own (no parent_hash: a state is a snapshot
    of the prefix at its chunk's end, stored whether or not the one before it is), and
    none where no state is stored."""

    request_id: str
    groups: tuple[tuple[TransferItem, ...], ...]


@dataclass
class StepMetadata(KVConnectorMetadata):
    """Built by the scheduler once per step (build_connector_meta), read by every worker."""

    loads: list[LoadSpec] = field(default_factory=list)  # start in start_load_kv
    # start in wait_for_save: one per request
    stores: list[GroupStores] = field(default_factory=list)
    # finished requests whose blocks vLLM frees only once every worker has reported them
    # in finished_sending, after their stores were read
    await_stores: list[str] = field(default_factory=list)
    # requests preempted this step: their blocks may be reused by this step's forward pass
    preempted: list[str] = field(default_factory=list)
    # requests whose STOREs read window blocks (sliding-window, chunked-local groups) that
    # vLLM freed while they ran and gives to a request in this step: this step's forward
    # pass must not write them before those STOREs are read
    fence: list[str] = field(default_factory=list)
