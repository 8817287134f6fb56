"""The worker side's record of each request: where its load and its stores stand on one rank."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class LoadState(enum.Enum):
    """Where a request's load stands on this rank (RequestTransfers.load).

    An async load: NONE -> ASYNC (sent) -> LANDED (the adapter reports it, landed or
    failed) -> NONE (get_finished reports it in finished_recving); one with nothing to read
    goes NONE -> LANDED at once. A sync load: NONE -> SYNC_SENT (handle_preemptions sent
    it) -> SYNC (start_load_kv: this step's forward pass reads it) -> NONE (the adapter
    reports it; vLLM waits for nothing, so it is never reported in finished_recving).
    """

    NONE = "none"  # no load of the request on this rank, or it was reported
    SYNC_SENT = "sync, sent"  # sent before the forward pass: start_load_kv sends it no more
    SYNC = "sync"  # this step's forward pass reads it; it ends once the adapter reports it
    ASYNC = "async"  # sent; vLLM keeps the request in WAITING_FOR_REMOTE_KVS meanwhile
    LANDED = "landed"  # an async load ended, landed or not: the next finished_recving says so


class StoreState(enum.Enum):
    """Where a request's STOREs stand on this rank (RequestTransfers.stores).

    NONE -> STORING (a STORE sent) -> NONE (the adapter reports every one read); a request
    vLLM finished (StepMetadata.await_stores) goes STORING -> FREEING -> READ once they
    are read, or NONE -> READ, and READ -> NONE when get_finished reports it in
    finished_sending (vLLM frees its blocks then).
    """

    NONE = "none"  # no STORE of the request open
    STORING = "storing"  # STOREs sent that the server may still read
    FREEING = "freeing"  # finished: vLLM keeps its blocks until its STOREs are read
    READ = "read"  # finished, and its STOREs read: the next finished_sending says so


# loads that feed a forward pass: vLLM waits for nothing, so they are never reported
_SYNC_LOADS = (LoadState.SYNC_SENT, LoadState.SYNC)


@dataclass
class RequestTransfers:
    """Everything one worker knows about one request's transfers: its load and its stores
    (a request may load and store in the same step, so each has its own state). The
    transitions below are the only writers; each is named for what happened and says in
    which hook. A record whose load and stores are both NONE is dropped (idle)."""

    request_id: str
    load: LoadState = LoadState.NONE
    stores: StoreState = StoreState.NONE

    @property
    def idle(self) -> bool:
        return self.load is LoadState.NONE and self.stores is StoreState.NONE

    @property
    def storing(self) -> bool:
        """STOREs of the request that the server may still read are open."""
        return self.stores in (StoreState.STORING, StoreState.FREEING)

    # -- its load ----------------------------------------------------------------------------

    def load_sent(self, sync: bool) -> None:
        """A RETRIEVE carries the request's load: its sync load (handle_preemptions, or
        start_load_kv when that did not run) or its async one (start_load_kv)."""
        self.load = LoadState.SYNC_SENT if sync else LoadState.ASYNC

    def nothing_to_load(self) -> None:
        """start_load_kv: an async load with nothing to read (vLLM finished the request
        before it was sent): reported at once."""
        self.load = LoadState.LANDED

    def read_by_pass(self) -> None:
        """start_load_kv: this step's forward pass reads the sync load, once it has landed
        (start_load_kv waits for it) or layer by layer (each wait_for_layer_load)."""
        self.load = LoadState.SYNC

    def load_ended(self) -> None:
        """The adapter reports the load landed or failed (its failed blocks are its load
        errors): a sync one ends here, any other is reported in the next get_finished."""
        self.load = LoadState.NONE if self.load in _SYNC_LOADS else LoadState.LANDED

    # -- its stores --------------------------------------------------------------------------

    def store_sent(self) -> None:
        """wait_for_save: a STORE carries chunks of the request."""
        self.stores = (StoreState.FREEING if self.stores in (StoreState.FREEING, StoreState.READ)
                       else StoreState.STORING)

    def request_finished(self) -> None:
        """get_finished: vLLM finished the request (await_stores) and frees its blocks once
        every rank has reported its STOREs read."""
        self.stores = StoreState.FREEING if self.storing else StoreState.READ

    def stores_read(self) -> None:
        """The adapter reports every STORE of the request read (or past its deadline)."""
        if self.stores is StoreState.STORING:
            self.stores = StoreState.NONE
        elif self.stores is StoreState.FREEING:
            self.stores = StoreState.READ

    # -- what get_finished tells vLLM --------------------------------------------------------

    def reported(self) -> None:
        """get_finished reported what was due: a READ request in finished_sending, a
        LANDED load in finished_recving."""
        if self.stores is StoreState.READ:
            self.stores = StoreState.NONE
        if self.load is LoadState.LANDED:
            self.load = LoadState.NONE


@dataclass
class LayerByLayerRead:
    """The sync loads this step's forward pass reads layer by layer (load_by_layer), made by
    start_load_kv and ended by get_finished; the layers whose wait_for_layer_load came."""

    request_ids: list[str]
    layers_waited: set[int] = field(default_factory=set)
