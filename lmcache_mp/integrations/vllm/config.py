"""The connector's options (kv_connector_extra_config) and what it derives from vLLM's config."""

from __future__ import annotations

import hashlib
import logging
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import torch

from ...client.parallel import ParallelStrategy
from ...protocol import MAX_MODEL_CHARS, is_valid_salt

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

MIN_ENGINE_SECRET_CHARS = 16  # a shorter engine_secret could be guessed by other engines

# The options' types: msgspec.convert checks a value against one, and a refusal quotes its
# description.
Text = Annotated[str, msgspec.Meta(description="a string")]
OptionalText = Annotated[str | None, msgspec.Meta(description="a string")]
Switch = Annotated[bool, msgspec.Meta(description="true or false")]
PositiveNumber = Annotated[float, msgspec.Meta(gt=0, description="a positive number")]
NumberOrZero = Annotated[float, msgspec.Meta(ge=0, description="a number, 0 or more")]
PositiveInteger = Annotated[int, msgspec.Meta(gt=0, description="a positive integer")]
IntegerOrZero = Annotated[int, msgspec.Meta(ge=0, description="an integer, 0 or more")]


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's options: the keys of kv_connector_extra_config, all optional."""

    # the server, as given to lmcache-mp-server --url; None: $LMCACHE_MP_URL, else this
    # user's ipc:// socket in the runtime directory (the server's default endpoint)
    url: OptionalText = None
    timeout: PositiveNumber = 5.0  # seconds a worker's registration or other call may take
    # seconds a new request may wait for its lookup: then a miss
    lookup_timeout: PositiveNumber = 1.0
    # seconds the scheduler waits for a new request's LOOKUP reply within the step that
    # sent it, so that the request is admitted in that step (a LOOKUP takes ~0.2 ms);
    # 0: never wait (the request is tried again in the next step)
    lookup_wait: NumberOrZero = 0.002
    # a load of at most this many bytes (per rank) is synchronous: vLLM schedules the
    # request in the step that looks it up, and each worker waits for the load before that
    # step's forward pass (at most load_timeout and a 1 s margin); a larger load is async
    # (the request waits for it outside the batch, and is scheduled a step after it
    # landed); 0: every load is async
    sync_load_max_bytes: IntegerOrZero = 16 * 1024 * 1024
    # a sync load into a KV cache in CPU memory is written layer by layer, and each
    # attention layer of the forward pass waits only for its own layer (vLLM's
    # wait_for_layer_load), so that the pass starts once the first layer has landed;
    # false: the pass waits for the whole load (always so for a cache on a GPU)
    load_by_layer: Switch = True
    # seconds the server may take to start a store's or load's copies; past it (and a
    # 1 s margin) the blocks are vLLM's again: a store is skipped, a load recomputed
    load_timeout: PositiveNumber = 5.0
    chunk_size: PositiveInteger = 256  # tokens per chunk: must equal the server's --chunk-size
    model: Text = ""  # the model's name in cache keys; "" takes vLLM's model (path or name)
    # the secret this engine's scheduler and workers share on the server (holds, MLA
    # groups); "" derives one from vLLM's per-engine random values (engine_secret)
    engine_secret: Text = ""
    # store the KV of generated tokens too, each full chunk once computed, so that the next
    # turn of a conversation (prompt, answer, new message) loads the answer on any engine;
    # false: prompts only (answers that never come back as a prompt take no pool space)
    store_generated: Switch = True
    # with vLLM's KV events on (--kv-events-config): chunks announced at most; past it the
    # oldest is withdrawn (BlockRemoved). Bounds the scheduler's memory (~1 KiB a chunk of
    # 16 blocks); a router then misses only chunks this engine announced long ago
    kv_events_max_chunks: PositiveInteger = 8192

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Typed and checked options; an unknown key is an error (a typo would be silent)."""
        extra = dict(extra or {})
        types = typing.get_type_hints(cls, include_extras=True)
        unknown = sorted(set(extra) - set(types))
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; "
                             f"known: {sorted(types)}")
        values = {name: _checked(name, value, types[name]) for name, value in extra.items()}
        secret = values.get("engine_secret", "")
        if secret and len(secret) < MIN_ENGINE_SECRET_CHARS:
            raise ValueError(f"kv_connector_extra_config['engine_secret']: at least "
                             f"{MIN_ENGINE_SECRET_CHARS} characters (other engines on the node "
                             f"must not guess it), got {len(secret)}")
        return cls(**values)


def _checked(name: str, value: Any, option_type: Any) -> Any:
    """`value` as the option's type (an int for a number is made a float), or ValueError
    quoting what the type expects."""
    try:
        return msgspec.convert(value, option_type)
    except msgspec.ValidationError:
        expected = option_type.__metadata__[0].description
        raise ValueError(f"kv_connector_extra_config[{name!r}]: expected {expected}, "
                         f"got {value!r}") from None


@dataclass(frozen=True)
class KVGeometry:
    """What makes a chunk's bytes differ for the same tokens, from vLLM's config alone: the
    scheduler (which has no KV tensors) and every worker derive the same value, and it is
    part of the model name in every cache key, so that a LOOKUP finds only chunks its
    engine's workers can load (the server's RETRIEVE refuses chunks of another geometry)."""

    layout: str  # "mha" or "mla"
    dtype: str  # the KV cache's: vLLM's --kv-cache-dtype (fp8 variants apart), else the model's
    num_layers: int  # the model's, over every pipeline stage
    pipeline_parallel_size: int  # how the layers are split between kv ranks
    heads_per_rank: int  # KV heads in each rank's cache (1 under MLA)
    head_size: int  # per head (under MLA: the latent vector's width)
    block_size: int  # the server only moves chunks between caches of the same block size

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> KVGeometry:
        model_config = _model_config(vllm_config)
        parallel_config = vllm_config.parallel_config
        dtype = vllm_config.cache_config.cache_dtype
        if dtype == "auto":
            dtype = str(model_config.dtype).removeprefix("torch.")
        return cls("mla" if model_config.use_mla else "mha", str(dtype),
                   model_config.get_total_num_hidden_layers(),
                   parallel_config.pipeline_parallel_size,
                   model_config.get_num_kv_heads(parallel_config), model_config.get_head_size(),
                   vllm_config.cache_config.block_size)

    def bytes_per_token(self) -> int:
        """Bytes of one token's KV in one rank's cache (its pipeline stage's layers)."""
        dtype = getattr(torch, self.dtype, None)  # none for vLLM's fp8 variants: 1 byte
        itemsize = dtype.itemsize if isinstance(dtype, torch.dtype) else 1
        per_layer = (1 if self.layout == "mla" else 2) * self.heads_per_rank * self.head_size
        return -(-self.num_layers // self.pipeline_parallel_size) * per_layer * itemsize

    def key(self) -> str:
        return (f"{self.layout}-{self.dtype}-L{self.num_layers}-pp{self.pipeline_parallel_size}"
                f"-H{self.heads_per_rank}x{self.head_size}-B{self.block_size}")


def _model_config(vllm_config: VllmConfig):
    if vllm_config.model_config is None:
        raise ValueError("no model: vllm_config has no model_config")
    return vllm_config.model_config


def model_name(config: ConnectorConfig, vllm_config: VllmConfig, groups_key: str = "") -> str:
    """The model in every cache key of this engine, the scheduler's and the workers' alike:
    the `model` option (else vLLM's model, path or name) with the KVGeometry appended, and
    `groups_key`, the KV cache groups of a hybrid engine (groups.groups_suffix). A name too
    long for the protocol is replaced by its SHA-256."""
    name = config.model or _model_config(vllm_config).model
    suffix = "@" + KVGeometry.from_vllm(vllm_config).key() + groups_key
    if len(name) + len(suffix) > MAX_MODEL_CHARS:
        name = "sha256:" + hashlib.sha256(name.encode()).hexdigest()
    return name + suffix


def engine_secret(config: ConnectorConfig, vllm_config: VllmConfig) -> str:
    """The `engine=` secret of this engine's CacheClients, the same in its scheduler and in
    every worker, and different in every other engine and data-parallel rank.

    vLLM 0.33 gives each engine two values that its scheduler and its workers both see in
    vllm_config (the workers receive the engine core's config): kv_transfer_config.engine_id,
    a uuid4 made when the config is (vLLM suffixes it with `_dp<rank>` per data-parallel
    rank, and syncs it from TP rank 0), and instance_id, the nanosecond clock at which
    VllmConfig was made. Neither is meant as a secret (engine_id is told to the peers of
    NIXL-style connectors, and an operator may set it), so kv_connector_extra_config key
    `engine_secret` takes one of the operator's instead. The data-parallel rank is mixed in
    either way: every DP rank is an engine of its own, with its own scheduler.
    """
    dp_rank = vllm_config.parallel_config.data_parallel_rank
    if config.engine_secret:
        source = f"engine_secret\0{config.engine_secret}"
    else:
        kv_transfer = vllm_config.kv_transfer_config
        engine_id = kv_transfer.engine_id if kv_transfer is not None else None
        if not engine_id or not vllm_config.instance_id:
            raise ValueError("vllm_config has no kv_transfer_config.engine_id or instance_id "
                             "to derive the engine secret from: set "
                             "kv_connector_extra_config['engine_secret']")
        source = f"vllm\0{engine_id}\0{vllm_config.instance_id}"
    return hashlib.sha256(f"lmcache-mp engine secret\0{source}\0dp{dp_rank}".encode()
                          ).hexdigest()


@dataclass(frozen=True)
class Roles:
    """What an engine does with the cache, from vLLM's kv_role: kv_both loads and stores,
    kv_producer (a prefill engine) only stores, kv_consumer (a decode engine) only loads."""

    loads: bool  # LOOKUP and RETRIEVE
    stores: bool  # STORE

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig) -> Roles:
        kv_transfer = vllm_config.kv_transfer_config
        assert kv_transfer is not None  # vLLM makes a connector only from one
        # vLLM's own reading of kv_role: each of these is true for kv_both
        return cls(loads=kv_transfer.is_kv_consumer, stores=kv_transfer.is_kv_producer)


def uses_mla(vllm_config: VllmConfig) -> bool:
    model_config = vllm_config.model_config
    return bool(model_config is not None and model_config.use_mla)


def parallel_strategy(vllm_config: VllmConfig, rank: int) -> ParallelStrategy:
    """This process's place in vLLM's TP × PP layout (rank 0 for the scheduler)."""
    p = vllm_config.parallel_config
    pcp = getattr(p, "prefill_context_parallel_size", 1)
    dcp = getattr(p, "decode_context_parallel_size", 1)
    if pcp != 1 or dcp != 1:
        raise ValueError(f"lmcache-mp supports tensor and pipeline parallelism only; context "
                         f"parallelism (prefill {pcp}, decode {dcp}) splits a request's KV "
                         f"across ranks in a way it does not know")
    return ParallelStrategy(uses_mla(vllm_config), p.tensor_parallel_size
                            * p.pipeline_parallel_size, rank, p.tensor_parallel_size,
                            p.pipeline_parallel_size)


def server_salt(cache_salt: str | None) -> str:
    """vLLM's cache_salt as the server takes it: a salt the protocol refuses (longer than 256
    characters, spaces, non-ASCII) becomes a digest of itself, so tenants stay apart."""
    salt = cache_salt or ""
    if is_valid_salt(salt):
        return salt
    return "sha256:" + hashlib.sha256(salt.encode()).hexdigest()


def warn_if_loads_fail_requests(vllm_config: VllmConfig) -> None:
    """At start-up: vLLM 0.33's default kv_load_failure_policy "fail" fails a request whose
    load fails, where this cache would have it recomputed."""
    kv_transfer = vllm_config.kv_transfer_config
    if kv_transfer is not None and getattr(kv_transfer, "kv_load_failure_policy",
                                           None) == "fail":
        logger.warning(
            "vLLM's kv_load_failure_policy is \"fail\" (vLLM's default): a load from "
            "lmcache-mp-server that fails (the server is gone, a chunk was evicted) will fail "
            "the request instead of recomputing it. Add \"kv_load_failure_policy\": "
            "\"recompute\" to --kv-transfer-config")
