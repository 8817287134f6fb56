"""The backend's settings (SGLang's extra-config JSON) and the server namespace of its pages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 2.0
# Without staging_pages: as many pages as this holds, within the bounds below. Halves of
# 32 MiB are large enough that a round trip costs little beside the copies, and small
# enough that SGLang's batches (at most 128 pages) go through several of them.
DEFAULT_STAGING_BYTES = 64 << 20
DEFAULT_STAGING_BOUNDS = (2, 128)
MAX_STAGING_PAGES = 4096
_FIELDS = {"url", "cache_salt", "model", "timeout_s", "staging_pages", "zero_copy"}
# Read by SGLang itself (its factory, its allocator choice, --file-storage-path), not by us.
_SGLANG_FIELDS = {"backend_name", "module_path", "class_name", "interface_v1", "allocator",
                  "file_storage_path", "enable_metadata_cache", "metadata_ttl"}


@dataclass(frozen=True)
class BackendConfig:
    """What `--hicache-storage-backend-extra-config` may say beyond SGLang's own fields.

    `url`: the server's endpoint ("" is this user's default ipc:// socket); `cache_salt`:
    the tenant every page of this engine is stored under (SGLang mixes a request's own
    salt into its page keys, and passes the backend none); `model`: the name pages are
    shared under (default SGLang's model name); `timeout_s`: the longest a LOOKUP, STORE
    or RETRIEVE may take before it counts as a miss; `staging_pages`: pages the staging
    segment holds, in two halves (None: staging_pages_for picks); `zero_copy`: move a
    layer_first host pool into memory the server maps (host_pool.moved_pool), so that its
    pages bypass the staging segment (False: every page goes through staging)."""

    url: str = ""
    cache_salt: str = ""
    model: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    staging_pages: int | None = None
    zero_copy: bool = True

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> BackendConfig:
        """Raises ValueError naming the field that is missing, unknown or wrong."""
        extra = extra or {}
        if not extra.get("interface_v1"):
            raise ValueError('lmcache-mp needs "interface_v1": 1 in '
                             '--hicache-storage-backend-extra-config')
        unknown = sorted(set(extra) - _FIELDS - _SGLANG_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) in --hicache-storage-backend-extra-config: "
                             f"{', '.join(unknown)}")
        config = cls(url=str(extra.get("url", "")), cache_salt=str(extra.get("cache_salt", "")),
                     model=str(extra.get("model", "")),
                     timeout_s=float(extra.get("timeout_s", DEFAULT_TIMEOUT_S)),
                     staging_pages=_staging_pages(extra.get("staging_pages")),
                     zero_copy=_flag(extra, "zero_copy", True))
        if not 0 < config.timeout_s <= 60:
            raise ValueError(f"timeout_s must be in (0, 60] seconds, got {config.timeout_s}")
        if config.staging_pages is not None and not 0 < config.staging_pages <= MAX_STAGING_PAGES:
            raise ValueError(f"staging_pages must be in 1..{MAX_STAGING_PAGES}, got "
                             f"{config.staging_pages}")
        return config

    def staging_pages_for(self, page_bytes: int) -> int:
        """Pages of the staging segment: staging_pages, or as many as DEFAULT_STAGING_BYTES
        holds, within DEFAULT_STAGING_BOUNDS."""
        if self.staging_pages is not None:
            return self.staging_pages
        least, most = DEFAULT_STAGING_BOUNDS
        return max(least, min(most, DEFAULT_STAGING_BYTES // page_bytes))


def _flag(extra: dict[str, Any], field: str, default: bool) -> bool:
    value = extra.get(field, default)
    if not isinstance(value, bool):
        raise ValueError(f"{field} must be true or false, got {value!r}")
    return value


def _staging_pages(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"staging_pages must be an integer, got {value!r}")
    return value


@dataclass(frozen=True)
class Namespace:
    """Where this rank's pages live on the server: the registration's model name carries
    SGLang's geometry (the server's keys do not), kv_world_size and kv_worker_id its rank."""

    model: str
    kv_world_size: int
    kv_worker_id: int
    writes: bool  # SGLang's is_storage_writer: under MLA one rank stores for the group


def namespace(model: str, geometry: str, tp_rank: int, tp_size: int, pp_rank: int,
              pp_size: int, is_mla: bool, is_writer: bool) -> Namespace:
    """MHA ranks each hold their own shard (one kv worker a rank); MLA ranks of a pipeline
    stage hold the same latent cache (one kv worker a stage)."""
    name = f"sglang:{model}:{geometry}"
    if is_mla:
        return Namespace(name, pp_size, pp_rank, is_writer)
    return Namespace(name, pp_size * tp_size, pp_rank * tp_size + tp_rank, True)
