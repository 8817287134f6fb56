"""A worker's transfers over every KV cache group: one WorkerAdapter (one registration) a group."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ...client.cache_client import Registration
from ...client.worker import WorkerAdapter
from ...protocol import SKIP_BLOCK, TransferItem, unpack_block_ids

if TYPE_CHECKING:
    from .metadata import GroupStores


class GroupAdapters:
    """The WorkerAdapters of one rank's KV cache groups (groups.py), in vLLM's group order,
    behind the calls of one: a STORE or load of a request carries an item per group, and
    is reported once every group's has been.

    With one group, failed loads are blocks, as vLLM takes them (load_errors). With several,
    vLLM 0.33 takes them only as requests (block ids are unique within a group only): a
    request whose load failed in any group is in `failed`, reported with its load.
    """

    def __init__(self, adapters: list[WorkerAdapter]):
        self.adapters = adapters
        self._stores: dict[str, set[int]] = {}  # request -> groups whose STOREs are open
        self._loads: dict[str, set[int]] = {}  # request -> groups whose loads are open
        # several groups: request -> per group, the blocks its open load writes
        self._load_blocks: dict[str, list[set[int]]] = {}
        self._failed: set[str] = set()  # several groups: loads that failed, not reported yet
        self._load_errors: set[int] = set()  # one group: failed blocks, not reported yet

    @property
    def grouped(self) -> bool:
        return len(self.adapters) > 1

    @property
    def registrations(self) -> list[Registration | None]:
        return [adapter.registration for adapter in self.adapters]

    def start_store(self, stores: list[GroupStores]) -> None:
        """One STORE per group, each of its items of every request (none for a group with
        no item: a request is reported once every group it stores in has been)."""
        for group, adapter in enumerate(self.adapters):
            adapter.start_store([item for store in stores for item in store.groups[group]])
        for store in stores:  # with those of its STOREs still open
            self._stores.setdefault(store.request_id, set()).update(
                group for group, items in enumerate(store.groups) if items)

    def start_load(self, loads: list[tuple[TransferItem, ...]], by_layer: bool = False) -> None:
        """One RETRIEVE per group (written layer by layer only with one group: with several
        every load is async)."""
        for group, adapter in enumerate(self.adapters):
            adapter.start_load([items[group] for items in loads], by_layer and not self.grouped)
        for items in loads:
            request_id = items[0].request_id
            self._loads[request_id] = set(range(len(self.adapters)))
            if self.grouped:
                self._load_blocks[request_id] = [
                    {b for b in unpack_block_ids(item.block_ids, "block_ids") if b != SKIP_BLOCK}
                    for item in items]

    def fail(self, request_id: str, block_ids: Iterable[int]) -> None:
        """Blocks of a request's load that no chunk fills: load errors (one group), or the
        request's load failed (several)."""
        block_ids = list(block_ids)
        if block_ids and self.grouped:
            self._failed.add(request_id)
        else:
            self._load_errors.update(block_ids)

    def wait_for_stores(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        for adapter in self.adapters:
            adapter.wait_for_stores(request_ids)

    def wait_for_loads(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        for adapter in self.adapters:
            adapter.wait_for_loads(request_ids)

    def wait_for_layer(self, request_ids: Iterable[str], layer: int) -> None:
        """Layer by layer: one group only (start_load)."""
        self.adapters[0].wait_for_layer(request_ids, layer)

    def discard_loads(self, request_ids: Iterable[str]) -> None:
        request_ids = list(request_ids)
        for adapter in self.adapters:
            adapter.discard_loads(request_ids)

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(requests whose STOREs every group has read, requests whose loads every group has
        ended) since the last call; see WorkerAdapter.get_finished."""
        stores: set[str] = set()
        loads: set[str] = set()
        for group, adapter in enumerate(self.adapters):
            group_stores, group_loads = adapter.get_finished()
            errors = adapter.get_block_ids_with_load_errors()
            if not self.grouped:
                self._load_errors |= errors
            stores |= self._ended(self._stores, group_stores, group)
            for request_id in group_loads:
                blocks = self._load_blocks.get(request_id)
                if blocks is not None and not errors.isdisjoint(blocks[group]):
                    self._failed.add(request_id)
            loads |= self._ended(self._loads, group_loads, group)
        for request_id in loads:
            self._load_blocks.pop(request_id, None)
        return stores, loads

    @staticmethod
    def _ended(open_groups: dict[str, set[int]], reported: set[str], group: int) -> set[str]:
        """Of the requests one group reported, those no other group has open any more."""
        ended = set()
        for request_id in reported:
            groups = open_groups.get(request_id)
            if groups is not None:
                groups.discard(group)
                if groups:
                    continue
                del open_groups[request_id]
            ended.add(request_id)
        return ended

    def take_failed(self, request_ids: set[str]) -> set[str]:
        """Of these requests whose loads are reported now, those whose load failed."""
        failed = self._failed & request_ids
        self._failed -= failed
        return failed

    def load_errors(self) -> set[int]:
        """One group: blocks of failed loads since the last call."""
        errors, self._load_errors = self._load_errors, set()
        return errors
