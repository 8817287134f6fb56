"""The vLLM connector: vLLM's scheduler and workers share prefix KV through lmcache-mp-server.

Load it with

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "LMCacheMPServerConnector",
        "kv_connector_module_path": "lmcache_mp.integrations.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"chunk_size": 256}}'

A server on its default endpoint (this user's ipc:// socket in the runtime directory) needs
no `url`. Written and tested for vLLM 0.33.0 (KVConnectorBase_V1). This is the only package
of lmcache_mp that imports vllm: one module per role (connector.py, the front class;
scheduler.py, with its record per request in tracking.py and its KV events in events.py;
worker.py, with its record per request in transfers.py and a WorkerAdapter per KV cache
group in adapters.py) and what they share (config.py, metadata.py, layout.py,
allocation.py, and groups.py: vLLM's KV cache groups under its hybrid KV cache manager,
which the connector supports, SupportsHMA).

vLLM builds one connector per process: LMCacheMPServerConnector is a thin front that hands
every hook to a SchedulerSide (the scheduler process: lookups, per-request bookkeeping with
VllmRequestTracker, the metadata of each step, the KV events) or a WorkerSide (each worker
process, one per rank: registers its KV cache, starts the stores and loads the metadata
asks for, reports what finished, with one RequestTransfers per request). Either side
keeps everything it knows about a request in one record with explicit states. The
scheduler tells the workers what to do only through StepMetadata.

A load of at most sync_load_max_bytes is synchronous: vLLM schedules the request in the
step that looks it up, and the workers wait for the load (bounded by its deadline) before
that step's forward pass. A larger one is asynchronous: the request waits in vLLM's
WAITING_FOR_REMOTE_KVS state while the server copies its chunks into its blocks, and no
forward pass waits for them.
kv_role decides what an engine does: kv_both loads and stores, kv_producer only stores,
kv_consumer only loads. Stores (of the prompt's full chunks and, unless store_generated
is false, of the generated tokens') start after the forward pass that computed them; a
finished request's blocks are freed only once its stores have been read. A server that
cannot be reached turns lookups into misses (after lookup_timeout), stores into no-ops
and loads into recomputation.

The scheduler's and the workers' CacheClients of one engine share an engine secret
(`engine_secret`): the server lets only sessions with the same secret release each
other's lookup holds and form an MLA group, so other engines on the node cannot.
"""

from .config import ConnectorConfig
from .connector import LMCacheMPServerConnector
from .metadata import LoadSpec, StepMetadata

__all__ = ["ConnectorConfig", "LMCacheMPServerConnector", "LoadSpec", "StepMetadata"]
