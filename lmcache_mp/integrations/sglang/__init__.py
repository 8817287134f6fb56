"""SGLang's HiCache storage backend: SGLang engines share prefix KV through lmcache-mp-server.

Load it with

    python -m sglang.launch_server --model-path MODEL --page-size 64 \\
        --enable-hierarchical-cache --hicache-mem-layout layer_first \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "lmcache_mp", "module_path": "lmcache_mp.integrations.sglang",
          "class_name": "LMCacheMPStorage", "interface_v1": 1}'

Written and tested for SGLang 0.5.23 (docs/sglang.md says what is supported). This is the
only package of lmcache_mp that imports sglang: backend.py, the HiCacheStorage SGLang
builds; link.py, its talk with the server, pipelined through staging.py, the registered
staging segment in two halves; pages.py, a host pool's pages in canonical byte order;
keys.py, SGLang's page keys as chunk hashes; config.py, the extra-config fields and the
namespace (model, geometry, rank) pages are stored under.
"""

from .backend import LMCacheMPStorage
from .config import BackendConfig

__all__ = ["BackendConfig", "LMCacheMPStorage"]
