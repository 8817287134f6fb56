"""The worker side's one record per request (RequestTransfers): the states each sequence of
vLLM's worker hooks leads a request's load and stores to, what vLLM hears back, and what
goes to the server. A scripted WorkerAdapter plays the server (it answers, it is slow, a
load's deadline passes, it is gone) on a worker connector registered with a real one."""

import enum
from dataclasses import dataclass, field

import pytest
import torch

# First: test_vllm imports vLLM for the CPU, its import-time warnings silenced.
from .test_vllm import (  # isort: skip
    BLOCK, LAYERS, FullAttentionSpec, hand_config, kv_cache_config, read_layers,
    worker_connector,
)
from lmcache_mp.client import TransferItem
from lmcache_mp.integrations.vllm import LoadSpec, StepMetadata
from lmcache_mp.integrations.vllm.adapters import GroupAdapters
from lmcache_mp.integrations.vllm.metadata import GroupStores
from lmcache_mp.integrations.vllm.transfers import LoadState, RequestTransfers, StoreState
from lmcache_mp.protocol import CHUNK_HASH_BYTES, unpack_block_ids

NONE, SYNC_SENT, SYNC, ASYNC, LANDED = (LoadState.NONE, LoadState.SYNC_SENT, LoadState.SYNC,
                                        LoadState.ASYNC, LoadState.LANDED)
IDLE, STORING, FREEING, READ = (StoreState.NONE, StoreState.STORING, StoreState.FREEING,
                                StoreState.READ)

# -- the record alone ------------------------------------------------------------------------

EVENTS = {
    "async sent": lambda r: r.load_sent(sync=False),
    "sync sent": lambda r: r.load_sent(sync=True),
    "nothing to load": RequestTransfers.nothing_to_load,
    "read by the pass": RequestTransfers.read_by_pass,
    "load ended": RequestTransfers.load_ended,
    "store sent": RequestTransfers.store_sent,
    "finished": RequestTransfers.request_finished,
    "stores read": RequestTransfers.stores_read,
    "reported": RequestTransfers.reported,
}

RECORD_ROWS = [
    (["async sent"], ASYNC, IDLE),
    (["async sent", "load ended"], LANDED, IDLE),
    (["async sent", "load ended", "reported"], NONE, IDLE),
    (["nothing to load"], LANDED, IDLE),
    (["sync sent"], SYNC_SENT, IDLE),
    (["sync sent", "read by the pass"], SYNC, IDLE),
    (["sync sent", "read by the pass", "load ended"], NONE, IDLE),  # never reported
    (["store sent"], NONE, STORING),
    (["store sent", "stores read"], NONE, IDLE),
    (["store sent", "finished"], NONE, FREEING),
    (["store sent", "finished", "store sent"], NONE, FREEING),
    (["store sent", "finished", "stores read"], NONE, READ),
    (["store sent", "finished", "stores read", "reported"], NONE, IDLE),
    (["finished"], NONE, READ),  # no STORE open: reported at once
    (["store sent", "sync sent", "read by the pass"], SYNC, STORING),
]


@pytest.mark.parametrize("events,load,stores", RECORD_ROWS,
                         ids=[" > ".join(events) for events, _, _ in RECORD_ROWS])
def test_each_transition_moves_the_record_as_the_table_says(events, load, stores):
    record = RequestTransfers("r")
    for event in events:
        EVENTS[event](record)
    assert (record.load, record.stores) == (load, stores)
    assert record.idle == (load is NONE and stores is IDLE)


# -- vLLM's hooks, against a scripted server ----------------------------------------------------

class Server(enum.Enum):
    """What the server does with this step's transfers (ScriptedAdapter.server)."""

    ANSWERS = "answers"  # every open transfer is answered by the next wait or get_finished
    SLOW = "slow"  # answers what a hook waits for; the rest stay open
    TIMES_OUT = "times out"  # answers nothing: by the next wait or get_finished the deadline
    # has passed, so a load ends failed (its blocks are load errors) and a store ends
    GONE = "gone"  # the connection dropped: every transfer ends at once, loads failed


class ScriptedAdapter:
    """The WorkerAdapter's contract without a server: `server` decides when each transfer
    ends and whether a load lands; `sent` lists each RETRIEVE and STORE asked for."""

    def __init__(self, registration):
        self.registration = registration
        self.server = Server.ANSWERS
        self.sent: list[tuple[str, list[str]]] = []
        self.stores_waited: list[str] = []
        self.loads_waited: list[str] = []
        self.layers_waited: list[int] = []
        self._load_blocks: dict[str, list[int]] = {}  # each request's last load
        self._open_loads: set[str] = set()
        self._open_stores: set[str] = set()
        self._ended_loads: dict[str, bool] = {}  # since get_finished: whether each landed
        self._ended_stores: set[str] = set()
        self._errors: set[int] = set()

    def start_load(self, items: list[TransferItem], by_layer: bool = False) -> None:
        self.sent.append(("RETRIEVE", [item.request_id for item in items]))
        for item in items:
            self._load_blocks[item.request_id] = unpack_block_ids(item.block_ids, "block_ids")
            self._open_loads.add(item.request_id)

    def start_store(self, items: list[TransferItem]) -> None:
        self.sent.append(("STORE", [item.request_id for item in items]))
        self._open_stores.update(item.request_id for item in items)

    def wait_for_stores(self, request_ids) -> None:
        for request_id in request_ids:  # answered, gone or past the deadline: it ends
            self.stores_waited.append(request_id)
            if request_id in self._open_stores:
                self._open_stores.discard(request_id)
                self._ended_stores.add(request_id)

    def wait_for_loads(self, request_ids) -> None:
        for request_id in request_ids:
            self.loads_waited.append(request_id)
            self._end_load(request_id)

    def wait_for_layer(self, request_ids, layer: int) -> None:
        self.layers_waited.append(layer)

    def discard_loads(self, request_ids) -> None:
        """These (ended) loads fail whatever landed."""
        for request_id in request_ids:
            self._ended_loads[request_id] = False

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self.server is not Server.SLOW:
            self._ended_stores |= self._open_stores
            self._open_stores = set()
            for request_id in list(self._open_loads):
                self._end_load(request_id)
        stores, self._ended_stores = self._ended_stores, set()
        loads, self._ended_loads = self._ended_loads, {}
        for request_id, landed in loads.items():
            if not landed:
                self._errors.update(self._load_blocks[request_id])
        return stores, set(loads)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def _end_load(self, request_id: str) -> None:
        if request_id in self._open_loads:
            self._open_loads.discard(request_id)
            self._ended_loads[request_id] = self.server in (Server.ANSWERS, Server.SLOW)


def load(request_id: str, *blocks: int, sync: bool = False, failed: tuple[int, ...] = ()
         ) -> LoadSpec:
    """A load of `blocks`; without blocks, one with nothing to read."""
    items = ((TransferItem.build(request_id, [bytes(CHUNK_HASH_BYTES)], list(blocks)),)
             if blocks else ())
    return LoadSpec(request_id, items, failed, sync)


def store(request_id: str) -> GroupStores:
    """A STORE of one chunk of the request: its item for the one KV cache group."""
    return GroupStores(request_id, ((TransferItem.build(request_id, [bytes(CHUNK_HASH_BYTES)],
                                                        list(range(BLOCK))),),))


@dataclass
class Step:
    """One engine step: what the scheduler's metadata says and what the server does, then
    what the workers report to vLLM and each request's record after the step."""

    server: Server
    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # await_stores
    preempted: list[str] = field(default_factory=list)
    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    errors: set[int] = field(default_factory=set)
    stores_waited: list[str] = field(default_factory=list)  # by handle_preemptions
    then: dict[str, tuple[LoadState, StoreState]] = field(default_factory=dict)


S = Server
HOOK_ROWS = {
    "an async load lands a step later": [
        Step(S.SLOW, loads=[load("a", 1, 2)], then={"a": (ASYNC, IDLE)}),
        Step(S.ANSWERS, recving={"a"}),
    ],
    "an async load whose deadline passes is reported with its blocks failed": [
        Step(S.SLOW, loads=[load("a", 1, 2)], then={"a": (ASYNC, IDLE)}),
        Step(S.TIMES_OUT, recving={"a"}, errors={1, 2}),
    ],
    "a sync load is read in its step and never reported": [
        Step(S.ANSWERS, loads=[load("a", 1, 2, sync=True)]),
    ],
    "a sync load whose deadline passes is recomputed, never reported": [
        Step(S.TIMES_OUT, loads=[load("a", 1, 2, sync=True)], errors={1, 2}),
    ],
    "blocks no chunk covers are load errors in the step of their load": [
        Step(S.ANSWERS, loads=[load("a", 1, 2, sync=True, failed=(3,)),
                               load("b", failed=(9,), sync=True)], errors={3, 9}),
    ],
    "with the server gone every transfer ends at once, loads failed": [
        Step(S.SLOW, stores=["f"], then={"f": (NONE, STORING)}),
        Step(S.GONE, loads=[load("a", 1, 2), load("s", 5, sync=True)], stores=["b"],
             finished=["f"], sending={"f"}, recving={"a"}, errors={1, 2, 5}),
    ],
    "a finished request is reported once its stores are read": [
        Step(S.SLOW, stores=["f"], then={"f": (NONE, STORING)}),
        Step(S.SLOW, finished=["f"], then={"f": (NONE, FREEING)}),
        Step(S.ANSWERS, sending={"f"}),
    ],
    "a finished request with no store open is reported at once": [
        Step(S.SLOW, finished=["f"], sending={"f"}),
    ],
    "a request finished while its load is in flight is reported once the load ends": [
        Step(S.SLOW, loads=[load("a", 1, 2)], then={"a": (ASYNC, IDLE)}),
        Step(S.SLOW, then={"a": (ASYNC, IDLE)}),  # vLLM keeps its blocks meanwhile
        Step(S.ANSWERS, recving={"a"}),
    ],
    "a request finished before its load was sent is reported at once": [
        Step(S.SLOW, loads=[load("a")], recving={"a"}),
    ],
    "a preempted request's open store is waited for before its blocks are reused": [
        Step(S.SLOW, stores=["p", "q"], then={"p": (NONE, STORING), "q": (NONE, STORING)}),
        Step(S.SLOW, preempted=["p"], stores_waited=["p"], then={"q": (NONE, STORING)}),
    ],
    "a request preempted with nothing open waits for nothing, and loads again": [
        Step(S.ANSWERS, loads=[load("p", 1, sync=True)], stores=["p"]),
        Step(S.SLOW, preempted=["p"]),
        Step(S.SLOW, loads=[load("p", 4, 5, sync=True)], stores=["p"],
             then={"p": (NONE, STORING)}),
    ],
    "a request loads and stores in one step": [
        Step(S.SLOW, loads=[load("a", 1, sync=True)], stores=["a"], then={"a": (NONE, STORING)}),
        Step(S.ANSWERS),
    ],
}


def scripted_worker(url: str, **extra):
    """A registered worker connector (one rank, a CPU cache) whose WorkerAdapter a
    ScriptedAdapter replaced, and that adapter."""
    kvcc = kv_cache_config(FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64,
                                             dtype=torch.float16))
    connector, _ = worker_connector(hand_config(url, **extra), kvcc, 0)
    side = connector._worker
    adapter = ScriptedAdapter(side.adapter.adapters[0].registration)
    side.adapter = GroupAdapters([adapter])  # type: ignore[list-item]
    return connector, adapter


@pytest.fixture(params=[True, False], ids=["by layer", "whole"])
def scripted(request, server):
    """scripted_worker, its sync loads read layer by layer or whole; and which."""
    connector, adapter = scripted_worker(server.url, load_by_layer=request.param)
    try:
        yield connector, adapter, request.param
    finally:
        connector.shutdown()


def run_step(connector, step: Step) -> tuple[set[str], set[str], set[int]]:
    """The worker hooks of one step in the order vLLM's model runner calls them."""
    meta = StepMetadata(step.loads, [store(r) for r in step.stores], step.finished,
                        step.preempted)
    connector.handle_preemptions(meta)
    connector.bind_connector_metadata(meta)
    has_sync = any(load.sync for load in meta.loads)
    if has_sync:  # sync loads feed this step's forward pass
        connector.start_load_kv(None)
    read_layers(connector)
    if not has_sync:
        connector.start_load_kv(None)
    connector.wait_for_save()
    results = connector.get_transfer_results(set())
    errors = connector.get_block_ids_with_load_errors()
    connector.clear_connector_metadata()
    return results.finished_sending, results.finished_recving, errors


def expected_sends(step: Step) -> list[tuple[str, list[str]]]:
    """One RETRIEVE for the sync loads (handle_preemptions), one for the rest (start_load_kv),
    one STORE (wait_for_save): each only if it carries something."""
    sync = [spec.request_id for spec in step.loads if spec.items and spec.sync]
    rest = [spec.request_id for spec in step.loads if spec.items and not spec.sync]
    return ([("RETRIEVE", sync)] if sync else []) + ([("RETRIEVE", rest)] if rest else []) + (
        [("STORE", step.stores)] if step.stores else [])


@pytest.mark.parametrize("steps", HOOK_ROWS.values(), ids=HOOK_ROWS.keys())
def test_each_hook_sequence_leads_to_its_states(scripted, steps):
    connector, adapter, _ = scripted
    for number, step in enumerate(steps):
        adapter.server = step.server
        sent, waited = len(adapter.sent), len(adapter.stores_waited)
        reported = run_step(connector, step)
        assert reported == (step.sending, step.recving, step.errors), number
        assert adapter.sent[sent:] == expected_sends(step), number
        assert adapter.stores_waited[waited:] == step.stores_waited, number
        records = connector._worker.requests
        assert {r.request_id: (r.load, r.stores) for r in records.values()} == step.then, number


def test_a_sync_load_is_sent_before_the_pass_and_read_by_it(scripted):
    """handle_preemptions sends it (SYNC_SENT); start_load_kv hands it to the pass (SYNC)
    without sending it again, and either waits for it there (the load ends) or leaves
    each layer to wait for its own and get_finished to wait for the answer. The record
    ends with the load, never reported in finished_recving."""
    connector, adapter, by_layer = scripted
    side = connector._worker
    meta = StepMetadata([load("a", 1, 2, sync=True)])
    connector.handle_preemptions(meta)
    assert side.requests["a"].load is SYNC_SENT and adapter.sent == [("RETRIEVE", ["a"])]
    connector.bind_connector_metadata(meta)
    connector.start_load_kv(None)
    assert adapter.sent == [("RETRIEVE", ["a"])]
    assert (side.requests["a"].load, adapter.loads_waited) == (
        (SYNC, []) if by_layer else (NONE, ["a"]))
    read_layers(connector)
    assert adapter.layers_waited == (list(range(LAYERS)) if by_layer else [])
    connector.wait_for_save()
    assert connector.get_transfer_results(set()).finished_recving == set()
    assert adapter.loads_waited == ["a"] and side.requests == {}
    connector.clear_connector_metadata()


def test_a_pass_that_skips_a_layers_wait_fails_its_loads_then_loads_are_read_whole(server):
    connector, adapter = scripted_worker(server.url)
    try:
        meta = StepMetadata([load("a", 1, 2, sync=True)])
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        connector.start_load_kv(None)  # and no layer waits: the pass reads it unguarded
        assert connector.get_transfer_results(set()).finished_recving == set()
        assert connector.get_block_ids_with_load_errors() == {1, 2}  # recomputed
        connector.clear_connector_metadata()
        assert connector._worker.requests == {}
        step = Step(Server.ANSWERS, loads=[load("b", 3, sync=True)])
        assert run_step(connector, step) == (set(), set(), set())
        assert adapter.loads_waited == ["a", "b"] and adapter.layers_waited == []
    finally:
        connector.shutdown()
